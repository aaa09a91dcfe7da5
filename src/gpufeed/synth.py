"""Natural-looking sample images made on the spot (no download) for the demo, tests and bench.

Smooth multi-scale colour fields plus shapes and fine grain: they compress like photos
(tens of KB at 500×375, quality 90), unlike flat colour, so decode timings mean something.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from gpufeed.processes import process_pool


def _field(rng: np.random.Generator, h: int, w: int, cells: int, amp: float) -> np.ndarray:
    small = rng.normal(0, amp, size=(max(2, h * cells // max(h, w)), max(2, w * cells // max(h, w)), 3))
    img = Image.fromarray(np.clip(small + 128, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.float32) - 128


def natural_image(rng: np.random.Generator, height: int = 375, width: int = 500, label: int = 0) -> np.ndarray:
    """One HWC uint8 image; `label` tints it so classes differ visibly."""
    base = np.array([(label * 67) % 256, (label * 137 + 80) % 256, (label * 29 + 160) % 256], np.float32)
    img = 0.5 * base + 64
    img = img + _field(rng, height, width, 4, 60) + _field(rng, height, width, 24, 30)
    img = img + _field(rng, height, width, 120, 12) + rng.normal(0, 4, size=(height, width, 3))
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for _ in range(rng.integers(2, 6)):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(10, width // 2), y0 + rng.integers(10, height // 2)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)  # type: ignore[arg-type]
    return np.asarray(pil)


def natural_images(count: int, height: int = 375, width: int = 500, seed: int = 0) -> list[np.ndarray]:
    """`count` natural-looking HWC uint8 images, one tint per index."""
    rng = np.random.default_rng(seed)
    return [natural_image(rng, height, width, i) for i in range(count)]


def photos(sizes: list[tuple[int, int]], seed: int = 0) -> list[np.ndarray]:
    """`natural_images`, one per (height, width) of `sizes`, each resized to its size."""
    return [
        np.asarray(Image.fromarray(im).resize((w, h)))
        for im, (h, w) in zip(natural_images(len(sizes), seed=seed), sizes)
    ]


def encode_jpegs(images: list[np.ndarray], quality: int = 90) -> list[bytes]:
    """Each image as baseline JPEG bytes at `quality`."""
    out = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def make_image_folder(
    root: str | Path,
    per_class: int = 32,
    classes: int = 4,
    height: int = 375,
    width: int = 500,
    quality: int = 90,
    seed: int = 0,
) -> Path:
    """Write an ImageFolder tree of JPEGs (class_000/000000.jpg, ...) and return its root."""
    root = Path(root)
    jobs = [
        (root / f"class_{c:03d}", c, start, min(start + 64, per_class), height, width, quality, seed)
        for c in range(classes)
        for start in range(0, per_class, 64)
    ]
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    if per_class * classes <= 256:  # a test's handful: starting processes would take longer
        for job in jobs:
            _write_chunk(job)
        return root
    with process_pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        list(pool.map(_write_chunk, jobs))
    return root


def _write_chunk(job: tuple) -> None:
    folder, label, start, stop, height, width, quality, seed = job
    rng = np.random.default_rng([seed, label, start])
    for i in range(start, stop):
        pixels = natural_image(rng, height, width, label=label)
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=quality)
