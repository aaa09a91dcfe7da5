"""Shared fakes: tiny deterministic images derived from their index, written in the test."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.synth import natural_image

if "PYTEST_XDIST_WORKER" in os.environ:
    # the suite runs on 2 workers over 2 cores (README's test command): torch's threads, which spin while
    # they wait, would oversubscribe the cores in the workers and in the processes the tests start
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pixels(index: int, h: int = 24, w: int = 32) -> np.ndarray:
    """HWC uint8 image whose every pixel depends on `index`, so mix-ups are caught."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 7 + index * 13) % 256, (y * 11 + index * 29) % 256, (x + y + index * 37) % 256], -1)
    return img.astype(np.uint8)


def smooth(index: int, h: int = 48, w: int = 64) -> np.ndarray:
    """A smooth image (JPEG-friendly) that still depends on `index`."""
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    img = np.stack([120 + 100 * np.sin(3 * x + index), 120 + 100 * np.cos(2 * y + index), 60 + 150 * x * y], -1)
    return np.clip(img, 0, 255).astype(np.uint8)


def boxes_of(masks: np.ndarray) -> np.ndarray:
    """Each instance mask's tight [x1, y1, x2, y2] box."""
    out = []
    for m in masks:
        ys, xs = np.nonzero(m)
        out.append([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
    return np.asarray(out, np.float64)


def skipped_after(root: Path, field: str, good, bad, seed: int, side: int = 32) -> str:
    """Pack a sample whose `field` is `good`, then one whose `field` is `bad`: the second alone is
    skipped; the reason the report gives for it."""
    import gpufeed

    rng = np.random.default_rng(seed)
    data = [{"image": natural_image(rng, side, side, k), "label": k, field: v} for k, v in enumerate((good, bad))]
    report = gpufeed.pack(data, root / "s", size=side, progress=False, workers=1)
    assert len(gpufeed.open(root / "s")) == 1 and len(report.skipped) == 1, report.skipped
    return report.skipped[0]["reason"]


def save(path: Path, array: np.ndarray, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kw)
    return path


def jpeg_bytes(array: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def small_sharded_store(root: Path, count: int, shard_size: str = "4KB"):
    """A jpeg store of `count` small photos in two classes, their bytes kept, in shards of `shard_size`,
    opened."""
    import gpufeed

    src = root / "src"
    for i in range(count):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 2}" / f"{i:02d}.jpg").write_bytes(jpeg_bytes(smooth(i, 24 + i % 7, 32), quality=90))
    gpufeed.pack(src, root / "s", mode="jpeg", reencode=False, workers=1, progress=False, shard_size=shard_size)
    return gpufeed.open(root / "s")


def decoded(data) -> torch.Tensor:
    """CHW uint8 RGB pixels of the encoded image `data` (bytes, array or tensor) as Pillow decodes them:
    the reference for gpufeed's CPU decoders (libjpeg-turbo all, so the same pixels)."""
    raw = data.numpy() if isinstance(data, torch.Tensor) else data
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    return torch.from_numpy(rgb.transpose(2, 0, 1).copy())


def claiming(jpeg: bytes, height: int, width: int) -> bytes:
    """`jpeg` (baseline) with its frame header's size replaced: a hostile file, whose header no decoder
    or packer may trust."""
    at = jpeg.index(b"\xff\xc0") + 5
    return jpeg[:at] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + jpeg[at + 4:]


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """ImageFolder of lossless 32x32 PNGs: 3 classes x 4 images, pixels = pixels(global index)."""
    root = tmp_path / "folder"
    k = 0
    for c in ("cat", "dog", "emu"):
        for i in range(4):
            save(root / c / f"{i:03d}.png", pixels(k, 32, 32))
            k += 1
    return root


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """gpufeed's caches (a folder's index read in place) go to a folder of the test run, not the
    user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


@pytest.fixture(autouse=True)
def _first_rates():
    """Each test's loaders start from the decoders' start rates, as a process's first does: what an
    earlier test's loaders measured (`steering._learned`) is not carried into it."""
    from gpufeed.decode.scheduling import steering

    steering.forget()


def mixed_folder(root: Path) -> Path:
    """A folder of every kind packing reads (each listed first as what the decoders can't read as it is),
    plus a file that is no image and a JPEG cut short after its header."""
    rng = np.random.default_rng(1)
    for k in range(6):
        path = root / f"c{k % 2}" / f"{k:02d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(natural_image(rng, 30 + k, 40, k)).save(path, quality=90)
    pixels = natural_image(rng, 32, 40, 0)
    Image.fromarray(pixels).save(root / "c0" / "png.png")
    Image.fromarray(pixels).save(root / "c0" / "webp.webp", quality=90)
    Image.fromarray(pixels).save(root / "c0" / "prog.jpg", progressive=True)
    Image.fromarray(pixels).convert("CMYK").save(root / "c0" / "cmyk.jpg")
    Image.fromarray(pixels).convert("L").save(root / "c1" / "gray.jpg")
    Image.fromarray((pixels[:, :, 0].astype(np.uint16) * 257)).save(root / "c1" / "deep.png")  # 16-bit
    Image.fromarray(pixels).convert("P").save(root / "c1" / "palette.png", transparency=0)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(root / "c1" / "turned.jpg", exif=exif)
    Image.fromarray(pixels).save(root / "c1" / "icc.jpg", icc_profile=bytes(300_000))  # header past the first read
    (root / "c1" / "broken.jpg").write_bytes(b"not a jpeg")
    whole = io.BytesIO()
    Image.fromarray(natural_image(rng, 64, 64, 1)).save(whole, format="JPEG", quality=90)
    (root / "c0" / "cut.jpg").write_bytes(whole.getvalue()[:700])
    return root
