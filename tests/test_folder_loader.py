"""Reading JPEGs in place (`Loader("folder/")`): the same batches as a store packed from the same
files with their bytes kept, from folders, lists and tar shards, on threads and in decode workers;
what can't be read in place is skipped with its reason; the header index is cached and refreshed."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.decode.tuning import Tuning
from gpufeed.augment import Normalize, RandomResizedCrop
from gpufeed.loader import folder
from gpufeed.loader.jpeg import DecodeError
from gpufeed.sources import headers
from gpufeed.sources import SourceError
from conftest import mixed_folder
from gpufeed.synth import natural_image

OPS = [RandomResizedCrop(24, scale=(0.3, 1)), Normalize()]


def _jpegs(root, n=16, seed=0):
    rng = np.random.default_rng(seed)
    for k in range(n):
        path = root / f"c{k % 2}" / f"{k:02d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(natural_image(rng, 30 + k, 40, k)).save(path, quality=90)
    return root


def _same_batches(a, b):
    count = 0
    for x, y in zip(a, b):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
        assert x["source"] == y["source"]
        count += 1
    assert count == len(a) == len(b) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_gives_the_batches_of_its_packed_store(tmp_path, workers):
    _jpegs(tmp_path / "img")
    gpufeed.pack(tmp_path / "img", tmp_path / "store", mode="jpeg", reencode=False, progress=False, workers=1)
    make = lambda path: gpufeed.Loader(path, batch_size=4, device="cpu", augment=OPS, num_workers=workers,  # noqa: E731
                                       seed=3, fields=("label", "source"))
    in_place, packed = make(tmp_path / "img"), make(tmp_path / "store")
    assert isinstance(in_place.store, folder.FolderStore) and in_place.tier.name == "files"
    assert in_place.store.classes == ["c0", "c1"]
    _same_batches(in_place, packed)
    in_place.close()
    packed.close()


def test_each_batch_is_read_once_while_the_ones_before_decode(tmp_path, monkeypatch):
    _jpegs(tmp_path / "img")
    loader = gpufeed.Loader(tmp_path / "img", batch_size=4, device="cpu", augment=OPS, num_workers=0, seed=1)
    events, read_later = [], loader.store.read_later
    (batcher,) = loader.jpeg.pipelines
    finish = batcher.scheduler.finish

    def recorded(indices, first=None):
        events.append(("read", indices.tolist()))
        return read_later(indices, first)

    def decode(*args, **kwargs):
        events.append(("decode", None))
        return finish(*args, **kwargs)

    monkeypatch.setattr(loader.store, "read_later", recorded)
    monkeypatch.setattr(batcher.scheduler, "finish", decode)
    assert sum(len(images) for images, _ in loader) == 16
    # the first two batches are read when asked (the second is started with the first); each later
    # one is read while the two before it decode
    assert [kind for kind, _ in events][:8] == ["read"] * 3 + ["decode", "read"] + ["decode", "read", "decode"]
    for times in (2, 1):  # every file read once per epoch: after the first, also the next epoch's, made ahead
        loader.carried.join()
        reads = [batch for kind, batch in events if kind == "read"]
        assert sorted(k for batch in reads for k in batch) == sorted(list(range(16)) * times)
        events.clear()
        assert sum(len(images) for images, _ in loader) == 16
    loader.close()


def test_a_batch_read_in_part_reads_the_rest_as_its_decoders_ask(tmp_path, monkeypatch):
    """`read_later(indices, first)` reads only the images at `first` now (those this process's decoders
    will likely take); another is read when a decoder makes its part readable, and one nobody asks for
    is never read. The bytes are the whole read's."""
    _jpegs(tmp_path / "img", n=8)
    store = folder.FolderStore(tmp_path / "img")
    whole = store.read(np.arange(8))
    opened, real_open = [], os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    named = lambda ks: sorted(store.source(k) for k in ks)  # noqa: E731
    batch = store.read_later(np.arange(8), first=np.array([5, 1]))()
    assert sorted(opened) == named([1, 5])
    with pytest.raises(RuntimeError, match="readable"):  # not read yet: no decoder may take its bytes unasked
        batch.take(np.array([0])).arrays()
    part = batch.take(np.array([0, 5, 6])).readable()
    assert sorted(opened) == named([0, 1, 5, 6])  # 5 was read already; 2, 3, 4 and 7 never are
    assert [a.tobytes() for a in part.arrays()] == [a.tobytes() for a in whole.take(np.array([0, 5, 6])).arrays()]
    assert store.read_later(np.arange(8), first=np.arange(8))().fill is None  # all read: nothing left to ask


def test_a_folder_whose_workers_decode_every_image_reads_no_file_in_the_loader(tmp_path, monkeypatch):
    """The decode workers read their share of a batch from its files themselves; the loader's process
    reads ahead only its own decoders' likely share (the GPU decoders'). On a CPU the workers decode
    every image, so the loader reads none (it used to read each image once for nothing)."""
    _jpegs(tmp_path / "img")
    loader = gpufeed.Loader(tmp_path / "img", batch_size=4, device="cpu", augment=OPS, num_workers=2, seed=1)
    reads, real_preadv = [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, at: reads.append(at) or real_preadv(fd, views, at))
    for _ in range(2):
        assert sum(len(images) for images, _ in loader) == 16
    loader.carried.join()  # both passes by the workers, and the next pass's first batches made as they ended
    carried = loader.carried.count * 4
    assert reads == [] and loader.stats()["decoded_by"] == {"cpu": 32 + carried}
    loader.close()


def test_only_a_source_read_in_part_works_out_which_positions_to_read_first(tmp_path, monkeypatch):
    """`Scheduler.read_first` (a batch's crop costs sorted) is asked for a folder read in place, whose
    reads it shapes; a packed store's batch is a view of its file, so nothing is asked per batch."""
    from gpufeed.decode.scheduling.scheduler import Scheduler

    _jpegs(tmp_path / "img", n=8)
    gpufeed.pack(tmp_path / "img", tmp_path / "store", mode="jpeg", reencode=False, progress=False, workers=1)
    asked = []
    monkeypatch.setattr(Scheduler, "read_first", lambda self, shapes, boxes: asked.append(len(shapes)))  # None: all
    for source, wanted in ((tmp_path / "store", False), (tmp_path / "img", True)):
        asked.clear()
        loader = gpufeed.Loader(source, batch_size=4, device="cpu", augment=OPS, num_workers=0)
        assert sum(len(y) for _, y in loader) == 8 and bool(asked) == wanted, source
        loader.close()


def test_tar_shards_and_lists_are_read_in_place(tmp_path):
    _jpegs(tmp_path / "img", n=8)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for k, path in enumerate(sorted((tmp_path / "img").rglob("*.jpg"))):
            for ext, data in (("jpg", path.read_bytes()), ("cls", str(k % 3).encode())):
                info = tarfile.TarInfo(f"s{k:02d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    gpufeed.pack(tmp_path / "shard.tar", tmp_path / "tar-store", mode="jpeg", reencode=False, progress=False,
                 workers=1)
    make = lambda path: gpufeed.Loader(path, batch_size=4, device="cpu", augment=OPS, num_workers=0,  # noqa: E731
                                       fields=("label", "source"))
    _same_batches(make(tmp_path / "shard.tar"), make(tmp_path / "tar-store"))
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:  # a .cls that is no integer: skipped, as packing does
        for ext, data in (("jpg", next((tmp_path / "img").rglob("*.jpg")).read_bytes()), ("cls", b"cat")):
            info = tarfile.TarInfo(f"x.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SourceError, match="no image"):
        make(tmp_path / "bad.tar")
    with tarfile.open(tmp_path / "png.tar", "w") as tar:  # a PNG member: re-encoded, served
        buf = io.BytesIO()
        Image.fromarray(natural_image(np.random.default_rng(0), 30, 34, 0)).save(buf, format="PNG")
        info = tarfile.TarInfo("p.png")
        info.size = len(buf.getvalue())
        tar.addfile(info, io.BytesIO(buf.getvalue()))
    png = gpufeed.Loader(tmp_path / "png.tar", batch_size=4, device="cpu", augment=OPS, num_workers=0, drop_last=False)
    assert png.store.reencoded == 1 and next(iter(png))[0].shape[0] == 1
    skipped = folder._list_tars([str(tmp_path / "bad.tar")]).skipped
    assert skipped == [{"path": f"{tmp_path / 'bad.tar'}:x", "reason": "label 'cat' in .cls is not an integer"}]
    (tmp_path / "list.csv").write_text("".join(f"img/c{k % 2}/{k:02d}.jpg,{k % 2}\n" for k in range(8)))
    listed = make(tmp_path / "list.csv")
    assert len(listed.store) == 8 and listed.store.source(3).endswith("img/c1/03.jpg")
    with tarfile.open(tmp_path / "s.tar.gz", "w:gz"):
        pass
    with pytest.raises(SourceError, match="compressed tar can't be read in place"):
        make(tmp_path / "s.tar.gz")


@pytest.mark.parametrize("workers", [0, 2])
def test_every_image_packing_reads_is_served_in_place_with_the_stores_pixels_each_once(tmp_path, workers, caplog):
    """Formerly PNG, WebP, progressive, CMYK, gray, 16-bit and turned images were dropped after one
    warning (41 of 61 files served), and a truncated file was replaced by another sample: counted twice.
    A JPEG cut short is named when indexed, as packing names it (it was served, and failed at each load);
    one cut short after the index was made is left out of its batch and named."""
    root = mixed_folder(tmp_path / "img")
    gpufeed.pack(root, tmp_path / "store", mode="jpeg", reencode=False, max_side=4096, progress=False, workers=1)
    make = lambda path: gpufeed.Loader(path, batch_size=4, device="cpu", augment=OPS, num_workers=workers,  # noqa: E731
                                       seed=3, shuffle=False, drop_last=False, fields=("label", "source"))
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        in_place, packed = make(root), make(tmp_path / "store")
    assert in_place.store.reencoded == 8 and "8 image(s)" in caplog.text and "2 file(s) not read" in caplog.text
    assert [(os.path.basename(s["path"]), s["reason"].split(":")[0]) for s in in_place.store.skipped] == [
        ("cut.jpg", "truncated JPEG"), ("broken.jpg", "not an image Pillow can identify")]
    assert in_place.store.skipped[0] in packed.store.manifest.skipped  # the same reason
    assert len(in_place.store) == len(packed.store) == 15
    _same_batches(in_place, packed)
    again = make(root)
    cut = root / "c0" / "00.jpg"
    cut.write_bytes(cut.read_bytes()[:700])  # after the index was made
    sources = [s for b in again for s in b["source"]]
    files = sorted(str(p) for p in root.rglob("*") if p.name not in ("broken.jpg", "cut.jpg", "00.jpg"))
    files = [f for f in files if os.path.isfile(f)]
    assert sorted(sources) == files  # each once; the file cut since left out, not replaced
    assert [(os.path.basename(s.source), s.sample) for s in again.skipped] == [
        ("00.jpg", again.store._names.index(str(cut)))]
    for loader in (in_place, packed, again):
        loader.close()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no image"):
        gpufeed.Loader(tmp_path / "empty", batch_size=4, device="cpu", augment=OPS)


def test_reencoded_images_are_made_once_and_follow_their_files(tmp_path, monkeypatch):
    root = mixed_folder(tmp_path / "img")
    made = folder.FolderStore(root)
    copies = sorted(made.upright.glob("*.jpg"))
    assert len(copies) == made.reencoded == 8
    made.close()
    calls = []
    real = headers.reencode
    monkeypatch.setattr(headers, "reencode", lambda data, to: calls.append(to) or real(data, to))
    folder.FolderStore(root).close()
    assert calls == []  # reused
    copies[0].write_bytes(b"x")  # a copy damaged or cut short: made again
    folder.FolderStore(root).close()
    assert calls == [copies[0]] and copies[0].stat().st_size > 1
    calls.clear()
    (root / "c0" / "png.png").unlink()
    left = folder.FolderStore(root)
    assert calls == [] and len(list(left.upright.glob("*.jpg"))) == 7  # the copy of a file gone is removed
    left.close()


def test_the_index_is_cached_and_refreshed_for_changed_files(tmp_path, monkeypatch):
    root = _jpegs(tmp_path / "img", n=8)
    calls = []
    real = folder._index
    monkeypatch.setattr(folder, "_index", lambda job: calls.append(job.name) or real(job))
    folder.FolderStore(root).close()
    assert len(calls) == 8 and folder._cache_path(root).is_file()
    calls.clear()
    folder.FolderStore(root).close()
    assert calls == []
    rng = np.random.default_rng(9)
    Image.fromarray(natural_image(rng, 50, 44, 0)).save(root / "c0" / "02.jpg")
    store = folder.FolderStore(root)
    k = next(i for i in range(len(store)) if store.source(i).endswith("c0/02.jpg"))
    assert [os.path.basename(c) for c in calls] == ["02.jpg"] and tuple(store.shapes[k]) == (50, 44)


def _columns(store) -> tuple:
    return (store._names, store.shapes.tolist(), store._sizes.tolist(), store._labels.tolist(),
            store._files.tolist(), store._file_of.tolist(), store._begins.tolist(), store.skipped, store.reencoded)


def test_an_unchanged_folder_is_served_as_it_was_without_reading_its_index(tmp_path, monkeypatch):
    """A warm open of a folder whose files are all as they were takes what the last open served (kept
    beside the index, for those very files' stats) instead of reading and checking every index entry;
    a file changed since sends it the longer way."""
    root = _jpegs(tmp_path / "img", n=8)
    (root / "c1" / "notes.jpg").write_bytes(b"not a jpeg")  # skipped, with its reason
    Image.fromarray(natural_image(np.random.default_rng(3), 36, 44, 0)).save(root / "c0" / "p.png")  # re-encoded
    first = _columns(folder.FolderStore(root))
    loads = []
    real = folder._load
    monkeypatch.setattr(folder, "_load", lambda path: loads.append(path) or real(path))
    again = folder.FolderStore(root)
    assert loads == [] and _columns(again) == first and again.reencoded == 1 and len(again.skipped) == 1
    folder._cache_path(root).with_suffix(".served.npz").unlink()
    assert _columns(folder.FolderStore(root)) == first and len(loads) == 1  # the longer way: the same
    os.utime(root / "c0" / "00.jpg", ns=(1, 1))  # its stat changed
    assert _columns(folder.FolderStore(root)) == first and len(loads) == 2


def test_a_list_naming_a_file_twice_reads_it_as_one_file_warm_and_cold(tmp_path):
    """A CSV list may name a file twice (a walked folder lists each once, and its files are taken as
    distinct without a look): each row is an image of its own, read from the one file, and a warm open
    serves what the cold one did."""
    root = _jpegs(tmp_path / "img", n=4)
    Image.fromarray(natural_image(np.random.default_rng(3), 36, 44, 0)).save(root / "c0" / "p.png")  # re-encoded
    rows = ["c0/00.jpg,0", "c1/01.jpg,1", "c0/00.jpg,5", "c0/p.png,0", "c0/p.png,2"]
    (root / "list.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    cold = folder.FolderStore(root / "list.csv")
    assert len(cold) == 5 and cold._labels.tolist() == [0, 1, 5, 0, 2] and cold.reencoded == 2
    assert len(cold._files) == 3 and cold._file_of.tolist() == [0, 1, 0, 2, 2]
    warm = folder.FolderStore(root / "list.csv")
    assert _columns(warm) == _columns(cold)
    with open(root / "c0" / "00.jpg", "rb") as f:
        data = f.read()
    got = warm.read(np.array([0, 2]))
    assert got.data[: len(data)].numpy().tobytes() == data and got.data[len(data) :].numpy().tobytes() == data


@pytest.mark.parametrize("damage", ["cut", "hwb", "kept", "bytes", "reasons", "copy"])
def test_served_columns_that_do_not_fit_the_folder_are_not_trusted(tmp_path, monkeypatch, damage):
    """The served columns are untrusted, as the index is: kept for these very files (the fingerprint of
    every name and stat), and each image's sides, pixels and bytes must fit its file (or its re-encoded
    copy); else the index is read and checked as without them."""
    root = _jpegs(tmp_path / "img", n=6)
    (root / "c1" / "notes.jpg").write_bytes(b"not a jpeg")
    Image.fromarray(natural_image(np.random.default_rng(3), 36, 44, 0)).save(root / "c0" / "p.png")
    first = _columns(folder.FolderStore(root))
    path = folder._cache_path(root).with_suffix(".served.npz")
    with np.load(path) as z:
        arrays = dict(z)
    if damage == "cut":
        path.write_bytes(path.read_bytes()[:100])
    else:
        if damage == "hwb":
            arrays["hwb"][0, :2] = [70000, 3]  # sides no JPEG has
        elif damage == "kept":
            arrays["kept"] = arrays["kept"][::-1].copy()  # another order
        elif damage == "bytes":
            arrays["hwb"][1, 2] += 1  # not its file's bytes
        elif damage == "reasons":
            arrays["reasons"] = np.frombuffer(b"[1]", np.uint8)
        else:  # a re-encoded copy gone
            next(folder._cache_path(root).with_suffix(".upright").glob("*.jpg")).unlink()
        np.savez(path, **arrays)
    loads = []
    real = folder._load
    monkeypatch.setattr(folder, "_load", lambda p: loads.append(p) or real(p))
    assert _columns(folder.FolderStore(root)) == first and len(loads) == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_changed_since_its_index_was_cached_is_read_as_it_is_now(tmp_path, workers):
    """The cached index against a folder changed since: a file renamed into the other class, one added,
    one deleted and one rewritten with other pixels of the same size. A pass reads every file there
    now exactly once, with its class and its pixels, and nothing that has gone."""
    rng = np.random.default_rng(5)
    root = tmp_path / "img"

    def save(path, k):  # one size: batches of them stack without augment ops
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(natural_image(rng, 32, 40, k)).save(path, quality=90)

    for k in range(8):
        save(root / f"c{k % 2}" / f"{k:02d}.jpg", k)
    folder.FolderStore(root).close()  # the index cached
    os.rename(root / "c0" / "00.jpg", root / "c1" / "moved.jpg")
    (root / "c1" / "01.jpg").unlink()
    save(root / "c0" / "new.jpg", 8)
    save(root / "c0" / "02.jpg", 9)  # other pixels, the same size
    loader = gpufeed.Loader(root, batch_size=3, device="cpu", num_workers=workers, shuffle=False, drop_last=False,
                            fields=("image", "label", "source"), dtype=torch.uint8)
    seen = {}
    for batch in loader:
        for image, label, source in zip(batch["image"], batch["label"], batch["source"]):
            assert source not in seen
            seen[source] = (image, int(label))
    files = sorted(str(p) for p in root.rglob("*.jpg"))
    assert sorted(seen) == files and len(files) == 8
    for source, (image, label) in seen.items():
        assert label == {"c0": 0, "c1": 1}[Path(source).parent.name], source
        assert torch.equal(image, torch.from_numpy(np.array(Image.open(source))).permute(2, 0, 1)), source
    loader.close()


def test_a_damaged_index_cache_is_read_again_not_trusted(tmp_path):
    root = _jpegs(tmp_path / "img", n=4)
    want = folder.FolderStore(root)
    shapes = want.shapes.copy()
    want.close()
    index = folder._cache_path(root)
    data = json.loads(index.read_text())
    bad = [[7], [-1, 2, 3], ["a", 2, 3], {"h": 1}, 12]
    data["entries"] = dict(zip(data["entries"], bad))
    index.write_text(json.dumps(data))
    index.with_suffix(".served.npz").unlink()  # (else the served columns stand, the index unread)
    again = folder.FolderStore(root)
    assert np.array_equal(again.shapes, shapes) and len(again) == 4
    again.close()
    index.write_text('{"version": 2, "entries": [1, 2]}')
    index.with_suffix(".served.npz").unlink()
    again = folder.FolderStore(root)
    assert np.array_equal(again.shapes, shapes)
    again.close()


def test_the_index_is_kept_in_the_users_cache_never_in_the_folder(tmp_path, monkeypatch):
    """Written beside the images, a later `gpufeed pack` of the folder listed it as a skipped file."""
    root = _jpegs(tmp_path / "img", n=4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder.FolderStore(root).close()
    assert sorted(p.name for p in root.rglob("*") if p.is_file()) == ["00.jpg", "01.jpg", "02.jpg", "03.jpg"]
    assert len(list((tmp_path / "cache" / "gpufeed").glob("index-*.json"))) == 1
    report = gpufeed.pack(root, tmp_path / "store", mode="jpeg", workers=1, progress=False)
    assert report.count == 4 and not report.skipped


@pytest.mark.parametrize("entry", [[None, None, 2**63 + 5], [None, None, 10**12], [1, 1, None],
                                   [60000, 60000, None], [0, 5, None], [70000, 10, None]])
def test_index_entries_of_valid_form_but_hostile_values_are_read_again(tmp_path, entry):
    """Each gave OverflowError, MemoryError, wrong crops or gigabytes of memory: an entry must fit its
    file (its byte count, sides a JPEG can have, pixels its bytes can hold), else its header is read."""
    root = _jpegs(tmp_path / "img", n=4)
    want = folder.FolderStore(root)
    shapes, sizes = want.shapes.copy(), want._sizes.copy()
    want.close()
    index = folder._cache_path(root)
    data = json.loads(index.read_text())
    data["entries"] = {k: [v if e is None else e for v, e in zip(old, entry)] for k, old in data["entries"].items()}
    index.write_text(json.dumps(data))
    index.with_suffix(".served.npz").unlink()  # (else the served columns stand, the index unread)
    if entry[:2] == [1, 1]:
        # a 1x1 JPEG of these bytes could be: for the very file it was made from (the index is in the
        # user's own cache) the entry stands, and a pass over it still ends normally
        loader = gpufeed.Loader(root, batch_size=2, device="cpu", augment=OPS, num_workers=0)
        assert sum(len(y) for _, y in loader) == 4
        loader.close()
        # the same entry is not taken for another file of the same name, size and times
        os.rename(root / "c0" / "00.jpg", root / "c0" / "moved.jpg")
        shutil.copy(root / "c0" / "moved.jpg", root / "c0" / "00.jpg")
        os.utime(root / "c0" / "00.jpg", ns=(os.stat(root / "c0" / "moved.jpg").st_mtime_ns,) * 2)
        (root / "c0" / "moved.jpg").unlink()
        again = folder.FolderStore(root)
        assert tuple(again.shapes[0]) == tuple(shapes[0])
        again.close()
        return
    again = folder.FolderStore(root)
    assert np.array_equal(again.shapes, shapes) and np.array_equal(again._sizes, sizes)
    again.close()


def test_a_fifo_named_like_a_jpeg_is_skipped_not_waited_for(tmp_path):
    root = _jpegs(tmp_path / "img", n=4)
    os.mkfifo(root / "c0" / "pipe.jpg")
    # (the next epoch's first batches are not made as this one ends: they would count its failure again, or not)
    loader = gpufeed.Loader(root, batch_size=2, device="cpu", augment=OPS, num_workers=0, tuning=Tuning(carry=False))
    assert len(loader.store) == 4
    assert any("pipe.jpg" in s["path"] and "regular" in s["reason"] for s in loader.store.skipped)
    (root / "c1" / "01.jpg").unlink()
    os.mkfifo(root / "c1" / "01.jpg")  # a file replaced by a FIFO after it was indexed
    assert sum(len(y) for _, y in loader) == 4 and loader.stats()["decoded_by"]["failed"] == 1


def test_a_file_gone_after_indexing_is_replaced_or_raises(tmp_path):
    root = _jpegs(tmp_path / "img", n=8)
    loader = gpufeed.Loader(root, batch_size=4, device="cpu", augment=OPS, num_workers=0, tuning=Tuning(carry=False))
    evaluating = gpufeed.Loader(root, batch_size=4, device="cpu", augment=OPS, num_workers=0, shuffle=False,
                                drop_last=False)
    (root / "c1" / "03.jpg").write_bytes(b"")
    assert sum(len(y) for _, y in loader) == 8 and loader.stats()["decoded_by"]["failed"] == 1
    assert sum(len(y) for _, y in evaluating) == 7 and [s.source for s in evaluating.skipped] == [
        str(root / "c1" / "03.jpg")]
    strict = gpufeed.Loader(root, batch_size=4, device="cpu", augment=OPS, num_workers=0, on_error="raise")
    (root / "c1" / "05.jpg").unlink()
    with pytest.raises(DecodeError, match="05.jpg"):
        list(strict)


def test_the_decoder_librarys_own_messages_are_not_printed(tmp_path):
    """With nvImageCodec installed its own ANSI-coloured "[ERROR] ... Premature end of JPEG data" lines
    came twice on stderr beside gpufeed's one warning. (The files are damaged once the folder is indexed:
    a JPEG cut short when indexed is named then, and never reaches a decoder.)"""
    if importlib.util.find_spec("nvidia.nvimgcodec") is None:
        pytest.skip("nvImageCodec is not installed")
    root = _jpegs(tmp_path / "img", n=6)
    whole = io.BytesIO()
    Image.fromarray(natural_image(np.random.default_rng(0), 64, 64, 1)).save(whole, format="JPEG", quality=90)
    data = whole.getvalue()
    (root / "c0" / "cut.jpg").write_bytes(data)
    (root / "c1" / "garbage.jpg").write_bytes(data)
    damaged = {root / "c0" / "cut.jpg": data[:700], root / "c1" / "garbage.jpg": data[:300] + bytes(len(data) - 300)}
    script = (
        "import gpufeed\nfrom pathlib import Path\nfrom gpufeed.augment import Normalize, RandomResizedCrop\n"
        f"loader = gpufeed.Loader({str(root)!r}, batch_size=4, device='cpu', drop_last=False, num_workers=0,"
        " augment=[RandomResizedCrop(24), Normalize()])\n"
        + "".join(f"Path({str(path)!r}).write_bytes({value!r})\n" for path, value in damaged.items())
        + "print(sum(len(y) for _, y in loader), len(loader.skipped))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(gpufeed.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    env.pop("PYNVIMGCODEC_VERBOSITY", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["6", "2"]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot be decoded" in lines[0], out.stderr


def test_the_gpu_decoders_library_loads_while_a_folder_is_indexed(tmp_path, monkeypatch):
    """Indexing 50,000 files took 0.6-1.2 s and loading nvImageCodec 1 s in a fresh process, one after
    the other: the load now starts first, on a thread, and the index is made meanwhile."""
    from gpufeed.decode.codecs import nvimgcodec_api
    from gpufeed.decode.scheduling import choice
    from gpufeed.loader import loader as loader_module

    root = _jpegs(tmp_path / "img", n=4)
    order = []
    monkeypatch.setattr(loader_module, "load_ahead", lambda device, use: order.append(("load", use)))
    real_list = folder._list
    monkeypatch.setattr(folder, "_list", lambda source, **kw: order.append("index") or real_list(source, **kw))
    gpufeed.Loader(root, batch_size=2, device="cpu", augment=OPS, num_workers=0).close()
    assert order == [("load", None), "index"]
    order.clear()
    gpufeed.Loader(root, batch_size=2, device="cpu", augment=OPS, num_workers=0, tuning=Tuning(open_ahead=False)).close()
    assert order == ["index"]

    threads = []
    monkeypatch.setattr(nvimgcodec_api, "open_library", lambda: threads.append(threading.current_thread().name) or 1 / 0)
    cuda = torch.device("cuda", 0)
    for device, use in [(torch.device("cpu"), None), (cuda, ("cpu",)), (cuda, ("nvjpeg", "cpu"))]:
        choice.load_ahead(device, use)  # nothing to load for these
    choice.load_ahead(cuda, None)
    choice.load_ahead(cuda, ("cuda", "cpu"))
    for t in threading.enumerate():
        if t.name.startswith("gpufeed-nvimgcodec"):
            t.join(5)
    # each on a thread of its own, its failure left for the decoders' opening to say
    assert len(threads) == 2 and all(name.startswith("gpufeed-nvimgcodec") for name in threads)


def test_a_jpeg_stores_gpu_decoders_library_loads_once_the_store_is_open(tmp_path, monkeypatch):
    """A jpeg store's Loader starts loading nvImageCodec as soon as it has the store open, before it
    makes its pipelines (whose thread opens the decoders, and waited for the library there); a raw
    store's never does, nor with `open_ahead=False`."""
    from gpufeed.loader import jpeg as jpeg_module
    from gpufeed.loader import loader as loader_module

    _jpegs(tmp_path / "img", n=4)
    for mode in ("jpeg", "raw"):
        gpufeed.pack(tmp_path / "img", tmp_path / mode, mode=mode, reencode=False, progress=False, workers=1,
                     **({"size": 24} if mode == "raw" else {}))
    order = []
    monkeypatch.setattr(loader_module, "load_ahead", lambda device, use: order.append(("load", use)))
    real = jpeg_module.jpeg_pipelines
    monkeypatch.setattr(loader_module, "jpeg_pipelines", lambda *a: order.append("pipelines") or real(*a))
    gpufeed.Loader(tmp_path / "jpeg", batch_size=2, device="cpu", augment=OPS, num_workers=0, decoders=("cuda", "cpu")).close()
    assert order == [("load", ("cuda", "cpu")), "pipelines"]
    order.clear()
    gpufeed.Loader(tmp_path / "jpeg", batch_size=2, device="cpu", augment=OPS, num_workers=0,
                   tuning=Tuning(open_ahead=False)).close()
    assert order == ["pipelines"]
    order.clear()
    gpufeed.Loader(tmp_path / "raw", batch_size=2, device="cpu", augment=OPS).close()
    assert order == []
