"""What an image file is, as the JPEG decoders need to know before they read its bytes as they are, and
how any image becomes the upright RGB baseline JPEG they read: what `gpufeed pack` stores and what a
folder read in place serves of the images it can't serve as they are (the same function, so the same
pixels)."""

from __future__ import annotations

import io
import math
import struct
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Literal

import numpy as np
from PIL import Image, ImageOps

# Pillow's own hard limit (2 × MAX_IMAGE_PIXELS): images larger than this after JPEG
# downscaling are skipped unless the caller raises the budget.
DEFAULT_MAX_PIXELS = 2 * 89_478_485
RESAMPLE = Image.Resampling.BICUBIC
JPEG_QUALITY = 90  # what `gpufeed pack` re-encodes at by default, and a folder read in place always


class BadImage(Exception):
    """An input that cannot become a sample; the message is the reason."""


def plain_jpeg_problem(img: Image.Image) -> str | None:
    """Why the JPEG decoders can't take `img`'s bytes as they are (not a JPEG, progressive, or to be
    turned by its EXIF orientation), or None: what packing keeps with reencode=False and a Loader
    reads in place."""
    if img.format != "JPEG":
        return f"a {img.format} image, not a JPEG"
    if img.info.get("progressive") or img.info.get("progression"):
        return "a progressive JPEG"
    if img.getexif().get(ImageOps.ExifTags.Base.Orientation, 1) != 1:
        return "an EXIF-rotated photo (packing turns it upright)"
    return None


def kept_as_is(img: Image.Image, max_side: int) -> bool:
    """Whether an opened image's bytes are stored (and served in place) as they are: an upright RGB
    baseline JPEG within `max_side`. Anything else is re-encoded by `upright_jpeg`."""
    return img.mode == "RGB" and max(img.size) <= max_side and plain_jpeg_problem(img) is None


# JPEG markers that stand alone, without a length: TEM, RST0-7 (SOI and EOI are not met in a header walk)
_STANDALONE = {0x01, *range(0xD0, 0xD8)}


def truncated_jpeg(data: bytes) -> str | None:
    """Why the JPEG `data` ends before its image does, or None if an end-of-image marker follows its
    image data (bytes after it, as a motion photo appends, are fine). Pillow and the Loader's decoders
    refuse a JPEG cut short, yet its header alone opens: one kept as it is (packed with reencode=False,
    or read in place) is checked with this. Cheap: a walk over the header's segments and one search."""
    pos = scan_data_start(data)
    if isinstance(pos, str):
        return pos
    if data.rfind(b"\xff\xd9", pos) < 0:  # (from the end: where a whole JPEG's is)
        return (
            f"truncated JPEG: no end-of-image marker after its image data ({len(data)} bytes; "
            "cut short in a download or copy?)"
        )
    return None


def scan_data_start(data: bytes) -> int | str:
    """Where the JPEG `data`'s image data starts (after its start-of-scan header), or why its header
    ends first."""
    pos = 2  # after SOI
    while True:
        if pos + 4 > len(data):
            return f"truncated JPEG: its {len(data)} bytes end inside its header"
        if data[pos] != 0xFF:  # stray bytes between segments: skipped to the next marker, as libjpeg does
            pos = data.find(b"\xff", pos)
            if pos < 0:
                return f"truncated JPEG: its {len(data)} bytes end inside its header"
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before a marker
            pos += 1
        elif marker in _STANDALONE:
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
            if marker == 0xDA:  # start of scan: the image data follows its header
                return pos


_SEQUENTIAL = (0xC0, 0xC1)  # baseline and extended sequential Huffman frames: what is kept as it is
_PLAIN_SEGMENTS = {0xC4, 0xDB, 0xDD, 0xFE, *range(0xE0, 0xF0)}  # DHT, DQT, DRI, COM, APPn: all else to Pillow
_EXIF = b"Exif\x00\x00"
_X_RESOLUTION = 0x11A
_ORIENTATION = 0x0112


def plain_jpeg_size(head: bytes, max_side: int) -> tuple[int, int] | None:
    """`plain_jpeg_header`'s (height, width), or None."""
    found = plain_jpeg_header(head, max_side)
    return None if found is None else (found[0], found[1])


def plain_jpeg_header(head: bytes, max_side: int) -> tuple[int, int, int] | None:
    """(height, width, where its image data starts) of a JPEG whose header (`head`: its first bytes, up
    to its scan at least) alone shows that Pillow opens it as a JPEG and `kept_as_is` holds: one
    sequential Huffman frame of 8-bit samples, three components, sides within `max_side` and pixels
    within Pillow's guard, no orientation but 1 (at most one EXIF block, no other APP1), no
    multi-picture (MPF) block, and only the segments Pillow reads without fail as they are here. None
    for anything else, or anything unusual: Pillow then decides, as before. Opening with Pillow took
    3/4 of a folder index's time per file (issue 65)."""
    if head[:3] != b"\xff\xd8\xff":
        return None
    # (offsets into `head` with struct, no segment copied but the EXIF block: this runs per file of a
    # folder's index, a million of them for ImageNet)
    n, pos, size, exif = len(head), 2, None, None
    while pos + 4 <= n:
        ff, marker, length = _SEGMENT.unpack_from(head, pos)
        if ff != 0xFF:
            return None  # stray bytes between segments: Pillow's walk decides
        if marker == 0xDA:  # start of scan: the header is complete
            # (Pillow reads the scan's header too: one past the file's end fails its open)
            if size is None or pos + 2 + length > n or (exif is not None and _exif_orientation(exif) != 1):
                return None
            return (*size, pos + 2 + length)
        if marker not in _PLAIN_SEGMENTS and marker not in _SEQUENTIAL:
            return None
        start, end = pos + 4, pos + 2 + length
        if length < 2 or end > n or not _plain_segment(marker, head, start, end):
            return None
        if marker in _SEQUENTIAL:  # (a component a 3 bytes after the 6: Pillow fails on a part of one)
            if size is not None or end - start != 15:
                return None
            precision, h, w, components = _FRAME.unpack_from(head, start)
            if precision != 8 or components != 3 or not (0 < h <= max_side and 0 < w <= max_side):
                return None
            if Image.MAX_IMAGE_PIXELS is not None and h * w > Image.MAX_IMAGE_PIXELS:
                return None
            size = (h, w)
        elif marker == 0xE1:  # APP1: one EXIF block (Pillow joins several; an XMP one has an orientation too)
            if not head.startswith(_EXIF, start, end) or exif is not None:
                return None
            exif = head[start + len(_EXIF) : end]
        pos = end
    return None


_SEGMENT = struct.Struct(">BBH")  # a segment's 0xFF, its marker, its length (the two bytes included)
_FRAME = struct.Struct(">BHHB")  # a frame header's precision, height, width, components


def _plain_segment(marker: int, head: bytes, start: int, end: int) -> bool:
    """Whether Pillow reads this segment (`head[start:end]`) without fail and it leaves the image a
    plain JPEG."""
    if marker == 0xDB:  # quantization tables, each 65 or 129 bytes: Pillow refuses bytes left over
        while start < end:
            start += 65 if head[start] < 16 else 129
        return start == end
    if marker == 0xE0 and head.startswith(b"JFIF", start, end):
        return end - start >= 7  # its version
    if marker == 0xE2:  # a multi-picture (MPO) block makes it another format; an ICC chunk's header
        return not head.startswith(b"MPF\x00", start, end) and (
            not head.startswith(b"ICC_PROFILE\x00", start, end) or end - start >= 14
        )
    if marker == 0xED:  # Photoshop's resource blocks: Pillow's walk over them can fail
        return not head.startswith(b"Photoshop 3.0\x00", start, end)
    if marker == 0xEE and head.startswith(b"Adobe", start, end):
        return end - start >= 7
    return True


def _exif_orientation(tiff: bytes) -> int | None:
    """The orientation tag of an EXIF block's first IFD (1 where it has none), or None where the block
    is not plainly readable, names it more than once, or has an X resolution other than a rational
    (Pillow's open reads it for the image's dpi, and fails on some other kinds: a 1-byte string)."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return None
    order: Literal["little", "big"] = "little" if tiff[:2] == b"II" else "big"
    if int.from_bytes(tiff[2:4], order) != 42:
        return None
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd < 8 or ifd + 2 > len(tiff):
        return None
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    if ifd + 2 + 12 * count > len(tiff):
        return None
    found = []
    for k in range(count):
        entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
        tag, kind = int.from_bytes(entry[0:2], order), int.from_bytes(entry[2:4], order)
        if tag == _ORIENTATION:
            n = int.from_bytes(entry[4:8], order)
            found.append(int.from_bytes(entry[8:10], order) if kind == 3 and n == 1 else None)
        elif tag == _X_RESOLUTION and kind not in (5, 10):  # (RATIONAL, SRATIONAL)
            return None
    return 1 if not found else found[0] if len(found) == 1 else None


@contextmanager
def own_bomb_guard():
    """Disable Pillow's global guard for the duration; `upright_rgb` enforces its own budget."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB view of any mode: alpha composited on white, 16-bit scaled, palette/CMYK converted."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode != "F" and (np.max(arr) if arr.size else 0) > 255 else 255.0
        arr = np.clip(arr * (255.0 / top), 0, 255).round().astype(np.uint8)
        return Image.fromarray(arr).convert("RGB")
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def upright_rgb(
    data: bytes, max_pixels: int, scale_for: Callable[[int, int], float] | None = None
) -> tuple[Image.Image, tuple[int, int]]:
    """`data` decoded to an upright RGB image, and the (h, w) of the full image upright (before any DCT
    downscaling: the frame a sample's boxes are given in). `scale_for(w, h)`: how far a JPEG may be
    downscaled in the DCT domain (below 1: `draft`), so huge photos never need full-size memory. The
    header's pixel count is checked against `max_pixels` before anything is decoded (call it inside
    `own_bomb_guard`, which lifts Pillow's global guard this replaces)."""
    try:
        img: Image.Image = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:  # the header's size, before anything is allocated or decoded
            raise BadImage(
                f"{w}x{h} image ({img.format}) exceeds max_pixels={max_pixels} "
                "(decompression-bomb guard; raise max_pixels to pack it)"
            )
        turned = img.getexif().get(ImageOps.ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)
        scale = scale_for(w, h) if scale_for is not None else 1.0
        if scale < 1 and img.format == "JPEG":
            img.draft(None, (max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale))))
        img = ImageOps.exif_transpose(img)
        return to_rgb(img), ((w, h) if turned else (h, w))
    except BadImage:
        raise
    except Image.UnidentifiedImageError:
        raise BadImage("not an image Pillow can identify") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode: {e}") from None


def encode_jpeg(img: Image.Image, quality: int, max_side: int) -> tuple[bytes, tuple[int, int]]:
    """Baseline RGB JPEG of `img`, its longer side at most `max_side`; returns (bytes, (h, w))."""
    w, h = img.size
    if max(w, h) > max_side:
        scale = max_side / max(w, h)
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), RESAMPLE)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), (img.size[1], img.size[0])


def upright_jpeg(
    data: bytes, quality: int, max_side: int, max_pixels: int
) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """Any image Pillow reads as an upright RGB baseline JPEG of longer side at most `max_side`: (its
    bytes, its (h, w), the source's (h, w) upright). Raises `BadImage` with the reason."""
    img, source_hw = upright_rgb(data, max_pixels, lambda w, h: min(1.0, max_side / max(w, h)))
    encoded, hw = encode_jpeg(img, quality, max_side)
    return encoded, hw, source_hw
