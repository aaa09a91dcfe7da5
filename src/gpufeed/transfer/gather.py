"""Gather a batch of rows from a (memory-mapped) tensor with threads that release the GIL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


class Gatherer:
    """Copies `src[idx]` into `out` in `threads` parallel `index_select` calls (no Python per sample)."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-gather") if self.threads > 1 else None

    def __call__(self, src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self._pool is None or len(idx) < 2 * self.threads:
            return torch.index_select(src, 0, idx, out=out)
        parts = idx.tensor_split(self.threads)
        starts = [0]
        for p in parts[:-1]:
            starts.append(starts[-1] + len(p))
        jobs = [self._pool.submit(torch.index_select, src, 0, p, out=out[s : s + len(p)])
                for p, s in zip(parts, starts)]
        for j in jobs:
            j.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
