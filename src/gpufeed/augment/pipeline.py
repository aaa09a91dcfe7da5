"""Run a list of augmentation ops on a whole uint8 batch in a handful of kernels.

`sample` draws every random parameter for the batch on the CPU from a seeded generator (so
GPU and CPU runs, and resumed runs, crop identically); `apply` then does one resampling pass
for all geometry (torchvision's roi_align: bilinear, box-averaged when downscaling), one
flip, the colour and pixel ops, normalisation and the cast, then RandomErasing and the user's
own callables, on whatever device the batch is.
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
from gpufeed.augment.mix import BATCH_OPS
from gpufeed.augment.pixel import AFTER_NORMALIZE, PIXEL_OPS

log = logging.getLogger(__name__)
GEOMETRIC = (RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip)
COLOUR = PIXEL_OPS


@dataclass
class Params:
    """Everything random about one batch; move it with `.to(device)` before `apply`."""

    boxes: torch.Tensor  # (N, 4) source boxes x1, y1, x2, y2
    flip: torch.Tensor  # (N,) uint8, 1 = mirrored
    out_hw: tuple[int, int]
    identity: bool  # no resampling needed
    pixel: torch.Tensor | None  # (N, columns): every colour/pixel op's and RandomErasing's draws, in order
    any_flip: bool = True  # known on the host, so apply() never syncs with the device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.boxes, self.flip, self.pixel) if t is not None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Params:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, boxes=move(self.boxes), flip=move(self.flip), pixel=move(self.pixel))


class Augment:
    """A validated chain of ops: geometric ops, then colour and pixel ops (in the order given), then
    Normalize, then RandomErasing and any callables of the user's on the finished batch tensor, then
    at most one batch op on (images, labels) (MixUp, CutMix), which the Loader applies."""

    def __init__(self, ops: Sequence[object]):
        self.ops = list(ops)
        rank = {cls: 0 for cls in GEOMETRIC} | {cls: 1 for cls in COLOUR} | {Normalize: 2} | \
            {cls: 3 for cls in AFTER_NORMALIZE} | {cls: 4 for cls in BATCH_OPS}
        order = []
        for op in self.ops:
            if type(op) in rank:
                order.append(rank[type(op)])
            elif callable(op) and not isinstance(op, type):  # the user's own op on the batch tensor
                order.append(3)
            else:
                raise TypeError(f"{op!r} is not a gpufeed.augment op ({', '.join(c.__name__ for c in rank)}) "
                                "nor a callable taking and returning the batch tensor")
        if order != sorted(order) or order.count(2) > 1 or order.count(4) > 1:
            raise ValueError("augment order must be: geometric ops, then colour and pixel ops, then at most one "
                             "Normalize, then RandomErasing and your own callables, then at most one of MixUp, "
                             "CutMix, MixUpOrCutMix")
        self.geometric = [op for op in self.ops if isinstance(op, GEOMETRIC)]
        self.colour = [op for op, r in zip(self.ops, order) if r == 1]
        self.after = [op for op, r in zip(self.ops, order) if r == 3]
        self.batch_op = next((op for op, r in zip(self.ops, order) if r == 4), None)  # the Loader applies it
        self.random = self.colour + [op for op in self.after if isinstance(op, AFTER_NORMALIZE)]
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
        out_hw = (view.height, view.width)
        pixel = torch.cat([op.draw(n, out_hw, g).float() for op in self.random], 1) if self.random else None
        return Params(view.boxes.float(), view.flip.to(torch.uint8), out_hw, identity, pixel, bool(view.flip.any()))

    def _columns(self, pixel: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each random op's columns of `pixel`, by the op's id."""
        out, at = {}, 0
        for op in self.random:
            out[id(op)] = pixel[:, at : at + op.width]
            at += op.width
        return out

    def colour_ops(self, y: torch.Tensor, pixel: torch.Tensor) -> torch.Tensor:
        """The colour and pixel ops, in order, on float NCHW 0..255."""
        columns = self._columns(pixel)
        for op in self.colour:
            y = op.apply(y, columns[id(op)])
        return y

    def after_ops(self, y: torch.Tensor, pixel: torch.Tensor | None) -> torch.Tensor:
        """RandomErasing and the user's callables, in order, on the finished batch."""
        columns = self._columns(pixel) if pixel is not None else {}
        for op in self.after:
            y = op.apply(y, columns[id(op)]) if isinstance(op, AFTER_NORMALIZE) else op(y)
        return y

    def finish(self, y: torch.Tensor, pixel: torch.Tensor | None, dtype: torch.dtype,
               channels_last: bool) -> torch.Tensor:
        """From resampled float NCHW 0..255: colour ops, Normalize and the cast, then the ops after."""
        if self.colour:
            y = self.colour_ops(y, pixel)
        return self.after_ops(finish(y, dtype, self.normalize, channels_last), pixel)

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
        return self.finish(y, params.pixel, dtype, channels_last)


    def _apply_fused(self, images: torch.Tensor, params: Params, dtype: torch.dtype,
                     channels_last: bool, index: torch.Tensor | None) -> torch.Tensor:
        """One Triton kernel for gather + resample + flip + normalise + cast (colour ops, if any, after it,
        then the ops that follow Normalize)."""
        colour = bool(self.colour)
        scale, shift = _affine(images.device, None if colour else self.normalize)
        y = _fused().resample_normalize(images, params.boxes, params.flip, params.out_hw, scale, shift,
                                        torch.float32 if colour else dtype, channels_last and not colour, index)
        if not colour:
            return self.after_ops(y, params.pixel)
        return self.finish(y * 255, params.pixel, dtype, channels_last)


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
