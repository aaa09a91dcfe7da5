"""Turn any image Pillow reads into RGB pixels of the store's shape, cheaply and safely.

JPEGs are decoded with DCT-domain downscaling (`draft`) when the target is smaller, so huge
photos never need full-size memory. Pillow's decompression-bomb guard is replaced by an
explicit pixel budget checked after that downscale: a 12000×12000 JPEG packs at 1/8 scale,
an equally large PNG is refused with a clear reason instead of crashing a worker.
"""

from __future__ import annotations

import io
import math
import warnings
from contextlib import contextmanager

import numpy as np
from PIL import Image, ImageOps

from gpufeed.sources.images import plain_jpeg_problem

# Pillow's own hard limit (2 × MAX_IMAGE_PIXELS): images larger than this after JPEG
# downscaling are skipped unless the caller raises the budget.
DEFAULT_MAX_PIXELS = 2 * 89_478_485
RESAMPLE = Image.Resampling.BICUBIC


class BadImage(Exception):
    """An input that cannot become a sample; the message is the reason."""


@contextmanager
def own_bomb_guard():
    """Disable Pillow's global guard for the duration; `decode` enforces its own budget."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _draft_request(w: int, h: int, scale: float) -> tuple[int, int]:
    return max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale))


def target_scale(w: int, h: int, mode: str, size: int, fit: str, max_side: int) -> float:
    """Scale the decoder may shrink a w×h image by without losing output resolution."""
    if mode == "jpeg":
        return min(1.0, max_side / max(w, h))
    if fit == "crop":
        return size / min(w, h)
    if fit == "pad":
        return size / max(w, h)
    return size / min(w, h)  # stretch: each side must stay >= size


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB view of any mode: alpha composited on white, 16-bit scaled, palette/CMYK converted."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode != "F" and arr.max(initial=0) > 255 else 255.0
        arr = np.clip(arr * (255.0 / top), 0, 255).round().astype(np.uint8)
        return Image.fromarray(arr).convert("RGB")
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def decode(data: bytes, mode: str, size: int, fit: str, max_side: int, max_pixels: int) -> Image.Image:
    """Decode `data` to an upright RGB image, downscaled in the DCT domain where possible."""
    return decode_sized(data, mode, size, fit, max_side, max_pixels)[0]


def decode_sized(
    data: bytes, mode: str, size: int, fit: str, max_side: int, max_pixels: int
) -> tuple[Image.Image, tuple[int, int]]:
    """`decode`, and the (h, w) of the full image upright (before any DCT downscaling): the frame
    a sample's boxes are given in."""
    try:
        img: Image.Image = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:  # the header's size, before anything is allocated or decoded
            raise BadImage(
                f"{w}x{h} image ({img.format}) exceeds max_pixels={max_pixels} "
                "(decompression-bomb guard; raise max_pixels to pack it)"
            )
        turned = img.getexif().get(ImageOps.ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)
        scale = target_scale(w, h, mode, size, fit, max_side)
        if scale < 1 and img.format == "JPEG":
            img.draft(None, _draft_request(w, h, scale))
        img = ImageOps.exif_transpose(img)
        return to_rgb(img), ((w, h) if turned else (h, w))
    except BadImage:
        raise
    except Image.UnidentifiedImageError:
        raise BadImage("not an image Pillow can identify") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode: {e}") from None


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
        ok = img.mode == "RGB" and max(img.size) <= max_side and plain_jpeg_problem(img) is None
        return (img.size[1], img.size[0]) if ok else None
    except Exception:  # noqa: BLE001  any failure: not kept as is (re-encoded)
        return None


def encode_jpeg(img: Image.Image, quality: int, max_side: int) -> tuple[bytes, tuple[int, int]]:
    """Baseline RGB JPEG of `img`, its longer side at most `max_side`; returns (bytes, (h, w))."""
    w, h = img.size
    if max(w, h) > max_side:
        scale = max_side / max(w, h)
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), RESAMPLE)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), (img.size[1], img.size[0])
