"""A batch between `Scheduler.start` and `Scheduler.finish`, as named types, and the geometry that
decides what each decoder decodes of it (the region the resize reads, a DCT-reduced size)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.decode.base import Decoded, Encoded


@dataclass
class Started:
    """A batch whose CPU share the CPU decoder has and whose GPU share is being decoded (`Scheduler.start`);
    `Scheduler.finish` waits for both."""

    batch: Encoded
    shapes: np.ndarray  # (N, 2) as the store records them
    boxes: np.ndarray  # (N, 4) crop boxes x0 y0 x1 y1
    out_hw: tuple[int, int]
    order: np.ndarray  # batch positions: each GPU decoder's share in turn, then the CPU's
    starts: np.ndarray  # where each decoder's share begins in `order`
    regions: np.ndarray
    cost: np.ndarray
    cpu_asks: tuple[list, list]  # what the CPU decodes of its share (`Scheduler._asks`)
    cpu_job: Any  # the CPU decoder's handle for `collect`
    submitted: float  # perf_counter
    gpu_job: Future | None  # the GPU shares being decoded (`GpuShares`), or None: decoded in `finish`
    cpu_threads: int  # the CPU decoder's ready threads (workers) when the CPU share was handed over

    @property
    def cpu_pos(self) -> np.ndarray:
        return self.order[self.starts[-2] : self.starts[-1]]


@dataclass
class GpuShare:
    """One GPU decoder's part of a batch."""

    decoder: Any
    positions: np.ndarray  # batch positions it decoded
    part: Decoded
    seconds: float  # its decode call and the wait for its stream


@dataclass
class GpuShares:
    """What the GPU decoders made of a batch, and the seconds until the last of them was done."""

    shares: list[GpuShare]
    seconds: float


def crop_regions(shapes: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(N, 4) y0 x0 y1 x1: the pixels the resize kernel reads for crop `boxes` (x0 y0 x1 y1): the box
    and one pixel around it (bilinear taps of samples half a pixel inside), within the image."""
    lo = np.maximum(np.floor(boxes[:, [1, 0]]) - 1, 0)
    hi = np.minimum(np.ceil(boxes[:, [3, 2]]) + 1, shapes)
    return np.concatenate([lo, hi], 1).astype(np.int64)


def reduce_to(shapes: np.ndarray, boxes: np.ndarray, out_hw: tuple[int, int]) -> list[tuple[int, int] | None]:
    """Per image, the size to ask libjpeg for when its crop is >= 2x the output both ways (DCT
    downscaling), else None."""
    factor = np.minimum((boxes[:, 2] - boxes[:, 0]) / out_hw[1], (boxes[:, 3] - boxes[:, 1]) / out_hw[0])
    w, h = np.ceil(shapes[:, 1] / factor), np.ceil(shapes[:, 0] / factor)
    return [(int(x), int(y)) if f >= 2 else None for f, x, y in zip(factor.tolist(), w.tolist(), h.tolist())]
