"""What every decoder returns: the decoded images of a batch packed back to back in one buffer."""

from __future__ import annotations

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


def packed(images: list[torch.Tensor], failed: dict[int, str], device: torch.device | str, pin: bool) -> Decoded:
    """Copy contiguous CHW host images back to back into one (pinned) buffer on `device`."""
    numels = torch.tensor([t.numel() for t in images], dtype=torch.int64)
    offsets = torch.cumsum(numels, 0) - numels
    sizes = torch.tensor([(t.shape[1], t.shape[2]) for t in images], dtype=torch.int32).reshape(-1, 2)
    strides = torch.tensor([(h * w, w, 1) for h, w in sizes.tolist()], dtype=torch.int64).reshape(-1, 3)
    if not images:
        return Decoded(torch.empty(0, dtype=torch.uint8, device=device), offsets, sizes, strides, [], failed)
    host = torch.empty(int(numels.sum()), dtype=torch.uint8, pin_memory=pin)
    torch.cat([t.reshape(-1) for t in images], out=host)
    return Decoded(host.to(device, non_blocking=True), offsets, sizes, strides, [host], failed)
