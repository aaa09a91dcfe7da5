"""Gather a batch of rows from a (memory-mapped) array with threads that release the GIL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


class Gatherer:
    """Copies `src[idx]` into `out` with `threads` parallel `numpy.take` calls (no Python per sample).

    numpy's take releases the GIL and scales with threads on a memory map, where one
    torch.index_select call is single-threaded
    (docs/benchmarks.md, "Kernels, copies and CPU decoding").
    """

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-gather") if self.threads > 1 else None

    def __call__(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`src[idx]` into `out`; `src` may also be rows in several arrays that gather themselves (a
        `take_rows(idx, out)` method, e.g. a sharded store's)."""
        take_rows = getattr(src, "take_rows", None)
        if take_rows is not None:
            take_rows(idx.numpy(), out.numpy())
            return out
        s, i, o = src.numpy(), idx.numpy(), out.numpy()
        if self._pool is None or len(i) < 2 * self.threads:
            np.take(s, i, 0, o, "clip")
            return out
        bounds = np.linspace(0, len(i), self.threads + 1).astype(int)
        jobs = [self._pool.submit(np.take, s, i[a:b], 0, o[a:b], "clip") for a, b in zip(bounds, bounds[1:])]
        for j in jobs:
            j.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
