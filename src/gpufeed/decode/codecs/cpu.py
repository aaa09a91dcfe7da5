"""CPU JPEG decoding on a thread pool, by `pixels.decode` as the decode worker processes do.

Whole JPEGs go to nvImageCodec's CPU backend (libjpeg-turbo) where it is installed: it lets go of the
GIL for the whole decode, so threads scale, and it is faster than Pillow on one core too; Pillow's
full decode in threads holds the GIL longer, stalls, and slows the GPU decoders' host-side work
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from gpufeed.decode.asks import NO_REGION, Asks, Region
from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, as_tensor, nvimgcodec_install, packed
from gpufeed.decode.codecs import pixels


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
        pixels.region(pixels.tiny_jpeg(), (0, 0, 8, 8))
    except Exception as e:  # noqa: BLE001  any failure is the answer
        return f"{type(e).__name__}: {e}"
    return None


def whole_by_nvimgcodec() -> bool:
    """Whether whole JPEGs go to nvImageCodec's CPU backend here (`pixels.whole_by_nvimgcodec`)."""
    return roi_available() and pixels.whole_by_nvimgcodec()


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


def decode_one(
    data: torch.Tensor, reduce_to: tuple[int, int] | None, region: Region | None = None
) -> tuple[torch.Tensor, Region | None, float]:
    """`pixels.decode` on a tensor's bytes: (contiguous HWC pixels, the `region` they are or None for the
    whole image, time it finished)."""
    image, region, finished = pixels.decode(data.numpy(), reduce_to, region)
    return as_tensor(image), region, finished  # Pillow's are read-only: its buffer, read once


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
