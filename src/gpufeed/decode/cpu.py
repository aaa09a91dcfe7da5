"""CPU JPEG decoding on a thread pool.

libjpeg-turbo through `torchvision.io.decode_jpeg` releases the GIL, so threads scale
(measured on a 16-core H200 host, 500x375 JPEGs: 6.0k img/s with 8 threads; Pillow in
threads holds the GIL and stalls at 1.7k, and slows nvJPEG's host-side work to a crawl).
When the planned crop is at least twice the output both ways, Pillow decodes at 1/2, 1/4 or
1/8 scale in the DCT domain instead (less work for the same output); Pillow is also the
fallback for anything libjpeg-turbo's RGB path refuses.
"""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, packed
from gpufeed.store.reader import as_tensor


def _pillow(data: torch.Tensor, reduce_to: tuple[int, int] | None) -> torch.Tensor:
    img = Image.open(io.BytesIO(data.numpy()))
    if reduce_to is not None and img.format == "JPEG":
        img.draft("RGB", reduce_to)
    img = img if img.mode == "RGB" else img.convert("RGB")
    return as_tensor(np.asarray(img))  # read-only: Pillow's buffer, read once, never written


def decode_one(data: torch.Tensor, reduce_to: tuple[int, int] | None) -> tuple[torch.Tensor, float]:
    """(contiguous HWC pixels, time it finished): the finish time gives the pool's true rate.

    HWC because libjpeg writes HWC: torchvision's CHW result is a view of it. Handing that view over
    cost 1.22 and 1.62 ms an image against 0.95 and 1.20 for HWC, the decode alone 0.87 and 1.04
    (two H100 hosts, one thread, `benchmarks/cpu_layout_probe.py`)."""
    if reduce_to is None:
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB).permute(1, 2, 0).contiguous(), time.perf_counter()
        except RuntimeError:
            pass
    return _pillow(data, reduce_to), time.perf_counter()


class CpuDecoder:
    """Decodes lists of encoded images with `threads` threads into one packed HWC buffer."""

    name = "cpu"

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-decode")
        self.last_done = 0.0  # when the last image of the last `collect` finished decoding
        self._staging = PinnedStaging()  # used from the one thread that calls `collect`

    def submit(self, batch: Encoded, shapes, reduce_to: list[tuple[int, int] | None]):
        """Start decoding; returns futures (one per image) for `collect`. (`shapes`, the sizes the
        store records, are for decoders that reserve room up front; threads don't need them.)"""
        return [self._pool.submit(decode_one, d, r) for d, r in zip(batch.tensors(), reduce_to)]

    def collect(self, futures, device: torch.device, pin: bool) -> Decoded:
        """Wait for `submit`'s futures and put the images (HWC) back to back where `device` reads them:
        pinned buffers the GPU reads in place if `pin`, else a copy on `device`."""
        images, failed, self.last_done = [], {}, 0.0
        for k, f in enumerate(futures):
            try:
                pixels, done = f.result()
                images.append(pixels)
                self.last_done = max(self.last_done, done)
            except Exception as e:  # any decoder error marks this image, never the batch
                failed[k] = f"{type(e).__name__}: {e}"
        return packed(images, failed, device, self._staging if pin else None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
