"""CPU JPEG decoding on a thread pool (Pillow/libjpeg-turbo releases the GIL while decoding).

When the planned crop is at least twice the output size, the decoder asks libjpeg for a
1/2, 1/4 or 1/8 scale decode (DCT-domain downscaling): less work for the same output.
"""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from gpufeed.decode.base import Decoded, pack_images


def _decode_one(data: bytes, reduce_to: tuple[int, int] | None) -> tuple[np.ndarray, float]:
    """(HWC pixels, time it finished): the finish time gives the pool's true rate."""
    img = Image.open(io.BytesIO(data))
    if reduce_to is not None and img.format == "JPEG":
        img.draft("RGB", reduce_to)
    img = img if img.mode == "RGB" else img.convert("RGB")
    return np.asarray(img), time.perf_counter()


class CpuDecoder:
    """Decodes lists of encoded images with `threads` threads into one packed HWC buffer."""

    name = "cpu"

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-decode")
        self.last_done = 0.0  # when the last image of the last `collect` finished decoding

    def submit(self, datas: list[bytes], reduce_to: list[tuple[int, int] | None]):
        """Start decoding; returns futures (one per image) for `collect`."""
        return [self._pool.submit(_decode_one, d, r) for d, r in zip(datas, reduce_to)]

    def collect(self, futures, device: torch.device | str, pin: bool) -> Decoded:
        """Wait for `submit`'s futures and pack the images (HWC) onto `device`."""
        images, failed, self.last_done = [], {}, 0.0
        for k, f in enumerate(futures):
            try:
                pixels, done = f.result()
                images.append(torch.from_numpy(pixels))
                self.last_done = max(self.last_done, done)
            except Exception as e:  # any decoder error marks this image, never the batch
                failed[k] = f"{type(e).__name__}: {e}"
        packed, offsets, sizes = pack_images(images, chw=False, device=device, pin=pin)
        return Decoded(packed, offsets, sizes, False, failed)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
