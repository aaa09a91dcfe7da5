"""A hostile or damaged store is refused, named, or reported at the edges: files that point outside
the store, a manifest nested too deeply, damaged text and JSON field values, files truncated while
read."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.augment import Normalize, RandomResizedCrop
from gpufeed.store import format as fmt
from gpufeed.store.format import StoreError

from conftest import smooth


def dicts(n: int = 8) -> list[dict]:
    """Samples with a text and a JSON field, derived from their index."""
    return [{"image": smooth(k, 24, 28), "label": k % 2, "caption": f"photo {k}", "meta": {"k": [k, "x"]}}
            for k in range(n)]


@pytest.fixture(params=["raw", "jpeg"])
def store_path(request, tmp_path):
    gpufeed.pack(dicts(), tmp_path / "s", mode=request.param, size=16, workers=1, progress=False)
    return tmp_path / "s"


# 4. files that point outside the store

def test_a_store_file_that_is_a_symbolic_link_is_refused_by_name(store_path, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    names = [fmt.MANIFEST, *json.loads((store_path / fmt.MANIFEST).read_text())["files"]]
    assert "field.caption.bin" in names and "sources.bin" in names
    for name in names:
        (store_path / name).rename(outside / name)
        (store_path / name).symlink_to(outside / name)
        match = rf"{name}: is a symbolic link \(a store's files must be its own\)"
        with pytest.raises(StoreError, match=match):
            gpufeed.open(store_path)
        if name == fmt.MANIFEST:
            with pytest.raises(StoreError, match=match):
                gpufeed.verify(store_path)
        else:
            result = gpufeed.verify(store_path)
            assert not result.ok and list(result.damaged) == [name]
            assert result.damaged[name] == "is a symbolic link (a store's files must be its own)"
        (store_path / name).unlink()
        (outside / name).rename(store_path / name)
    assert gpufeed.verify(store_path).ok and len(gpufeed.open(store_path)) == 8


def test_a_store_directory_that_is_a_symbolic_link_opens(store_path, tmp_path):
    (tmp_path / "link").symlink_to(store_path)
    assert gpufeed.verify(tmp_path / "link").ok
    assert gpufeed.open(tmp_path / "link").field("caption", 3) == "photo 3"


def test_a_store_file_that_is_a_fifo_is_refused_without_blocking(store_path):
    (store_path / fmt.LABELS).unlink()
    os.mkfifo(store_path / fmt.LABELS)
    with pytest.raises(StoreError, match="labels.i64: not a regular file"):
        gpufeed.open(store_path)
    assert "not a regular file" in gpufeed.verify(store_path).damaged[fmt.LABELS]


# 5b. a manifest nested too deeply

def test_a_manifest_nested_too_deeply_is_a_store_error(store_path, capsys):
    (store_path / fmt.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StoreError, match="manifest.json: .*nested too deeply"):
        gpufeed.open(store_path)
    with pytest.raises(StoreError, match="nested too deeply"):
        gpufeed.verify(store_path)
    from gpufeed.cli import main
    assert main(["inspect", str(store_path)]) != 0
    assert "nested too deeply" in capsys.readouterr().err


# 8. damaged field values

def _flip(path, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([value]))


def _damage(store_path) -> None:
    """Sample 2's caption no longer UTF-8, sample 5's meta no longer JSON (sizes unchanged)."""
    for name, sample, value in (("caption", 2, 0xFF), ("meta", 5, ord("}"))):
        offsets = np.fromfile(store_path / f"field.{name}.i64", dtype="<i8")
        _flip(store_path / f"field.{name}.bin", int(offsets[sample]), value)


def test_a_damaged_text_or_json_value_is_named(store_path):
    _damage(store_path)
    store = gpufeed.open(store_path)
    assert store.field("caption", 1) == "photo 1" and store.field("meta", 4) == {"k": [4, "x"]}
    with pytest.raises(StoreError, match=rf"{store_path}.*field 'caption' of sample 2: not UTF-8 text"):
        store.field("caption", 2)
    with pytest.raises(StoreError, match=rf"{store_path}.*field 'meta' of sample 5: not JSON"):
        store.field("meta", 5)
    with pytest.raises(StoreError, match="field 'meta' of sample 5"):
        store.column("meta").rows(np.arange(8))


def test_a_deeply_nested_json_value_is_a_store_error(tmp_path):
    data = dicts(2)
    deep = 200_000  # deeper than any Python parses: 1,001 was enough for 3.11, not for 3.12's C limit
    data[1]["meta"] = {"k": [1, "x"] + ["x" * 2 * deep]}
    gpufeed.pack(data, tmp_path / "s", size=16, workers=1, progress=False)
    path = tmp_path / "s" / "field.meta.bin"
    raw = path.read_bytes()
    start = raw.index(b"x" * 2 * deep)
    path.write_bytes(raw[:start - 1] + b"[" * (deep + 1) + b"]" * (deep + 1) + raw[start + 2 * deep + 1:])  # the same size
    with pytest.raises(StoreError, match="field 'meta' of sample 1: not JSON .*nested too deeply"):
        gpufeed.open(tmp_path / "s").field("meta", 1)


OPS = [RandomResizedCrop(16, scale=(0.5, 1)), Normalize()]


def _loader(store_path, **kw):
    ops = OPS if gpufeed.open(store_path).mode == "jpeg" else None
    return gpufeed.Loader(store_path, batch_size=8, device="cpu", augment=ops, shuffle=False, num_workers=0,
                          fields=("label", "caption", "meta"), **kw)


def test_the_loader_yields_none_for_a_damaged_value_and_says_so(store_path, caplog):
    _damage(store_path)
    loader = _loader(store_path)
    for _ in range(2):
        batch = next(iter(loader))
        assert batch["caption"] == [None if k == 2 else f"photo {k}" for k in range(8)]
        assert batch["meta"] == [None if k == 5 else {"k": [k, "x"]} for k in range(8)]
        assert torch.equal(batch["label"], torch.arange(8) % 2)
    notes = loader.stats()["notes"]
    assert [n for n in notes if "field 'caption'" in n] and [n for n in notes if "field 'meta'" in n]
    assert len([n for n in notes if "damaged" in n]) == 2  # one note per field, not one per value
    assert len([r for r in caplog.records if "of sample 2" in r.getMessage()]) == 1  # warned once


def test_the_loader_raises_a_damaged_value_with_on_error_raise(store_path):
    _damage(store_path)
    loader = _loader(store_path, on_error="raise")
    with pytest.raises(StoreError, match="field 'caption' of sample 2"):
        next(iter(loader))


# 12. a store changed while read

def test_check_unchanged_names_a_file_truncated_while_read(store_path):
    store = gpufeed.open(store_path)
    store.check_unchanged()
    os.truncate(store_path / fmt.LABELS, 8)  # nothing touches the mapped pages past the new end
    with pytest.raises(StoreError, match=r"labels.i64: 8 bytes now, 64 when opened: .*must not change while"):
        store.check_unchanged()


def test_check_unchanged_accepts_a_store_swapped_for_a_new_one(store_path):
    store = gpufeed.open(store_path)
    gpufeed.pack(dicts(3), store_path, size=16, workers=1, progress=False, overwrite=True)
    store.check_unchanged()  # the old files stay mapped: reading them is safe
    assert len(store) == 8 and store.field("caption", 7) == "photo 7"
    assert len(gpufeed.open(store_path)) == 3
