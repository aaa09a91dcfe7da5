"""A damaged, foreign or future store is detected with a clear message."""

from __future__ import annotations

import json

import numpy as np

import pytest

import gpufeed
from gpufeed.store import format as fmt


@pytest.fixture(params=["raw", "jpeg"])
def store_path(request, image_folder, tmp_path):
    gpufeed.pack(image_folder, tmp_path / "s", mode=request.param, size=16, workers=1, progress=False)
    return tmp_path / "s"


def test_verify_catches_one_flipped_byte(store_path):
    assert gpufeed.verify(store_path).ok
    name = fmt.RAW_IMAGES if (store_path / fmt.RAW_IMAGES).exists() else fmt.JPEG_DATA
    data = bytearray((store_path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (store_path / name).write_bytes(bytes(data))
    result = gpufeed.verify(store_path)
    assert not result.ok and list(result.damaged) == [name]
    assert "checksum" in result.damaged[name]


def test_truncated_data_file_fails_at_open(store_path):
    for name in ("labels.i64", fmt.RAW_IMAGES, fmt.JPEG_OFFSETS):
        if (store_path / name).exists():
            data = (store_path / name).read_bytes()
            (store_path / name).write_bytes(data[:-5])
            with pytest.raises(gpufeed.StoreError, match=rf"{name}: .* bytes on disk, manifest says"):
                gpufeed.open(store_path)
            (store_path / name).write_bytes(data)
    gpufeed.open(store_path)


def test_missing_data_file(store_path):
    (store_path / fmt.LABELS).unlink()
    with pytest.raises(gpufeed.StoreError, match="labels.i64: data file missing"):
        gpufeed.open(store_path)
    assert gpufeed.verify(store_path).damaged == {fmt.LABELS: "missing"}


def test_not_a_store(tmp_path):
    with pytest.raises(gpufeed.StoreError, match="not a gpufeed store"):
        gpufeed.open(tmp_path)
    with pytest.raises(gpufeed.StoreError, match="not a directory"):
        gpufeed.open(tmp_path / "nope")
    (tmp_path / fmt.MANIFEST).write_text("{ not json")
    with pytest.raises(gpufeed.StoreError, match="unreadable manifest"):
        gpufeed.open(tmp_path)


def test_newer_format_version_is_refused(store_path):
    manifest = json.loads((store_path / fmt.MANIFEST).read_text())
    manifest["version"] = fmt.FORMAT_VERSION + 1
    (store_path / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(gpufeed.StoreError, match="newer than this gpufeed reads"):
        gpufeed.open(store_path)


def test_manifest_records_settings_and_version(store_path):
    m = gpufeed.open(store_path).manifest
    assert m.format == "gpufeed-store" and m.version == 3 and m.gpufeed_version == gpufeed.__version__
    assert m.settings["size"] == 16 and m.classes == ["cat", "dog", "emu"] and m.count == 12
    assert set(m.files) == set(fmt.data_files(m.mode))


def test_streaming_and_parallel_digests_agree(tmp_path, monkeypatch):
    """The writer's one-pass digest equals the block-parallel one, across block boundaries."""
    import os

    from gpufeed.store import writer

    monkeypatch.setattr(writer, "CHECKSUM_BLOCK", 1000)
    for size in (0, 1, 999, 1000, 1001, 4567):
        data = os.urandom(size)
        w = writer.HashingWriter(tmp_path / "f")
        for k in range(0, size, 333):
            w.write(data[k : k + 333])
        assert w.close() == writer.file_digest(tmp_path / "f", threads=3)


def _edit_manifest(path, **fields):
    manifest = json.loads((path / fmt.MANIFEST).read_text())
    manifest.update(fields)
    (path / fmt.MANIFEST).write_text(json.dumps(manifest))
    return manifest


@pytest.mark.parametrize("field, value, message", [
    ("version", 0, "version 0 is not a version"),
    ("version", -5, "version -5 is not a version"),
    ("version", "1", "version '1' is not a version"),
    ("version", True, "version True is not a version"),
    ("count", "12", "bad sample count '12'"),
    ("classes", "cat", "field classes is 'cat', not a list of strings"),
    ("files", [], "field files is \\[\\], not an object"),
    ("skipped", None, "field skipped is None"),
    ("settings", [], "field settings is \\[\\]"),
    ("mode", 3, "field mode is 3, not a string"),
])
def test_a_manifest_of_wrong_types_is_refused_by_name(store_path, field, value, message):
    _edit_manifest(store_path, **{field: value})
    for check in (gpufeed.open, gpufeed.verify):
        with pytest.raises(gpufeed.StoreError, match=message):
            check(store_path)


def test_a_file_entry_of_wrong_types_or_outside_the_store_is_refused(store_path, tmp_path):
    manifest = json.loads((store_path / fmt.MANIFEST).read_text())
    entry = dict(manifest["files"][fmt.LABELS])
    _edit_manifest(store_path, files={**manifest["files"], fmt.LABELS: {**entry, "bytes": "96"}})
    with pytest.raises(gpufeed.StoreError, match=r"files\['labels.i64'\]"):
        gpufeed.open(store_path)
    (tmp_path / "secret").write_bytes(b"outside")
    _edit_manifest(store_path, files={**manifest["files"], "../secret": {"bytes": 7, "digest": "x"}})
    for check in (gpufeed.open, gpufeed.verify):  # verify would have hashed a file outside the store
        with pytest.raises(gpufeed.StoreError, match=r"files a .* store does not hold: \['../secret'\]"):
            check(store_path)


def test_a_raw_store_shape_must_be_square_rgb(tmp_path, image_folder):
    gpufeed.pack(image_folder, tmp_path / "s", size=16, workers=1, progress=False)
    for shape in (None, [16, 16], [16, 16, 4], [0, 0, 3], ["16", 16, 3]):
        _edit_manifest(tmp_path / "s", image_shape=shape)
        with pytest.raises(gpufeed.StoreError, match="image_shape"):
            gpufeed.open(tmp_path / "s")


def _poke(path, name, dtype, index, value):
    array = np.fromfile(path / name, dtype=dtype)
    array.reshape(-1)[index] = value
    array.tofile(path / name)


def test_damaged_offsets_shapes_and_labels_are_named(tmp_path, image_folder):
    gpufeed.pack(image_folder, tmp_path / "s", mode="jpeg", workers=1, progress=False)
    s = tmp_path / "s"
    cases = [(fmt.JPEG_OFFSETS, "<i8", 5, 1, "offsets.i64: entry 5 is smaller than the one before"),
             (fmt.JPEG_OFFSETS, "<i8", 0, 3, "offsets.i64: entry 0 is 3, not 0"),
             (fmt.JPEG_SHAPES, "<i4", 2 * 7 + 1, 0, "shapes.i32: entry 7 is not a positive size"),
             (fmt.LABELS, "<i8", 4, 2**40, "labels.i64: entry 4 is not -1 or a class of 3"),
             (fmt.LABELS, "<i8", 9, -2, "labels.i64: entry 9 is not -1 or a class of 3")]
    for name, dtype, index, value, message in cases:
        before = (s / name).read_bytes()
        _poke(s, name, dtype, index, value)
        with pytest.raises(gpufeed.StoreError, match=message):
            gpufeed.open(s)
        (s / name).write_bytes(before)
    gpufeed.open(s)


def test_every_sample_maps_back_to_its_file(store_path, image_folder):
    store = gpufeed.open(store_path)
    files = sorted(str(p) for p in image_folder.rglob("*.png"))
    assert [store.source(i) for i in range(len(store))] == files  # class folders, then names: the pack order
    assert store.source(-1) == files[-1]
    with pytest.raises(IndexError):
        store.source(len(store))


def test_skipped_files_leave_no_hole_in_the_sources(tmp_path, image_folder):
    (image_folder / "cat" / "001.png").write_bytes(b"broken")
    gpufeed.pack(image_folder, tmp_path / "s", size=16, workers=2, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert len(store) == 11 and not any(store.source(i).endswith("cat/001.png") for i in range(11))
    assert store.source(1).endswith("cat/002.png") and store.labels[1] == 0


def test_a_version_1_store_still_opens_without_sources(store_path):
    """Stores packed by gpufeed 0.1 (format v1: no sources files) open and load; source() says why not."""
    manifest = json.loads((store_path / fmt.MANIFEST).read_text())
    manifest["version"] = 1
    for name in (fmt.SOURCES, fmt.SOURCE_OFFSETS):
        del manifest["files"][name]
        (store_path / name).unlink()
    (store_path / fmt.MANIFEST).write_text(json.dumps(manifest))
    store = gpufeed.open(store_path)
    assert store[3][0].shape[0] == 3 and gpufeed.verify(store_path).ok
    with pytest.raises(gpufeed.StoreError, match="did not record sources; pack it again"):
        store.source(0)


def test_damaged_source_offsets_are_refused(store_path):
    import numpy as np

    offsets = np.fromfile(store_path / fmt.SOURCE_OFFSETS, dtype="<i8")
    offsets[5] = offsets[-1] + 100
    offsets.tofile(store_path / fmt.SOURCE_OFFSETS)
    with pytest.raises(gpufeed.StoreError, match=r"sources.i64: entry 5 is out of order or past the end"):
        gpufeed.open(store_path)
