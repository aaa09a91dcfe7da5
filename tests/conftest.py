"""Shared fakes: tiny deterministic images derived from their index, written in the test."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image


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


def save(path: Path, array: np.ndarray, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kw)
    return path


def jpeg_bytes(array: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", **kw)
    return buf.getvalue()


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
