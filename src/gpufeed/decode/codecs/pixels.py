"""CPU JPEG decoding to numpy HWC pixels with Pillow and nvImageCodec's CPU backend, without torch.

The decode worker processes use these alone, so they start in a fraction of a second (importing
torch takes seconds); the loader's own CPU threads use them too (`decode.codecs.cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import threading
import time

import numpy as np
from PIL import Image

from gpufeed.decode.asks import Region, draft_scale, tries_region
from gpufeed.logs import logger
from gpufeed.stderr import stderr_aside

log = logger(__name__)
_local = threading.local()  # a region decoder per thread: nvImageCodec decoders are not shared


@functools.cache
def nvimgcodec():
    """The `nvidia.nvimgcodec` module (ImportError without the extra). Its own log (ANSI-coloured
    "[ERROR] ... Premature end of JPEG data" lines on stderr for each image it can't read) is off unless
    the user set `PYNVIMGCODEC_VERBOSITY`: a failed image is reported once, by gpufeed, with its path."""
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    with quiet_codecs("on import"):
        from nvidia import nvimgcodec as module
    return module


# nvImageCodec's report lines: its log's (coloured even into a file: "\x1b[0;31m[ERROR] \x1b[0m[nvjpeg-ext]
# ...") and its extensions' own about a library they can't load ("Failed to load nvjpeg library! ...",
# "Note: If using nvImageCodec's ..."). A plain "[WARNING] ..." is someone else's (a user's log format)
_REPORT = re.compile(
    rb"\x1b\[[0-9;]*m\[(?:ERROR|WARNING|INFO|DEBUG|TRACE)\] ?\x1b\[0m\[[\w-]+\]"
    rb"|Failed to load \S+ library|Note: If using nvImageCodec"
)


@contextlib.contextmanager
def quiet_codecs(when: str):
    """Loading nvImageCodec's extensions (on import, or for an instance of its C API) prints a report
    to stderr for every codec library it can't load (JPEG 2000, TIFF, ...); JPEG decoding needs none
    of them, so the report goes to the debug log instead (`gpufeed.stderr.stderr_aside`). What else the
    process wrote meanwhile (another thread's warning) is written to stderr once it is back."""
    with stderr_aside(when, _sorted):
        yield


def _sorted(whens: list[str], data: bytes) -> None:
    """nvImageCodec's report to the debug log; the rest of `data` to stderr, as it was written."""
    lines = data.splitlines(keepends=True)
    report = b"".join(line for line in lines if _REPORT.match(line))
    rest = b"".join(line for line in lines if not _REPORT.match(line))
    if report.strip():
        log.debug("nvImageCodec %s: %s", "; ".join(whens), report.decode(errors="replace").strip())
    left = memoryview(rest)
    try:
        while left:
            left = left[os.write(2, left) :]
    except OSError:  # stderr closed, or a pipe nobody reads: what the process wrote there is lost as it would be
        pass


def _cpu_decoder():
    """(module, this thread's CPU-only nvImageCodec decoder, its parameters: RGB, no EXIF rotation, as
    Pillow decodes)."""
    decoder = getattr(_local, "decoder", None)
    if decoder is None:
        nv = nvimgcodec()
        decoder = _local.decoder = (
            nv,
            nv.Decoder(
                device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                max_num_cpu_threads=1,
                backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
            ),
            nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB),
        )
    return decoder


def warm() -> None:
    """Make this thread's region decoder now, if nvImageCodec is installed: its import and decoder take
    about a second on a GPU host, which would otherwise count as the first images' decode time (the
    loader measures the workers' pace by it)."""
    with contextlib.suppress(Exception):  # not installed or not loadable: regions fall back to whole images
        _cpu_decoder()


def region(data: np.ndarray, box: Region) -> np.ndarray:
    """HWC pixels of region `box` of the JPEG `data`, decoded alone; raises if nvImageCodec can't."""
    nv, decoder, params = _cpu_decoder()
    image = decoder.decode(nv.CodeStream(data).get_sub_code_stream(region=nv.Region(*box)), params=params)
    if image is None:
        raise RuntimeError("nvImageCodec's CPU decoder refused the region")
    pixels = np.asarray(image)
    if pixels.shape != (box[2] - box[0], box[3] - box[1], 3):
        raise RuntimeError(f"region {box} decoded to {tuple(pixels.shape)}")
    return pixels


def whole(data: np.ndarray) -> np.ndarray:
    """HWC RGB pixels of the whole image `data` by nvImageCodec's CPU backend (libjpeg-turbo for a JPEG:
    Pillow's pixels, faster, and the GIL let go for the whole decode); raises if nvImageCodec can't."""
    nv, decoder, params = _cpu_decoder()
    image = decoder.decode(nv.CodeStream(data), params=params)
    if image is None:
        raise RuntimeError("nvImageCodec's CPU decoder refused the image")
    return np.asarray(image)


def pillow(data: np.ndarray, reduce_to: tuple[int, int] | None) -> np.ndarray:
    """HWC RGB pixels (read-only) of any image Pillow reads; with `reduce_to` (w, h), divided by
    `draft_scale` (rounding up): in the DCT where the image is a JPEG that allows it, else by
    averaging (`Image.reduce`), so the size is what the loader reserved room for."""
    # (numpy's stubs give an ndarray the buffer protocol from Python 3.12 on)
    img: Image.Image = Image.open(io.BytesIO(data))  # type: ignore[arg-type, unused-ignore]
    if reduce_to is not None:
        scale = int(draft_scale(img.width, img.height, np.array(reduce_to)))
        planned = (-(-img.width // scale), -(-img.height // scale))
        if img.format == "JPEG":
            img.draft("RGB", reduce_to)
    img = img if img.mode == "RGB" else img.convert("RGB")
    if reduce_to is not None and img.size != planned:
        img = img.reduce(scale)
    return np.asarray(img)


def cut(pixels: np.ndarray, box: Region) -> np.ndarray | None:
    """Region `box` of a whole image's HWC pixels, contiguous; None if the box is not inside it."""
    y0, x0, y1, x1 = box
    if not (0 <= y0 < y1 <= pixels.shape[0] and 0 <= x0 < x1 <= pixels.shape[1]):
        return None
    return np.ascontiguousarray(pixels[y0:y1, x0:x1])


def as_asked(
    image: np.ndarray, region: Region | None, reduce_to: tuple[int, int] | None, box: Region | None
) -> tuple[np.ndarray, Region | None, bool]:
    """A decode's (HWC pixels, region) as the loader reserved room for them: a region asked for and
    refused alone (decoded whole) is cut to it. Also whether it was cut."""
    if tries_region(reduce_to, box) and region is None:
        part = cut(image, box)  # type: ignore[arg-type, unused-ignore]  # a box: tries_region
        if part is not None:
            return part, box, True
    return image, region, False


@functools.cache
def whole_by_nvimgcodec() -> bool:
    """Whether whole JPEGs go to nvImageCodec's CPU backend in this process: installed, and it decodes a
    tiny JPEG. Asked once, on the first whole image: an install that can't load costs one failed try,
    not one per image."""
    try:
        whole(tiny_jpeg())
    except Exception:  # noqa: BLE001  not installed or not loadable: Pillow decodes whole JPEGs instead
        return False
    return True


def tiny_jpeg() -> np.ndarray:
    """A 16x16 JPEG's bytes, writable (torch warns once per process, on stderr, when a tensor is made over
    a read-only array: `gpufeed doctor` printed that warning)."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, format="JPEG")
    return np.frombuffer(bytearray(buffer.getvalue()), np.uint8)


_JPEG_START = b"\xff\xd8"  # a JPEG's first marker: nvImageCodec decodes JPEGs whole, Pillow anything else


def decode(
    data: np.ndarray, reduce_to: tuple[int, int] | None, box: Region | None = None
) -> tuple[np.ndarray, Region | None, float]:
    """(contiguous HWC pixels, the region `box` they are or None for the whole image, time it finished):
    the finish time gives the decoders' true rate. A DCT reduction (`reduce_to`) takes precedence over
    the region, decoded by Pillow; a region that can't be decoded alone is decoded whole. Whole JPEGs go
    to nvImageCodec's CPU backend where it loads: about 1.3-2x Pillow's rate on photo-like JPEGs on
    one core (Pillow decodes into 4-byte pixels and copies them out), the same pixels; Pillow takes
    what it refuses and says what's wrong, if anything.

    HWC because libjpeg writes HWC: a CHW copy costs a large part of a decode
    (docs/benchmarks.md, "Kernels, copies and CPU decoding"); the resize kernel reads either layout."""
    if tries_region(reduce_to, box):
        try:
            return region(data, box), box, time.perf_counter()  # type: ignore[arg-type, unused-ignore]  # a box: tries_region
        except Exception:  # noqa: BLE001  not installed, not a JPEG it reads: the whole image below says what's wrong
            pass
    if reduce_to is None and bytes(data[:2]) == _JPEG_START and whole_by_nvimgcodec():
        try:
            return whole(data), None, time.perf_counter()
        except Exception:  # noqa: BLE001  a JPEG it doesn't read: Pillow below says what's wrong, if anything
            pass
    return pillow(data, reduce_to), None, time.perf_counter()
