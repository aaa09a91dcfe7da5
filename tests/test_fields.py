"""Per-sample fields: packed from CSV/JSONL lists, tar members and dataset dicts, checked at open
like the rest of a store, and yielded by the Loader with each sample through shuffling, sharding,
resume and the replacement of undecodable samples."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.augment import Normalize, RandomResizedCrop
from gpufeed.loader.jpeg import DecodeError
from gpufeed.packing.packer import PackError
from gpufeed.store.format import Manifest, StoreError
from gpufeed.store.summary import describe
from gpufeed.synth import natural_image

OPS = [RandomResizedCrop(16, scale=(0.5, 1)), Normalize()]


def samples(n=20, seed=0):
    rng = np.random.default_rng(seed)
    return [{"image": natural_image(rng, 24 + k % 5, 28, k), "label": k % 3, "id": k, "score": k / 4,
             "emb": np.arange(4, dtype=np.float32) + k, "caption": f"photo {k}", "meta": {"k": [k, "x"]},
             "raw": bytes([k]) * 3} for k in range(n)]


@pytest.fixture(scope="module", params=["raw", "jpeg"])
def store(request, tmp_path_factory):
    dest = tmp_path_factory.mktemp("fields") / request.param
    gpufeed.pack(samples(), dest, mode=request.param, size=16, progress=False, workers=1)
    return gpufeed.open(dest)


def test_a_dataset_dicts_other_keys_become_typed_fields(store):
    assert store.fields == {"id": {"kind": "int"}, "score": {"kind": "float"},
                            "emb": {"kind": "array", "dtype": "<f4", "shape": [4]}, "caption": {"kind": "str"},
                            "meta": {"kind": "json"}, "raw": {"kind": "bytes"}}
    assert store.field("id", 5) == 5 and store.field("score", 6) == 1.5 and store.field("caption", 7) == "photo 7"
    assert store.field("meta", 3) == {"k": [3, "x"]} and store.field("raw", 2) == b"\x02\x02\x02"
    assert np.array_equal(store.field("emb", 9), np.arange(4, dtype=np.float32) + 9)
    assert store.field("label", 4) == 1 and store.field("source", 4) == "list[4]"
    assert "emb (f4 array 4)" in describe(store)


def test_the_loader_yields_fields_with_their_samples(store):
    ops = OPS if store.mode == "jpeg" else None
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=3,
                            fields=("label", "source", "id", "emb", "caption", "meta"))
    seen = []
    for batch in loader:
        ids = batch["id"].tolist()
        seen += ids
        assert batch["image"].shape[0] == 8 and batch["id"].dtype == torch.int64 and batch["emb"].shape == (8, 4)
        assert torch.equal(batch["emb"][:, 0].long(), batch["id"]) and torch.equal(batch["label"], batch["id"] % 3)
        assert batch["caption"] == [f"photo {i}" for i in ids] and batch["source"] == [f"list[{i}]" for i in ids]
        assert [m["k"][0] for m in batch["meta"]] == ids
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 16  # shuffled, each once, the tail dropped
    with pytest.raises(ValueError, match="no field 'nope'.*id, score"):
        gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, fields=("nope",))


def test_fields_follow_sharding_and_resume(store):
    ops = OPS if store.mode == "jpeg" else None
    make = lambda rank: gpufeed.Loader(store, batch_size=4, device="cpu", augment=ops, seed=1, rank=rank,  # noqa: E731
                                       world_size=2, fields=("id",))
    ranks = [[b["id"].tolist() for b in make(r)] for r in (0, 1)]
    assert not set(sum(ranks[0], [])) & set(sum(ranks[1], []))
    loader = make(0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = make(0)
    resumed.load_state_dict(state)
    assert next(iter(resumed))["id"].tolist() == next(it)["id"].tolist() == ranks[0][1]


def test_an_undecodable_samples_replacement_brings_its_own_fields(tmp_path):
    gpufeed.pack(samples(16), tmp_path / "s", mode="jpeg", progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    start, end = int(store.offsets[7]), int(store.offsets[8])
    with open(store.path / "data.bin", "r+b") as f:
        f.seek(start)
        f.write(b"\0" * (end - start))
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=OPS, fields=("id", "label"))  # training
    number = next(n for n in range(2) if 7 in loader.plan(0, n)[0].tolist())
    batch = list(loader)[number]
    k = int(loader.plan(0, number)[0].tolist().index(7))
    assert int(batch["id"][k]) != 7 and torch.equal(batch["image"][k], batch["image"][batch["id"].tolist().index(
        int(batch["id"][k]))]) and int(batch["label"][k]) == int(batch["id"][k]) % 3
    assert loader.skipped == []  # replaced, not left out


# drop_last=True keeps batches full, shuffled or not: tests/test_edges_loader.py
@pytest.mark.parametrize("evaluation", [{"shuffle": False, "drop_last": False}, {"drop_last": False},
                                        {"drop_last": False, "pad": False}])
def test_an_evaluation_pass_leaves_an_undecodable_sample_out_and_names_it(tmp_path, evaluation):
    gpufeed.pack(samples(16), tmp_path / "s", mode="jpeg", progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    for broken in (7, 12, 13, 14, 15):  # 7 alone in its batch; 12..15 a whole batch of four
        start, end = int(store.offsets[broken]), int(store.offsets[broken + 1])
        with open(store.path / "data.bin", "r+b") as f:
            f.seek(start)
            f.write(b"\0" * (end - start))
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=OPS, fields=("id", "label", "source"),
                            seed=1, **evaluation)
    batches = list(loader)
    ids = [i for b in batches for i in b["id"].tolist()]
    assert sorted(ids) == [i for i in range(16) if i not in (7, 12, 13, 14, 15)]  # each once, none replaced
    assert all(len(b["image"]) == len(b["label"]) == len(b["id"]) == len(b["source"]) > 0 for b in batches)
    assert all(int(label) == i % 3 for b in batches for i, label in zip(b["id"].tolist(), b["label"]))
    assert sorted(s.sample for s in loader.skipped) == [7, 12, 13, 14, 15]
    assert all(s.reason and s.source == store.source(s.sample) for s in loader.skipped)
    assert loader.state_dict()["epoch"] == 1  # the empty batch was passed, the epoch finished
    raising = gpufeed.Loader(store, batch_size=4, device="cpu", augment=OPS, on_error="raise", **evaluation)
    with pytest.raises(DecodeError, match="sample 7|sample 1[2-5]"):
        list(raising)


def test_csv_columns_and_jsonl_keys(tmp_path):
    rng = np.random.default_rng(1)
    for k in range(4):
        Image.fromarray(natural_image(rng, 24, 24, k)).save(tmp_path / f"{k}.png")
    (tmp_path / "l.csv").write_text("path,label,weight,note\n" + "".join(
        f"{k}.png,{k % 2},{k * 1.5 if k else 2},n{k}\n" for k in range(4)))
    gpufeed.pack(tmp_path / "l.csv", tmp_path / "c", size=16, progress=False, workers=1)
    csv_store = gpufeed.open(tmp_path / "c")
    assert csv_store.fields == {"weight": {"kind": "float"}, "note": {"kind": "str"}}
    assert [csv_store.field("weight", i) for i in range(4)] == [2.0, 1.5, 3.0, 4.5]
    rows = [{"path": f"{k}.png", "label": k % 2, "tags": ["a"] * k, "box": [k, 1]} for k in range(4)]
    rows[2]["extra"] = 1
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    report = gpufeed.pack(tmp_path / "l.jsonl", tmp_path / "j", size=16, progress=False, workers=1)
    assert report.count == 3 and "an extra 'extra'" in report.skipped[0]["reason"]
    jsonl_store = gpufeed.open(tmp_path / "j")
    assert jsonl_store.field("tags", 2) == ["a"] * 3 and jsonl_store.fields["box"] == {"kind": "array", "dtype": "<i8", "shape": [2]}


def test_tar_members_become_fields(tmp_path):
    rng = np.random.default_rng(2)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for k in range(3):
            buf = io.BytesIO()
            Image.fromarray(natural_image(rng, 24, 24, k)).save(buf, format="JPEG")
            npy = io.BytesIO()
            np.save(npy, np.full((2, 3), k, dtype=np.int16))
            parts = {"jpg": buf.getvalue(), "cls": str(k).encode(), "npy": npy.getvalue()}
            if k != 1:  # text and JSON may be missing
                parts |= {"json": json.dumps({"k": k}).encode(), "txt": f"text {k}".encode()}
            for ext, data in parts.items():
                info = tarfile.TarInfo(f"s{k}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    gpufeed.pack(tmp_path / "shard.tar", tmp_path / "t", mode="jpeg", progress=False, workers=1)
    store = gpufeed.open(tmp_path / "t")
    assert store.fields["npy"] == {"kind": "array", "dtype": "<i2", "shape": [2, 3]}
    assert store.field("json", 2) == {"k": 2} and store.field("txt", 2) == "text 2"
    assert store.field("json", 1) is None and store.field("txt", 1) == "" and len(store) == 3
    assert int(store.field("npy", 2)[1, 2]) == 2


def test_bad_field_values_are_skipped_with_the_reason(tmp_path):
    data = samples(4)
    data[1]["emb"] = np.zeros(5, np.float32)
    data[2]["id"] = object()
    data[3]["bad name"] = 1
    report = gpufeed.pack(data, tmp_path / "s", size=16, progress=False, workers=1)
    reasons = {s["path"]: s["reason"] for s in report.skipped}
    assert report.count == 1 and "shape (5,)" in reasons["list[1]"] and "field 'id' is a object" in reasons["list[2]"]
    assert "not an identifier" in reasons["list[3]"]
    with pytest.raises(PackError, match="shape"):
        gpufeed.pack(data[:2], tmp_path / "r", size=16, progress=False, workers=1, on_error="raise")


@pytest.mark.parametrize("spec", [{"kind": "array", "dtype": "|O", "shape": [2]}, {"kind": "int", "x": 1},
                                  {"kind": "array", "dtype": "<f4", "shape": [0]}, {"kind": "tensor"}])
def test_a_hostile_field_entry_is_refused(tmp_path, spec):
    gpufeed.pack(samples(2), tmp_path / "s", size=16, progress=False, workers=1)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["fields"]["id"] = spec
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="manifest field fields\\['id'\\]"):
        Manifest.read(tmp_path / "s")
    manifest["fields"] = {"../x": {"kind": "int"}}
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="fields\\['../x'\\]"):
        gpufeed.open(tmp_path / "s")


def test_damaged_variable_field_offsets_are_detected(tmp_path):
    gpufeed.pack(samples(4), tmp_path / "s", size=16, progress=False, workers=1)
    offsets = np.fromfile(tmp_path / "s" / "field.caption.i64", dtype="<i8")
    offsets[2] = 10**9
    offsets.tofile(tmp_path / "s" / "field.caption.i64")
    with pytest.raises(StoreError, match="field.caption.i64: entry 2"):
        gpufeed.open(tmp_path / "s")


def test_a_version_2_store_opens_and_may_not_list_fields(tmp_path):
    gpufeed.pack(samples(3), tmp_path / "s", size=16, progress=False, workers=1)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["version"] = 2
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="version 2 holds no fields"):
        gpufeed.open(tmp_path / "s")
    for name in list(manifest["files"]):
        if name.startswith("field."):
            del manifest["files"][name]
    del manifest["fields"]
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    store = gpufeed.open(tmp_path / "s")
    assert store.fields == {} and len(store) == 3 and store.source(1) == "list[1]"
