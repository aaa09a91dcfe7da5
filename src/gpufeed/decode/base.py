"""What every decoder returns: the decoded images of a batch packed back to back in one buffer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Decoded:
    """Images of different sizes in one uint8 buffer, in batch order, except the ones that failed."""

    packed: torch.Tensor  # uint8, flat
    offsets: torch.Tensor  # int64 (N,): where each image starts in `packed`
    sizes: torch.Tensor  # int32 (N, 2): height, width as decoded
    chw: bool  # layout of every image: CHW (nvJPEG) or HWC (Pillow)
    failed: dict[int, str] = field(default_factory=dict)  # position in its list -> reason (not in `packed`)

    def kept(self, count: int) -> list[int]:
        """Positions (0..count-1) of the images that are in `packed`, in order."""
        return [k for k in range(count) if k not in self.failed]


def pack_images(images: list[torch.Tensor], chw: bool, device: torch.device | str, pin: bool = False):
    """(packed, offsets, sizes) of equally laid out uint8 images, concatenated on `device`."""
    numels = torch.tensor([t.numel() for t in images], dtype=torch.int64)
    offsets = torch.cumsum(numels, 0) - numels
    hw = [(t.shape[1], t.shape[2]) if chw else (t.shape[0], t.shape[1]) for t in images]
    sizes = torch.tensor(hw, dtype=torch.int32).reshape(-1, 2)
    if not images:
        return torch.empty(0, dtype=torch.uint8, device=device), offsets, sizes
    flat = [t.reshape(-1) for t in images]
    if pin:
        host = torch.empty(int(numels.sum()), dtype=torch.uint8, pin_memory=True)
        torch.cat(flat, out=host)
        return host.to(device, non_blocking=True), offsets, sizes
    return torch.cat(flat).to(device, non_blocking=True), offsets, sizes
