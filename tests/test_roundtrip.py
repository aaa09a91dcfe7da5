"""Packing then reading gives back the images: exactly for raw, within JPEG error for jpeg."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from conftest import jpeg_bytes, pixels, save, small_sharded_store, smooth


def test_raw_roundtrip_is_pixel_exact(image_folder, tmp_path):
    report = gpufeed.pack(image_folder, tmp_path / "s", size=32, workers=2, progress=False)
    assert report.count == 12 and not report.skipped
    store = gpufeed.open(tmp_path / "s")
    assert len(store) == 12 and store.mode == "raw" and store.image_shape == (32, 32, 3)
    assert store.classes == ["cat", "dog", "emu"]
    assert store.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert store.labels.dtype == torch.int64
    for i in range(12):
        image, label = store[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
        assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(pixels(i, 32, 32)))
    assert store[-1][1] == 2
    with pytest.raises(IndexError):
        store[12]


@pytest.mark.parametrize("fit", ["crop", "stretch", "pad"])
def test_raw_fit_shapes(tmp_path, fit):
    src = tmp_path / "src"
    save(src / "wide.png", np.full((20, 60, 3), 200, np.uint8))
    gpufeed.pack(src, tmp_path / "s", size=16, fit=fit, workers=1, progress=False)
    image = gpufeed.open(tmp_path / "s")[0][0]
    assert image.shape == (3, 16, 16)
    if fit == "pad":  # black bars above and below the 16x5 band
        assert image[:, 0].max() == 0 and image[:, 8].min() == 200
    else:
        assert image.min() == 200


def test_jpeg_roundtrip_within_jpeg_error(tmp_path):
    src = tmp_path / "src"
    for i in range(5):
        save(src / f"{i}.png", smooth(i, 300, 800))
    gpufeed.pack(src, tmp_path / "s", mode="jpeg", max_side=400, quality=90, workers=2, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert store.mode == "jpeg" and store.image_shape is None and store.labels.tolist() == [-1] * 5
    from PIL import Image

    for i in range(5):
        image, _ = store[i]
        assert image.shape == (3, 150, 400)
        assert tuple(store.shapes[i]) == (150, 400)
        expected = np.asarray(Image.fromarray(smooth(i, 300, 800)).resize((400, 150), Image.Resampling.BICUBIC))
        err = np.abs(image.permute(1, 2, 0).numpy().astype(int) - expected.astype(int)).mean()
        assert err < 3.0


def test_jpeg_keeps_baseline_bytes_without_reencode(tmp_path):
    src = tmp_path / "src"
    baseline = jpeg_bytes(smooth(0), quality=95)
    (src).mkdir()
    (src / "a.jpg").write_bytes(baseline)
    (src / "b.jpg").write_bytes(jpeg_bytes(smooth(1), quality=95, progressive=True))
    gpufeed.pack(src, tmp_path / "s", mode="jpeg", reencode=False, workers=1, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert bytes(store.encoded(0).numpy()) == baseline
    assert bytes(store.encoded(1).numpy())[:2] == b"\xff\xd8"
    assert bytes(store.encoded(1).numpy()) != (src / "b.jpg").read_bytes()  # progressive re-encoded
    gpufeed.pack(src, tmp_path / "t", mode="jpeg", reencode=True, quality=50, workers=1, progress=False)
    assert gpufeed.open(tmp_path / "t").encoded(0).numel() < len(baseline)


def test_open_is_constant_time_on_a_huge_sparse_store(tmp_path):
    """A million-image store (200 GB, sparse) opens without reading its data."""
    from gpufeed.store import format as fmt

    n, side = 1_000_000, 256
    d = tmp_path / "big"
    d.mkdir()
    files = {}
    for name, size in ((fmt.RAW_IMAGES, n * fmt.raw_item_bytes(side)), (fmt.LABELS, n * 8),
                       (fmt.SOURCES, 0), (fmt.SOURCE_OFFSETS, (n + 1) * 8)):
        with open(d / name, "wb") as f:
            f.truncate(size)
        files[name] = {"bytes": size, "digest": ""}
    fmt.Manifest(mode="raw", count=n, image_shape=[side, side, 3], classes=[], files=files).write(d)
    store = gpufeed.open(d)
    assert len(store) == n and store[n - 1][0].shape == (3, side, side)


def test_a_sharded_stores_batch_reads_each_images_bytes_when_asked(tmp_path):
    """A batch of a sharded store (`ShardBytes`) leaves its images in the shard files until a decoder of
    the loader's process asks (`Encoded.readable`; the workers read theirs from the files): asked, each
    image's stored bytes, for any part of a batch over many shards; unasked, its bytes can't be read."""
    from gpufeed.loader.bytes import ShardBytes

    store = small_sharded_store(tmp_path, 40)
    assert len(store.starts) - 1 > 5
    source = ShardBytes(store)
    rng = np.random.default_rng(0)
    for indices in (rng.permutation(40)[:17], np.arange(40), np.array([39, 0, 38, 5])):
        batch = source.read_later(indices)()
        with pytest.raises(RuntimeError, match="not read"):
            batch.arrays()
        part = rng.permutation(len(indices))[: len(indices) // 2 + 1]
        for images, chosen in ((batch.take(part).readable(), indices[part]), (batch.readable(), indices)):
            for blob, i in zip(images.arrays(), chosen.tolist()):
                assert bytes(blob) == bytes(store.encoded(i).numpy())
    source.close()
