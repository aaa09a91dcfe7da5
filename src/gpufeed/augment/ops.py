"""Augmentation ops: each draws per-sample parameters for a whole batch as tensors.

Geometric ops don't touch pixels: they move each sample's `View` (a source box, flips, and once
something pads, a warp), so any chain of them costs one resampling pass, two with a warp.
Semantics follow torchvision.transforms.v2 (same parameter ranges, same sampling of crops).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from gpufeed.augment import checks
from gpufeed.augment.pixel import ColorJitter  # noqa: F401  (a colour op; importable from here as before)
from gpufeed.augment.view import Resampling, View, column, fill_tuple, full, matrices, pair


@dataclass
class RandomResizedCrop:
    """Crop a random area fraction in `scale` with aspect in `ratio`, resize to `size`."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    attempts: int = 10

    def __post_init__(self):
        self.size = checks.size(self.size, "RandomResizedCrop")
        checks.interval(self.scale, "RandomResizedCrop", "scale", low=0, bounds="scale values should be non-negative")
        checks.interval(
            self.ratio, "RandomResizedCrop", "ratio", low=0, open_low=True, bounds="ratio values should be positive"
        )
        checks.integer(self.attempts, "RandomResizedCrop", "attempts", 1, "a positive int")

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
        return view.crop(top, left, h, w, *pair(self.size))


@dataclass
class Resize:
    """Resize to `size`: an int sets the shorter side (aspect kept), a pair sets (h, w). `max_size`
    (with an int size, torchvision's): the longer side is at most this, the shorter one then smaller
    (detection's "shorter side 800, longer at most 1333")."""

    size: int | tuple[int, int]
    max_size: int | None = None

    def __post_init__(self):
        self.size = checks.size(self.size, "Resize", one_int=True)
        if self.max_size is not None:
            checks.integer(self.max_size, "Resize", "max_size", 1, "a positive int")
            if not isinstance(self.size, int):
                raise ValueError(f"Resize: max_size is for an int size (the shorter side), got size={self.size!r}")
            if self.max_size <= self.size:
                raise ValueError(
                    f"Resize: max_size = {self.max_size} must be strictly greater than the requested size {self.size}"
                )

    def __call__(self, view: View, g: torch.Generator) -> View:
        n = view.boxes.shape[0]
        height, width = column(view.height, n), column(view.width, n)
        out: tuple[int | torch.Tensor, int | torch.Tensor]  # one size, or per sample
        if isinstance(self.size, int) and not view.uniform:
            # images of different sizes (jpeg stores): each gets its own output size, as torchvision
            # gives each image; a later CenterCrop or Resize((h, w)) makes the batch one size again
            short, long_ = torch.minimum(height, width), torch.maximum(height, width)
            side, other = self._sides(torch.full_like(short, float(self.size)), torch.floor(self.size * long_ / short))
            wide = height <= width
            out = (torch.where(wide, side, other).long(), torch.where(wide, other, side).long())
        elif isinstance(self.size, int):
            h, w = view.need_one_size()  # (one size: the branch above takes the others)
            lo, hi = sorted((h, w))
            short_side, long_side = self._sides(
                torch.tensor(float(self.size)), torch.tensor(float(int(self.size * hi / lo)))
            )
            s, o = int(short_side), int(long_side)
            out = (s, o) if h <= w else (o, s)
        else:
            out = pair(self.size)
        return view.crop(full(n, 0), full(n, 0), height, width, *out)

    def _sides(self, short: torch.Tensor, long_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shorter, longer) output sides with the longer one capped at `max_size` (torchvision's rounding)."""
        if self.max_size is None:
            return short, long_
        over = long_ > self.max_size
        return torch.where(over, torch.floor(self.max_size * short / long_), short), long_.clamp(max=self.max_size)


@dataclass
class CenterCrop:
    """Crop the central `size` region (torchvision's rounding)."""

    size: int | tuple[int, int]

    def __post_init__(self):
        self.size = checks.size(self.size, "CenterCrop")

    def __call__(self, view: View, g: torch.Generator) -> View:
        h, w = pair(self.size)
        n = view.boxes.shape[0]
        height, width = column(view.height, n), column(view.width, n)
        if bool((height < h).any() or (width < w).any()):
            raise ValueError(f"CenterCrop({self.size}) is larger than some images of the batch")
        top, left = torch.round((height - h) / 2.0), torch.round((width - w) / 2.0)
        return view.crop(top, left, full(n, h), full(n, w), h, w)


@dataclass
class RandomHorizontalFlip:
    """Mirror each sample with probability `p`."""

    p: float = 0.5

    def __post_init__(self):
        checks.probability(self.p, "RandomHorizontalFlip")

    def __call__(self, view: View, g: torch.Generator) -> View:
        return view.mirror(torch.rand(view.n, generator=g) < self.p, None)


@dataclass
class RandomVerticalFlip:
    """Turn each sample upside down with probability `p`."""

    p: float = 0.5

    def __post_init__(self):
        checks.probability(self.p, "RandomVerticalFlip")

    def __call__(self, view: View, g: torch.Generator) -> View:
        return view.mirror(None, torch.rand(view.n, generator=g) < self.p)


PADDING_MODES = ("constant", "edge", "reflect", "symmetric")


@dataclass
class RandomCrop:
    """A `size` crop at a uniformly drawn position, after padding each side by `padding` (an int, (left
    and right, top and bottom) or (left, top, right, bottom)) with `fill`, as the CIFAR recipe does;
    `pad_if_needed` pads images smaller than `size` on both sides. Without padding it only moves the
    crop box; with padding the warp pass fills, or with padding_mode "edge", "reflect" or
    "symmetric" extends the image as torch.nn.functional.pad and numpy do (those modes need the
    RandomCrop to come before any other op that turns, shears or pads)."""

    size: int | tuple[int, int]
    padding: int | Sequence[int] | None = None
    pad_if_needed: bool = False
    fill: float | Sequence[float] = 0
    padding_mode: str = "constant"

    def __post_init__(self):
        self.size = checks.size(self.size, "RandomCrop")
        if self.padding_mode not in PADDING_MODES:
            raise ValueError(
                f"RandomCrop: Padding mode should be either constant, edge, reflect or symmetric, got "
                f"{self.padding_mode!r}"
            )
        pad = self.padding if isinstance(self.padding, (tuple, list)) else [self.padding or 0]
        if len(pad) not in (1, 2, 4) or not all(isinstance(p, int) and not isinstance(p, bool) for p in pad):
            raise ValueError(
                f"RandomCrop: Padding must be an int or a 1, 2, or 4 element of tuple or list, got {self.padding!r}"
            )
        if min(pad) < 0:
            raise ValueError(f"RandomCrop: padding should be non-negative, got {self.padding!r}")
        checks.fill(self.fill, "RandomCrop")
        pad = cast("list[int]", list(pad))  # checked above: ints
        self._pad = pad * 4 if len(pad) == 1 else (pad * 2 if len(pad) == 2 else pad)  # left, top, right, bottom

    def __call__(self, view: View, g: torch.Generator) -> View:
        h, w = pair(self.size)
        n = view.n
        left_pad, top_pad, right_pad, bottom_pad = (full(n, p) for p in self._pad)
        height = column(view.height, n) + top_pad + bottom_pad
        width = column(view.width, n) + left_pad + right_pad
        if self.pad_if_needed:
            grow_h, grow_w = (h - height).clamp_min(0), (w - width).clamp_min(0)
            top_pad, left_pad, height, width = (
                top_pad + grow_h,
                left_pad + grow_w,
                height + 2 * grow_h,
                width + 2 * grow_w,
            )
        if bool((height < h).any() or (width < w).any()):
            raise ValueError(f"RandomCrop({self.size}) is larger than some (padded) images of the batch")
        u = torch.rand(n, 2, dtype=torch.float64, generator=g)
        top, left = torch.floor(u[:, 0] * (height - h + 1)), torch.floor(u[:, 1] * (width - w + 1))
        if not bool((top_pad > 0).any() or (left_pad > 0).any() or any(self._pad)):
            return view.crop(top, left, full(n, h), full(n, w), h, w)
        shift = matrices(n, tx=left - left_pad, ty=top - top_pad)
        if self.padding_mode == "constant":
            return view.then(shift, h, w, Resampling(None, fill_tuple(self.fill)), fills=True)
        if view.bounds:
            raise ValueError(
                f"RandomCrop(padding_mode={self.padding_mode!r}) must come before the ops that turn, "
                "shear or pad: it extends the image they start from"
            )
        return view.then(shift, h, w, Resampling(None, None, self.padding_mode), fills=True)


@dataclass
class Normalize:
    """(x / 255 - mean) / std per channel, mean and std on the 0..1 scale like torchvision."""

    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    def __post_init__(self):
        """One value or one per channel each, kept as three floats; std above 0."""
        self.mean = checks.channels(self.mean, "Normalize", "mean")
        self.std = checks.channels(self.std, "Normalize", "std")
        if 0 in self.std:
            raise ValueError(f"Normalize: std evaluated to zero, leading to division by zero, got {self.std}")
        if min(self.std) < 0:
            raise ValueError(f"Normalize: std values should be positive, got {self.std}")
