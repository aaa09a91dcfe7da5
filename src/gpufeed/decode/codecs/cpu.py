"""CPU JPEG decoding on a thread pool.

Whole JPEGs go to nvImageCodec's CPU backend (libjpeg-turbo) where it is installed: it lets go of the
GIL for the whole decode, so threads scale; Pillow's full decode in threads holds the GIL longer,
stalls, and slows the GPU decoders' host-side work
(docs/benchmarks.md, "Kernels, copies and CPU decoding"), so Pillow decodes whole images only
without nvImageCodec (the pixels are the same).
When the planned crop is at least twice the output both ways, Pillow decodes at 1/2, 1/4 or
1/8 scale in the DCT domain instead (less work for the same output); Pillow is also the
fallback for anything nvImageCodec refuses.

With nvImageCodec installed, a crop can be decoded alone (`region`): its libjpeg-turbo backend stops
at the crop's last row and converts only the crop's columns. Pixels are those of the whole decode.
What that saves depends on where the crop lies (`roi_cost`): a crop near the top is cheap, one that
reaches the bottom costs more than the whole image.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from gpufeed.decode.asks import NO_REGION, Asks, Region, tries_region
from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, nvimgcodec_install, packed
from gpufeed.decode.codecs import pixels
from gpufeed.store.reader import as_tensor


@functools.cache
def roi_available() -> bool:
    """Whether nvImageCodec is installed to decode regions. Only looked up: making its decoder here would
    make a CUDA context in a process that may have no use for one (and a region it then fails to decode
    is decoded whole)."""
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except ModuleNotFoundError:  # no `nvidia` package at all
        return False


def roi_problem() -> str | None:
    """Why the CPU can't decode a crop's region alone here, or None if it can (for `gpufeed doctor`: this
    decodes a tiny JPEG, which makes nvImageCodec load its CPU backend in this process)."""
    if not roi_available():
        return f"nvImageCodec is not installed ({nvimgcodec_install()})"
    try:
        _region(torch.from_numpy(_tiny_jpeg()), (0, 0, 8, 8))
    except Exception as e:  # noqa: BLE001  any failure is the answer
        return f"{type(e).__name__}: {e}"
    return None


def _tiny_jpeg() -> np.ndarray:
    """A 16x16 JPEG's bytes, writable (torch warns once per process, on stderr, when a tensor is made over
    a read-only array: `gpufeed doctor` printed that warning)."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, format="JPEG")
    return np.frombuffer(bytearray(buffer.getvalue()), np.uint8)


@functools.cache
def whole_by_nvimgcodec() -> bool:
    """Whether whole JPEGs go to nvImageCodec's CPU backend here: installed, and it decodes a tiny JPEG.
    Asked once, on the first whole image: an install that can't load costs one failed try, not one
    per image."""
    if not roi_available():
        return False
    try:
        pixels.whole(_tiny_jpeg())
    except Exception:  # noqa: BLE001  any failure: Pillow decodes whole JPEGs instead
        return False
    return True


def roi_cost(shapes: np.ndarray, regions: np.ndarray) -> np.ndarray:
    """Estimated CPU time of decoding each region alone, relative to libjpeg-turbo decoding the whole
    image (torchvision's when this was fitted; nvImageCodec's takes about as long). The Huffman decode
    runs down to the region's last row; colour conversion and the copy out cover its area. The weights
    are a least-squares fit over 256 RandomResizedCrop regions of 500x375 q90 JPEGs, one thread
    (two runs on a 2-core dev machine: 0.01 + 0.67 y + 0.41 a and -0.01 + 0.66 y + 0.45 a; by
    `benchmarks/cpu_roi_probe.py`, retired, at 377858b;
    docs/benchmarks.md, "Kernels, copies and CPU decoding")."""
    h, w = shapes[:, 0], shapes[:, 1]
    area = (regions[:, 2] - regions[:, 0]) * (regions[:, 3] - regions[:, 1]) / (h * w)
    return 0.66 * regions[:, 2] / h + 0.43 * area


def _region(data: torch.Tensor, region: Region) -> torch.Tensor:
    return torch.from_numpy(pixels.region(data.numpy(), region))


def _whole(data: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(pixels.whole(data.numpy()))


def _pillow(data: torch.Tensor, reduce_to: tuple[int, int] | None) -> torch.Tensor:
    return as_tensor(pixels.pillow(data.numpy(), reduce_to))  # read-only: Pillow's buffer, read once


_JPEG_START = b"\xff\xd8"  # a JPEG's first marker: nvImageCodec decodes JPEGs whole, Pillow anything else


def decode_one(
    data: torch.Tensor, reduce_to: tuple[int, int] | None, region: Region | None = None
) -> tuple[torch.Tensor, Region | None, float]:
    """(contiguous HWC pixels, the `region` they are or None for the whole image, time it finished):
    the finish time gives the pool's true rate. A DCT reduction (`reduce_to`) takes precedence over the
    region; a region that can't be decoded alone is decoded whole.

    HWC because libjpeg writes HWC: a CHW copy costs a large part of a decode
    (docs/benchmarks.md, "Kernels, copies and CPU decoding"); the resize kernel reads either layout."""
    if tries_region(reduce_to, region):
        try:
            return _region(data, region), region, time.perf_counter()  # type: ignore[arg-type]  # a box: tries_region
        except Exception:  # noqa: BLE001  not installed, not a JPEG it reads: the whole image below says what's wrong
            pass
    if reduce_to is None and bytes(data[:2].numpy()) == _JPEG_START and whole_by_nvimgcodec():
        try:
            return _whole(data), None, time.perf_counter()
        except Exception:  # noqa: BLE001  a JPEG it doesn't read: Pillow below says what's wrong, if anything
            pass
    return _pillow(data, reduce_to), None, time.perf_counter()


@dataclass
class _Done:
    """One image's decode on a thread: its pixels and region (see `decode_one`) or why it failed, when
    it finished, and the seconds it took."""

    pixels: torch.Tensor | None
    region: Region | None
    finished: float
    seconds: float
    error: str = ""


class CpuDecoder:
    """Decodes lists of encoded images with `threads` threads into one packed HWC buffer."""

    name = "cpu"

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-decode")
        self.busy_seconds = 0.0  # the threads' seconds decoding the images collected, summed
        self._staging: PinnedStaging | None = None  # used from the one thread that calls `collect`

    def submit(self, batch: Encoded, shapes, asks: Asks | None = None):
        """Start decoding (`asks`: what of each image, see `decode_one`; None: every image whole); returns
        futures (one per image) for `collect`. (`shapes`, the sizes the store records, are for decoders
        that reserve room up front; threads don't need them.)"""
        each = (asks if asks is not None else Asks.whole(len(batch))).each()
        return [self._pool.submit(self._timed, d, *ask) for d, ask in zip(batch.readable().tensors(), each)]

    def _timed(self, data: torch.Tensor, reduce_to, region) -> _Done:
        began = time.perf_counter()
        try:
            pixels, region, finished = decode_one(data, reduce_to, region)
            return _Done(pixels, region, finished, finished - began)
        except Exception as e:  # noqa: BLE001  any decoder error marks this image, never the batch
            finished = time.perf_counter()
            return _Done(None, None, finished, finished - began, f"{type(e).__name__}: {e}")

    def collect(self, futures, device: torch.device, pin: bool) -> Decoded:
        """Wait for `submit`'s futures and put the images (HWC) back to back where `device` reads them
        (see `decode.base.to_device`), with their decoding seconds and finish time (`Decoded.busy`,
        `done_at`)."""
        images, regions, failed = [], [], {}
        done_at = busy = 0.0
        for k, f in enumerate(futures):
            done = f.result()
            busy += done.seconds
            if done.error:
                failed[k] = done.error
                continue
            images.append(done.pixels)
            regions.append(done.region or NO_REGION)
            done_at = max(done_at, done.finished)
        self.busy_seconds += busy
        if self._staging is None:  # page-locked only where a GPU reads it
            self._staging = PinnedStaging(pin=device.type == "cuda")
        part = packed(images, failed, device, self._staging, np.array(regions, np.int64).reshape(-1, 4), pin)
        part.busy, part.done_at = busy, done_at
        return part

    def close(self) -> None:
        self._pool.shutdown(wait=True)
