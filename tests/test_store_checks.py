"""A damaged, foreign or future store is detected with a clear message."""

from __future__ import annotations

import json

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
    assert m.format == "gpufeed-store" and m.version == 1 and m.gpufeed_version == gpufeed.__version__
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
