"""What every decoder returns: the decoded images of a batch packed back to back in one buffer."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


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
    """Pinned host buffers reused across batches, each freed for reuse once its copy to the GPU ran.

    Pinning a fresh buffer for every batch cost about 6 ms of a 23 ms batch (H100, torch 2.11,
    benchmarks/jpeg_bench.py profiled with py-spy), and page-locking serialises with the GPU work.
    One instance per thread: it is not locked."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._busy: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least `nbytes` (the smallest free one that fits, else a new one)."""
        while self._busy and self._busy[0][0].query():
            self._free.append(self._busy.popleft()[1])
        fits = [k for k, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:  # by position: `list.remove` would compare tensors element-wise
            return self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
        return torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, pin_memory=self.pin)  # headroom for the next sizes

    def give_back(self, buf: torch.Tensor, copied: torch.cuda.Event) -> None:
        """`buf` may be reused once `copied` (recorded after its last copy) has completed."""
        self._busy.append((copied, buf))


def packed(images: list[torch.Tensor], failed: dict[int, str], device: torch.device,
           staging: PinnedStaging | None) -> Decoded:
    """Copy contiguous CHW host images back to back into one buffer on `device` (through `staging`'s
    pinned buffers when the device is a GPU)."""
    numels = torch.tensor([t.numel() for t in images], dtype=torch.int64)
    offsets = torch.cumsum(numels, 0) - numels
    sizes = torch.tensor([(t.shape[1], t.shape[2]) for t in images], dtype=torch.int32).reshape(-1, 2)
    strides = torch.tensor([(h * w, w, 1) for h, w in sizes.tolist()], dtype=torch.int64).reshape(-1, 3)
    if not images:
        return Decoded(torch.empty(0, dtype=torch.uint8, device=device), offsets, sizes, strides, [], failed)
    total = int(numels.sum())
    if staging is None:
        return Decoded(torch.cat([t.reshape(-1) for t in images]).to(device), offsets, sizes, strides, [], failed)
    buf = staging.take(total)
    torch.cat([t.reshape(-1) for t in images], out=buf[:total])
    on_device = buf[:total].to(device, non_blocking=True)
    staging.give_back(buf, torch.cuda.current_stream(device).record_event())
    return Decoded(on_device, offsets, sizes, strides, [], failed)
