"""Augmentation ops: each draws per-sample parameters for a whole batch as tensors.

Geometric ops don't touch pixels: they move a per-sample source box (x1, y1, x2, y2) and the
output size, so any chain of crops, resizes and flips becomes one resampling pass. Semantics
follow torchvision.transforms.v2 (same parameter ranges, same sampling of crops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpufeed.augment.pixel import ColorJitter  # noqa: F401  (a colour op; importable from here as before)


@dataclass
class View:
    """Where the current (virtual) image lies in the source, for every sample of a batch."""

    boxes: torch.Tensor  # float64 (N, 4): x1, y1, x2, y2 in source pixels
    flip: torch.Tensor  # bool (N,): mirrored relative to the source
    height: int | torch.Tensor  # a tensor (N,) while samples still differ in size (jpeg sources)
    width: int | torch.Tensor

    @property
    def uniform(self) -> bool:
        return isinstance(self.height, int) and isinstance(self.width, int)

    def crop(self, top: torch.Tensor, left: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
             out_h: int | torch.Tensor, out_w: int | torch.Tensor) -> View:
        """Crop rows top..top+h, cols left..left+w of the current view (per sample), output out_h×out_w
        (one size, or per-sample sizes while the samples still differ)."""
        sx = (self.boxes[:, 2] - self.boxes[:, 0]) / self.width
        sy = (self.boxes[:, 3] - self.boxes[:, 1]) / self.height
        left = torch.where(self.flip, self.width - (left + w), left).double()
        x1 = self.boxes[:, 0] + left * sx
        y1 = self.boxes[:, 1] + top.double() * sy
        boxes = torch.stack([x1, y1, x1 + w.double() * sx, y1 + h.double() * sy], 1)
        return View(boxes, self.flip, out_h, out_w)


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _full(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), float(value), dtype=torch.float64)


def column(size: int | torch.Tensor, n: int) -> torch.Tensor:
    """A per-sample float64 column of an image dimension (uniform int or per-sample tensor)."""
    return size.double() if isinstance(size, torch.Tensor) else _full(n, size)


@dataclass
class RandomResizedCrop:
    """Crop a random area fraction in `scale` with aspect in `ratio`, resize to `size`."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    attempts: int = 10

    def __call__(self, view: View, g: torch.Generator) -> View:
        n = view.boxes.shape[0]
        height, width = column(view.height, n), column(view.width, n)
        area, log_ratio = height * width, (math.log(self.ratio[0]), math.log(self.ratio[1]))
        w, h = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        bad = torch.ones(n, dtype=torch.bool)
        pending = torch.arange(n)
        for tries in (1, self.attempts - 1):  # one try for all, then the rest at once for the misses
            if tries < 1 or not len(pending):
                break
            m = len(pending)
            t = area[pending, None] * torch.empty(m, tries, dtype=torch.float64).uniform_(*self.scale, generator=g)
            aspect = torch.exp(torch.empty(m, tries, dtype=torch.float64).uniform_(*log_ratio, generator=g))
            wk, hk = torch.round(torch.sqrt(t * aspect)), torch.round(torch.sqrt(t / aspect))
            ok = (wk > 0) & (hk > 0) & (wk <= width[pending, None]) & (hk <= height[pending, None])
            hit, first = ok.any(1), ok.to(torch.uint8).argmax(1)  # argmax: the first try that fits
            rows = torch.arange(m)
            done = pending[hit]
            w[done], h[done], bad[done] = wk[rows, first][hit], hk[rows, first][hit], False
            pending = pending[~hit]
        u = torch.rand(n, 2, dtype=torch.float64, generator=g)
        top = torch.floor(u[:, 0] * (height - h + 1))
        left = torch.floor(u[:, 1] * (width - w + 1))
        # fallback (no attempt fit): torchvision's central crop at the clamped ratio
        in_ratio = width / height
        narrow, wide = in_ratio < self.ratio[0], in_ratio > self.ratio[1]
        fw = torch.where(wide, torch.round(height * self.ratio[1]), width)
        fh = torch.where(narrow, torch.round(width / self.ratio[0]), height)
        w, h = torch.where(bad, fw, w), torch.where(bad, fh, h)
        top = torch.where(bad, torch.div(height - fh, 2, rounding_mode="floor"), top)
        left = torch.where(bad, torch.div(width - fw, 2, rounding_mode="floor"), left)
        return view.crop(top, left, h, w, *_pair(self.size))


@dataclass
class Resize:
    """Resize to `size`: an int sets the shorter side (aspect kept), a pair sets (h, w)."""

    size: int | tuple[int, int]

    def __call__(self, view: View, g: torch.Generator) -> View:
        n = view.boxes.shape[0]
        height, width = column(view.height, n), column(view.width, n)
        if isinstance(self.size, int) and not view.uniform:
            # images of different sizes (jpeg stores): each gets its own output size, as torchvision
            # gives each image; a later CenterCrop or Resize((h, w)) makes the batch one size again
            short, long_ = torch.minimum(height, width), torch.maximum(height, width)
            other = torch.floor(self.size * long_ / short)
            side = torch.full_like(other, float(self.size))
            wide = height <= width
            out = (torch.where(wide, side, other).long(), torch.where(wide, other, side).long())
        elif isinstance(self.size, int):
            short, long_ = sorted((view.height, view.width))
            other = int(self.size * long_ / short)
            out = (self.size, other) if view.height <= view.width else (other, self.size)
        else:
            out = _pair(self.size)
        return view.crop(_full(n, 0), _full(n, 0), height, width, *out)


@dataclass
class CenterCrop:
    """Crop the central `size` region (torchvision's rounding)."""

    size: int | tuple[int, int]

    def __call__(self, view: View, g: torch.Generator) -> View:
        h, w = _pair(self.size)
        n = view.boxes.shape[0]
        height, width = column(view.height, n), column(view.width, n)
        if bool((height < h).any() or (width < w).any()):
            raise ValueError(f"CenterCrop({self.size}) is larger than some images of the batch")
        top, left = torch.round((height - h) / 2.0), torch.round((width - w) / 2.0)
        return view.crop(top, left, _full(n, h), _full(n, w), h, w)


@dataclass
class RandomHorizontalFlip:
    """Mirror each sample with probability `p`."""

    p: float = 0.5

    def __call__(self, view: View, g: torch.Generator) -> View:
        flip = torch.rand(view.boxes.shape[0], generator=g) < self.p
        return View(view.boxes, view.flip ^ flip, view.height, view.width)


@dataclass
class Normalize:
    """(x / 255 - mean) / std per channel, mean and std on the 0..1 scale like torchvision."""

    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
