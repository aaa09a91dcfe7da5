"""What every decoder returns: the decoded images of a batch packed back to back in one buffer."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gpufeed.transfer.uva import device_view


@dataclass
class Decoded:
    """Decoded CHW uint8 images, in batch order except the ones that failed, addressed from one base:
    image i starts `offsets[i]` elements from `base` (possibly in another allocation, which `keep`
    holds alive) with element strides `strides[i]` = (c, y, x)."""

    base: torch.Tensor  # uint8
    offsets: torch.Tensor  # int64 (N,)
    sizes: torch.Tensor  # int32 (N, 2): height, width as decoded
    strides: torch.Tensor  # int64 (N, 3)
    keep: list = field(default_factory=list)  # the tensors the offsets point into
    failed: dict[int, str] = field(default_factory=dict)  # position in its list -> reason
    # called with an event recorded after the kernels that read `base`: hands its buffer back for reuse
    on_done: Callable[[torch.cuda.Event], None] | None = None

    def kept(self, count: int) -> list[int]:
        """Positions (0..count-1) of the images that were decoded, in order."""
        return [k for k in range(count) if k not in self.failed]


def in_place(images: list[torch.Tensor], failed: dict[int, str]) -> Decoded:
    """Address CHW images where they are (no copy): offsets relative to the first image."""
    if not images:
        return Decoded(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64),
                       torch.empty((0, 2), dtype=torch.int32), torch.empty((0, 3), dtype=torch.int64), [], failed)
    base = images[0]
    origin = base.data_ptr()
    offsets = torch.tensor([t.data_ptr() - origin for t in images], dtype=torch.int64)
    sizes = torch.tensor([(t.shape[1], t.shape[2]) for t in images], dtype=torch.int32)
    strides = torch.tensor([t.stride() for t in images], dtype=torch.int64)
    return Decoded(base, offsets, sizes, strides, images, failed)


class PinnedStaging:
    """Pinned host buffers reused across batches, each free again once the kernels reading it ran.

    Pinning a fresh buffer for every batch cost about 6 ms of a 23 ms batch (H100, torch 2.11,
    benchmarks/jpeg_bench.py profiled with py-spy). `alloc(nbytes)` makes another kind of buffer
    (anything with `numel()`). One instance per thread: it is not locked."""

    def __init__(self, pin: bool = True, alloc: Callable[[int], Any] | None = None):
        self.pin = pin
        self._alloc = alloc or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))
        self._free: list = []
        self._busy: deque[tuple[torch.cuda.Event, Any]] = deque()

    def take(self, nbytes: int):
        """A buffer of at least `nbytes` (the smallest free one that fits, else a new one)."""
        while self._busy and self._busy[0][0].query():
            self._free.append(self._busy.popleft()[1])
        fits = [k for k, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:  # by position: `list.remove` would compare tensors element-wise
            return self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
        return self._alloc(nbytes + nbytes // 4)  # headroom for the next sizes

    def give_back(self, buf, done: torch.cuda.Event | None) -> None:
        """`buf` may be reused once `done` (recorded after the last GPU work reading it) has completed;
        at once if `done` is None."""
        if done is None:
            self._free.append(buf)
        else:
            self._busy.append((done, buf))

    def drain(self) -> list:
        """Every buffer, once the GPU work reading it is done; the staging is empty after."""
        for done, buf in self._busy:
            done.synchronize()
            self._free.append(buf)
        self._busy.clear()
        buffers, self._free = self._free, []
        return buffers


def chw_strides(sizes: torch.Tensor) -> torch.Tensor:
    """Element strides (c, y, x) of contiguous CHW images of `sizes` (N, 2: height, width)."""
    h, w = sizes[:, 0].long(), sizes[:, 1].long()
    return torch.stack([h * w, w, torch.ones_like(w)], 1)


def packed(images: list[torch.Tensor], failed: dict[int, str], device: torch.device,
           staging: PinnedStaging | None) -> Decoded:
    """Put contiguous CHW host images back to back in one buffer the kernels on `device` read: on a GPU
    one of `staging`'s pinned buffers, read in place over PCIe (no copy; `on_done` hands it back)."""
    numels = torch.tensor([t.numel() for t in images], dtype=torch.int64)
    offsets = torch.cumsum(numels, 0) - numels
    sizes = torch.tensor([(t.shape[1], t.shape[2]) for t in images], dtype=torch.int32).reshape(-1, 2)
    strides = chw_strides(sizes)
    if not images:
        return Decoded(torch.empty(0, dtype=torch.uint8, device=device), offsets, sizes, strides, [], failed)
    total = int(numels.sum())
    if staging is None:
        return Decoded(torch.cat([t.reshape(-1) for t in images]).to(device), offsets, sizes, strides, [], failed)
    buf = staging.take(total)
    torch.cat([t.reshape(-1) for t in images], out=buf[:total])
    return Decoded(device_view(buf.data_ptr(), (total,), device), offsets, sizes, strides, [buf], failed,
                   on_done=lambda done: staging.give_back(buf, done))
