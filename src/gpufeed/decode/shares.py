"""A batch between `Scheduler.start` and `Scheduler.finish`, as named types, and the geometry that
decides what each decoder decodes of it (the region the resize reads, a DCT-reduced size)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.decode import pixels
from gpufeed.decode.base import Decoded, Encoded, Region
from gpufeed.decode.protocol import NO_REGION, asked


@dataclass
class Pace:
    """The training loop's seconds waiting for batches since the producer's last one, the seconds
    between the producer's two batches, and the loop's own seconds per batch since then (from taking
    one to asking for the next: what it spends training; None: it took none)."""

    starved: float
    interval: float
    step: float | None = None


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
    cpu_asks: Asks  # what the CPU decodes of its share (`Scheduler._asks`)
    cpu_job: Any  # the CPU decoder's handle for `collect`
    submitted: float  # perf_counter
    gpu_job: Future | None  # the GPU shares being decoded (`GpuShares`), or None: decoded in `finish`

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


def reduce_to(shapes: np.ndarray, boxes: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """(N, 2) int64: per image, the size (w, h) to ask libjpeg for when its crop is >= 2x the output
    both ways (DCT downscaling), else (0, 0)."""
    factor = np.minimum((boxes[:, 2] - boxes[:, 0]) / out_hw[1], (boxes[:, 3] - boxes[:, 1]) / out_hw[0])
    with np.errstate(divide="ignore", invalid="ignore"):  # an empty box: no reduction
        size = np.ceil(shapes[:, [1, 0]] / factor[:, None])
    return np.where((factor >= 2)[:, None], size, 0).astype(np.int64)


@dataclass
class Asks:
    """What the CPU decodes of each image of its share, one row per image (arrays, not a tuple per
    image: the loader's per-batch Python is what costs the training thread): a size to DCT-reduce
    towards, or else a region to decode alone, or else the whole image (`pixels.decode`)."""

    reduce_to: np.ndarray  # (N, 2) int64 (w, h); (0, 0): no reduction
    regions: np.ndarray  # (N, 4) int64 y0 x0 y1 x1; all -1: the whole image

    @classmethod
    def whole(cls, n: int) -> Asks:
        return cls(np.zeros((n, 2), np.int64), np.tile(np.array(NO_REGION, np.int64), (n, 1)))

    def __len__(self) -> int:
        return len(self.reduce_to)

    def take(self, positions) -> Asks:
        return Asks(self.reduce_to[positions], self.regions[positions])

    def nbytes(self, shapes: np.ndarray) -> np.ndarray:
        """Per image of stored `shapes` (N, 2), the bytes of its pixels as asked (HWC uint8): a region's,
        a DCT-reduced image's (`pixels.draft_scale`), or else the whole image's. A decoder that cannot
        decode a region alone cuts it from the whole image, so this is the room a worker may fill."""
        h, w = shapes[:, 0].astype(np.int64), shapes[:, 1].astype(np.int64)
        reduced = self.reduce_to[:, 0] > 0
        if reduced.any():
            scale = pixels.draft_scale(w[reduced], h[reduced], self.reduce_to[reduced])
            h[reduced], w[reduced] = -(-h[reduced] // scale), -(-w[reduced] // scale)
        alone, r = self.tries_region(), self.regions
        h, w = np.where(alone, r[:, 2] - r[:, 0], h), np.where(alone, r[:, 3] - r[:, 1], w)
        return h * w * 3

    def tries_region(self) -> np.ndarray:
        """Per image, whether its decode tries the region alone (asked, and no DCT reduction, which
        takes precedence): `pixels.tries_region` for every row at once."""
        return (self.regions[:, 0] >= 0) & (self.reduce_to[:, 0] == 0)

    def each(self) -> list[tuple[tuple[int, int] | None, Region | None]]:
        """Per image, `pixels.decode`'s (reduce_to, region) arguments (for decoders that take images one by one)."""
        return [asked(r, g) for r, g in zip(self.reduce_to.tolist(), self.regions.tolist())]
