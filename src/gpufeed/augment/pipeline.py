"""Run a list of augmentation ops on a whole uint8 batch in a handful of kernels.

`sample` draws every random parameter for the batch on the CPU from a seeded generator (so
GPU and CPU runs, and resumed runs, crop identically); `apply` then does one resampling pass
for all geometry (torchvision's roi_align: bilinear, box-averaged when downscaling), one
flip, the colour jitter and normalisation, and the cast, on whatever device the batch is.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torchvision.ops import roi_align

from gpufeed.augment.ops import (CenterCrop, ColorJitter, Normalize, RandomHorizontalFlip,
                                 RandomResizedCrop, Resize, View, column)

log = logging.getLogger(__name__)
GEOMETRIC = (RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip)
GRAY = (0.2989, 0.587, 0.114)


@dataclass
class Params:
    """Everything random about one batch; move it with `.to(device)` before `apply`."""

    boxes: torch.Tensor  # (N, 4) source boxes x1, y1, x2, y2
    flip: torch.Tensor  # (N,) uint8, 1 = mirrored
    out_hw: tuple[int, int]
    identity: bool  # no resampling needed
    jitter: torch.Tensor | None  # (N, 3) brightness, contrast, saturation factors
    any_flip: bool = True  # known on the host, so apply() never syncs with the device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.boxes, self.flip, self.jitter) if t is not None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Params:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, boxes=move(self.boxes), flip=move(self.flip), jitter=move(self.jitter))


class Augment:
    """A validated chain of ops: geometry first, then ColorJitter, then Normalize last."""

    def __init__(self, ops: Sequence[object]):
        self.ops = list(ops)
        rank = {cls: 0 for cls in GEOMETRIC} | {ColorJitter: 1, Normalize: 2}
        order = []
        for op in self.ops:
            if type(op) not in rank:
                raise TypeError(f"{op!r} is not a gpufeed.augment op ({', '.join(c.__name__ for c in rank)})")
            order.append(rank[type(op)])
        if order != sorted(order) or order.count(1) > 1 or order.count(2) > 1:
            raise ValueError("augment order must be: geometric ops, then at most one ColorJitter, "
                             "then at most one Normalize")
        self.geometric = [op for op in self.ops if isinstance(op, GEOMETRIC)]
        self.jitter = next((op for op in self.ops if isinstance(op, ColorJitter)), None)
        self.normalize = next((op for op in self.ops if isinstance(op, Normalize)), None)

    def sample(self, n: int, height: int | torch.Tensor, width: int | torch.Tensor, g: torch.Generator) -> Params:
        """Draw the parameters of a batch of `n` height×width images (per-sample tensors if sizes differ)."""
        zeros = torch.zeros(n, dtype=torch.float64)
        full = torch.stack([zeros, zeros, column(width, n), column(height, n)], 1)
        view = View(full, torch.zeros(n, dtype=torch.bool), height, width)
        for op in self.geometric:
            view = op(view, g)
        if not view.uniform:
            raise ValueError("the augment ops leave images of different sizes: end with RandomResizedCrop, "
                             "Resize((h, w)) or CenterCrop")
        same_size = isinstance(height, int) and (view.height, view.width) == (height, width)
        identity = same_size and bool((view.boxes == full).all())
        jitter = self.jitter.factors(n, g) if self.jitter else None
        return Params(view.boxes.float(), view.flip.to(torch.uint8), (view.height, view.width), identity, jitter,
                      bool(view.flip.any()))

    def apply(self, images: torch.Tensor, params: Params, dtype: torch.dtype = torch.float32,
              channels_last: bool = False, index: torch.Tensor | None = None) -> torch.Tensor:
        """Augment NHWC uint8 `images` (or `images[index]`) on any device to NCHW `dtype`."""
        if dtype == torch.uint8 and self.normalize:
            raise ValueError("Normalize needs a floating output dtype, not uint8")
        if images.is_cuda and dtype != torch.uint8 and _fused() is not None:
            return self._apply_fused(images, params, dtype, channels_last, index)
        if index is not None:
            images = images.index_select(0, index)
        x = images.permute(0, 3, 1, 2)
        y = x.to(torch.float32, memory_format=torch.contiguous_format)
        if not params.identity:
            idx = torch.arange(len(y), device=y.device, dtype=torch.float32)[:, None]
            rois = torch.cat([idx, params.boxes], 1)
            y = roi_align(y, rois, params.out_hw, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        if params.any_flip:
            y = torch.where(params.flip.view(-1, 1, 1, 1).bool(), y.flip(3), y)
        if params.jitter is not None:
            y = color_jitter(y, params.jitter)
        return finish(y, dtype, self.normalize, channels_last)


    def _apply_fused(self, images: torch.Tensor, params: Params, dtype: torch.dtype,
                     channels_last: bool, index: torch.Tensor | None) -> torch.Tensor:
        """One Triton kernel for gather + resample + flip + normalise + cast (jitter, if any, after it)."""
        jitter = params.jitter is not None
        scale, shift = _affine(images.device, None if jitter else self.normalize)
        y = _fused().resample_normalize(images, params.boxes, params.flip, params.out_hw, scale, shift, torch.float32 if jitter else dtype, channels_last and not jitter,
                                        index)
        if not jitter:
            return y
        return finish(color_jitter(y * 255, params.jitter), dtype, self.normalize, channels_last)


_AFFINE: dict = {}


def _affine(device: torch.device, normalize: Normalize | None, uint8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, shift) taking 0..255 to the output scale, cached per device.

    For uint8 output the values stay 0..255 and 0.5 is added, so the kernel's truncating cast rounds."""
    key = (device, None if normalize is None else (tuple(normalize.mean), tuple(normalize.std)), uint8)
    if key not in _AFFINE:
        if uint8:
            scale, shift = torch.ones(3), torch.full((3,), 0.5)
        elif normalize is None:
            scale, shift = torch.full((3,), 1 / 255), torch.zeros(3)
        else:
            std, mean = torch.tensor(normalize.std), torch.tensor(normalize.mean)
            scale, shift = 1 / (255 * std), -mean / std
        _AFFINE[key] = (scale.float().to(device), shift.float().to(device))
    return _AFFINE[key]


@functools.cache
def _fused():
    """The Triton kernel module, or None (said once) where Triton cannot be imported."""
    try:
        from gpufeed.augment import fused
    except ImportError as e:
        log.warning("Triton unavailable (%s): GPU augmentation falls back to several torch kernels (slower)", e)
        return None
    return fused


def color_jitter(y: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast, saturation blends on 0..255 float NCHW (torchvision's formulas)."""
    gray_w = torch.tensor(GRAY, device=y.device).view(1, 3, 1, 1)
    b, c, s = (factors[:, k].view(-1, 1, 1, 1) for k in range(3))
    y = (y * b).clamp_(0, 255)
    mean = (y * gray_w).sum(1, keepdim=True).mean((2, 3), keepdim=True)
    y = (c * y + (1 - c) * mean).clamp_(0, 255)
    gray = (y * gray_w).sum(1, keepdim=True)
    return (s * y + (1 - s) * gray).clamp_(0, 255)


def finish(y: torch.Tensor, dtype: torch.dtype, normalize: Normalize | None, channels_last: bool) -> torch.Tensor:
    """Normalise (or scale to 0..1), cast, and lay out the batch."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if dtype == torch.uint8:
        return y.round_().clamp_(0, 255).to(torch.uint8, memory_format=fmt)
    if normalize is None:
        return (y * (1 / 255)).to(dtype, memory_format=fmt)
    std = torch.tensor(normalize.std, device=y.device).view(1, 3, 1, 1)
    mean = torch.tensor(normalize.mean, device=y.device).view(1, 3, 1, 1)
    return torch.addcmul(-mean / std, y, 1 / (255 * std)).to(dtype, memory_format=fmt)
