"""Turn any image Pillow reads into RGB pixels of the store's shape, cheaply and safely.

JPEGs are decoded with DCT-domain downscaling (`draft`) when the target is smaller, so huge
photos never need full-size memory. Pillow's decompression-bomb guard is replaced by an
explicit pixel budget checked after that downscale: a 12000×12000 JPEG packs at 1/8 scale,
an equally large PNG is refused with a clear reason instead of crashing a worker.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from gpufeed.sources.images import DEFAULT_MAX_PIXELS as DEFAULT_MAX_PIXELS
from gpufeed.sources.images import RESAMPLE, kept_as_is, upright_rgb
from gpufeed.sources.images import BadImage as BadImage
from gpufeed.sources.images import encode_jpeg as encode_jpeg
from gpufeed.sources.images import own_bomb_guard as own_bomb_guard
from gpufeed.sources.images import to_rgb as to_rgb
from gpufeed.sources.images import truncated_jpeg as truncated_jpeg


def target_scale(w: int, h: int, mode: str, size: int, fit: str, max_side: int) -> float:
    """Scale the decoder may shrink a w×h image by without losing output resolution."""
    if mode == "jpeg":
        return min(1.0, max_side / max(w, h))
    if fit == "crop":
        return size / min(w, h)
    if fit == "pad":
        return size / max(w, h)
    return size / min(w, h)  # stretch: each side must stay >= size


def decode(data: bytes, mode: str, size: int, fit: str, max_side: int, max_pixels: int) -> Image.Image:
    """Decode `data` to an upright RGB image, downscaled in the DCT domain where possible."""
    return decode_sized(data, mode, size, fit, max_side, max_pixels)[0]


def decode_sized(
    data: bytes, mode: str, size: int, fit: str, max_side: int, max_pixels: int
) -> tuple[Image.Image, tuple[int, int]]:
    """`decode`, and the (h, w) of the full image upright (before any DCT downscaling): the frame
    a sample's boxes are given in."""
    return upright_rgb(data, max_pixels, lambda w, h: target_scale(w, h, mode, size, fit, max_side))


def fit_square(img: Image.Image, size: int, fit: str) -> np.ndarray:
    """Fit an RGB image into size×size: center `crop`, `stretch`, or `pad` with black."""
    w, h = img.size
    if fit == "crop":
        side = min(w, h)
        left, top = (w - side) / 2, (h - side) / 2
        out = img.resize((size, size), RESAMPLE, box=(left, top, left + side, top + side))
    elif fit == "stretch":
        out = img.resize((size, size), RESAMPLE)
    else:
        scale = size / max(w, h)
        nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
        out = Image.new("RGB", (size, size))
        out.paste(img.resize((nw, nh), RESAMPLE), ((size - nw) // 2, (size - nh) // 2))
    return np.asarray(out, dtype=np.uint8)


def is_plain_jpeg(data: bytes, max_side: int) -> tuple[int, int] | None:
    """(h, w) if `data` is an upright RGB baseline JPEG within max_side (kept as is), else None."""
    try:
        img = Image.open(io.BytesIO(data))
        return (img.size[1], img.size[0]) if kept_as_is(img, max_side) else None
    except Exception:  # noqa: BLE001  any failure: not kept as is (re-encoded)
        return None
