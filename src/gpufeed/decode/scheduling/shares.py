"""A batch between `Scheduler.start` and `Scheduler.finish`, as named types."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.decode.asks import Asks
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
    cpu_asks: Asks  # what the CPU decodes of its share (`Scheduler._asks`)
    cpu_job: Any  # the CPU decoder's handle for `collect`
    submitted: float  # perf_counter
    gpu_job: Future | None  # the GPU shares being decoded (`GpuShares`), or None: decoded in `finish`
    gpu: list  # the GPU decoders in use when it started, whose shares `starts` gives

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
