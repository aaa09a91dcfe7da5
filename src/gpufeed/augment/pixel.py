"""Per-sample colour and pixel ops, and RandomErasing, on whole batches.

Each op draws its per-sample parameters for a batch as columns of one float tensor (`draw`, on
the CPU from the plan's generator, so GPU, CPU and resumed runs agree), and applies them to the
batch with a few tensor ops whatever the samples drew (`apply`: a sample that draws "no" keeps
its pixels through a `where`, never a Python loop over samples). Colour ops work on float NCHW on
the 0..255 scale, between the resampling and Normalize; RandomErasing works after Normalize.
Names, parameters and their distributions follow torchvision's transforms.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpufeed.augment import checks, colour


def _flag(n: int, p: float, g: torch.Generator) -> torch.Tensor:
    """(n, 1): 1.0 where a sample applies the op (probability p)."""
    return (torch.rand(n, 1, generator=g) < p).float()


def _where(flag: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(flag.view(-1, 1, 1, 1) > 0, new, old)


class _Coin:
    """An op each sample applies with probability `self.p`: one column, 1.0 where it does. `change`
    says what the op makes of the batch; a sample that draws "no" keeps its pixels."""

    width = 1
    p: float

    def __post_init__(self):
        checks.probability(self.p, type(self).__name__)

    def change(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # each op says

    def draw(self, n: int, hw: tuple[int, int], g: torch.Generator) -> torch.Tensor:
        return _flag(n, self.p, g)

    def apply(self, y: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return _where(cols[:, 0], self.change(y), y)


def color_jitter(y: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast, saturation blends (torchvision's formulas), then the hue shift if there
    is a fourth column; factors (N, 3 or 4)."""
    y = colour.brightness(y, factors[:, 0])
    y = colour.contrast(y, factors[:, 1])
    y = colour.saturation(y, factors[:, 2])
    return shift_hue(y, factors[:, 3]) if factors.shape[1] > 3 else y


def shift_hue(y: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate each sample's hue by `shift` (N,) turns, through HSV (float NCHW 0..255)."""
    rgb = y / 255
    v, _ = rgb.max(1)
    low, _ = rgb.min(1)
    delta = v - low
    grey = delta == 0
    sat = torch.where(grey, torch.zeros_like(v), delta / torch.where(v == 0, torch.ones_like(v), v))
    d = torch.where(grey, torch.ones_like(delta), delta)
    r, g, b = rgb.unbind(1)
    hue = torch.where(v == r, (g - b) / d, torch.where(v == g, 2 + (b - r) / d, 4 + (r - g) / d))
    hue = torch.where(grey, torch.zeros_like(hue), hue)
    hue = torch.remainder(hue / 6 + shift.view(-1, 1, 1).to(y.dtype), 1.0)
    sector = torch.floor(hue * 6)
    frac = hue * 6 - sector
    sector = sector.long() % 6
    p, q, t = v * (1 - sat), v * (1 - sat * frac), v * (1 - sat * (1 - frac))
    options = torch.stack(
        [torch.stack(o, 1) for o in ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))], 1
    )  # (N, 6 sectors, 3, H, W)
    pick = sector[:, None, None].expand(-1, 1, 3, -1, -1)
    return (options.gather(1, pick).squeeze(1) * 255).clamp_(0, 255)


@dataclass
class ColorJitter:
    """Per-sample brightness, contrast and saturation factors and a hue shift, applied in that order
    (torchvision draws the order per call; here it is fixed). Each is a number x, for factors in
    max(0, 1 - x)..1 + x (a shift in -x..x), or a (min, max) range, as torchvision takes them."""

    brightness: float | Sequence[float] = 0.0
    contrast: float | Sequence[float] = 0.0
    saturation: float | Sequence[float] = 0.0
    hue: float | Sequence[float] = 0.0

    def __post_init__(self):
        self._ranges = [
            checks.jitter(getattr(self, name), "ColorJitter", name) for name in ("brightness", "contrast", "saturation")
        ]
        self._hue = checks.jitter(self.hue, "ColorJitter", "hue", 0.0, (-0.5, 0.5), False)

    @property
    def width(self) -> int:
        return 4 if self._hue else 3

    def draw(self, n: int, hw: tuple[int, int], g: torch.Generator) -> torch.Tensor:
        return self.factors(n, g)

    def apply(self, y: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return color_jitter(y, cols)

    def factors(self, n: int, g: torch.Generator) -> torch.Tensor:
        """(N, 3) float32 factors, or (N, 4) with the hue shift; a range of 0 gives exactly 1."""
        out = torch.ones(n, self.width)
        for k, bounds in enumerate(self._ranges):
            if bounds:
                out[:, k].uniform_(*bounds, generator=g)
        if self._hue:
            out[:, 3].uniform_(*self._hue, generator=g)
        return out


@dataclass
class RandomEqualize(_Coin):
    """Histogram equalization of each channel (PIL's and torchvision's lookup table, on the rounded
    values), with probability `p`."""

    p: float = 0.5

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.equalize(y)


@dataclass
class RandomGrayscale(_Coin):
    """Gray (torchvision's weights, in all three channels) with probability `p`."""

    p: float = 0.1

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.gray(y).expand_as(y)


@dataclass
class RandomSolarize(_Coin):
    """Invert the pixels at or above `threshold` (0..255) with probability `p`."""

    threshold: float
    p: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        checks.number(self.threshold, "RandomSolarize", "threshold")

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.solarize(y, float(self.threshold))


@dataclass
class RandomPosterize(_Coin):
    """Keep the `bits` high bits of each (rounded) channel value with probability `p`."""

    bits: int
    p: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        message = f"RandomPosterize: bits must be a positive integer in the range [0, 8], got {self.bits!r}"
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(message)
        if not 0 <= self.bits <= 8:
            raise ValueError(message)

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.posterize(y, float(self.bits))


@dataclass
class RandomInvert(_Coin):
    """255 - x with probability `p`."""

    p: float = 0.5

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.invert(y)


@dataclass
class RandomAutocontrast(_Coin):
    """Stretch each channel of a sample to 0..255 (its min to 0, max to 255) with probability `p`."""

    p: float = 0.5

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.autocontrast(y)


@dataclass
class RandomAdjustSharpness(_Coin):
    """Blend with a smoothed copy (torchvision's 3x3 kernel, borders kept) by `sharpness_factor`,
    with probability `p`: above 1 sharpens, below 1 blurs."""

    sharpness_factor: float
    p: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if checks.number(self.sharpness_factor, "RandomAdjustSharpness", "sharpness_factor") < 0:
            raise ValueError(f"RandomAdjustSharpness: sharpness_factor ({self.sharpness_factor}) is not non-negative.")

    def change(self, y: torch.Tensor) -> torch.Tensor:
        return colour.sharpness(y, float(self.sharpness_factor))


@dataclass
class GaussianBlur:
    """Gaussian blur with a per-sample sigma drawn uniformly in `sigma`, reflect padding."""

    kernel_size: int | Sequence[int]
    sigma: float | Sequence[float] = (0.1, 2.0)
    width = 1

    def __post_init__(self):
        self._ks = checks.kernel(self.kernel_size, "GaussianBlur")
        self._sigma = checks.number_or_pair(self.sigma, "GaussianBlur", "sigma")
        if not 0 < self._sigma[0] <= self._sigma[1]:
            raise ValueError(
                f"GaussianBlur: sigma values should be positive and of the form (min, max), got {self.sigma!r}"
            )

    def draw(self, n: int, hw: tuple[int, int], g: torch.Generator) -> torch.Tensor:
        return torch.empty(n, 1).uniform_(*self._sigma, generator=g)

    def apply(self, y: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        n, c, h, w = y.shape
        for axis, k in ((3, self._ks[0]), (2, self._ks[1])):  # x then y, as torchvision's kernel is separable
            half = (k - 1) / 2
            x = torch.linspace(-half, half, k, device=y.device, dtype=y.dtype)
            weights = torch.exp(-0.5 * (x[None] / cols[:, :1].to(y.dtype)) ** 2)
            weights = (weights / weights.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (n*c, k)
            shape = (n * c, 1, 1, k) if axis == 3 else (n * c, 1, k, 1)
            pad = (k // 2, k // 2, 0, 0) if axis == 3 else (0, 0, k // 2, k // 2)
            flat = torch.nn.functional.pad(y.reshape(1, n * c, h, w), pad, mode="reflect")
            y = torch.nn.functional.conv2d(flat, weights.view(shape), groups=n * c).view(n, c, h, w)
        return y


@dataclass
class RandomErasing:
    """Erase a random box of each sample (area fraction in `scale`, aspect in `ratio`) with
    probability `p`, filling it with `value`: a number or one per channel, on the output scale
    (after Normalize), or "random" for standard normal noise per pixel, as torchvision does (drawn
    from a seed in the epoch plan: a batch gets the same noise again on the same kind of device, but
    CPU and GPU generators differ). Comes after Normalize, as in torchvision."""

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: float | Sequence[float] = 0.0
    attempts: int = 10
    width = 4  # top, left, height, width (height 0: nothing erased)

    def __post_init__(self):
        op = "RandomErasing"
        checks.probability(self.p, op)
        checks.interval(self.scale, op, "scale", 0, 1, bounds="Scale should be between 0 and 1")
        checks.interval(self.ratio, op, "ratio", 0, open_low=True, bounds="ratio values should be positive")
        checks.integer(self.attempts, op, "attempts", 1, "a positive int")
        if isinstance(self.value, str) and self.value != "random":
            raise ValueError(f"{op}: If value is str, it should be 'random', got {self.value!r}")
        if not isinstance(self.value, (numbers.Number, str, tuple, list)):
            raise TypeError(f"{op}: Argument value should be either a number or str or a sequence, got {self.value!r}")
        if not isinstance(self.value, str):
            checks.channels(self.value, op, "value")

    @property
    def noise(self) -> bool:
        return self.value == "random"

    def draw(self, n: int, hw: tuple[int, int], g: torch.Generator) -> torch.Tensor:
        h, w = hw
        apply = torch.rand(n, generator=g) < self.p
        area = h * w * torch.empty(n, self.attempts, dtype=torch.float64).uniform_(*self.scale, generator=g)
        log_r = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        aspect = torch.exp(torch.empty(n, self.attempts, dtype=torch.float64).uniform_(*log_r, generator=g))
        eh, ew = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))
        fits = (eh < h) & (ew < w)
        first = fits.to(torch.uint8).argmax(1)  # the first attempt that fits, as torchvision's loop
        rows = torch.arange(n)
        eh, ew, ok = eh[rows, first], ew[rows, first], fits.any(1) & apply
        u = torch.rand(n, 2, dtype=torch.float64, generator=g)
        top, left = torch.floor(u[:, 0] * (h - eh + 1)), torch.floor(u[:, 1] * (w - ew + 1))
        box = torch.stack([top, left, eh, ew], 1).float()
        return torch.where(ok[:, None], box, torch.zeros_like(box))

    def apply(self, y: torch.Tensor, cols: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        n, c, h, w = y.shape
        top, left, eh, ew = (cols[:, k].view(n, 1, 1, 1) for k in range(4))
        rows = torch.arange(h, device=y.device).view(1, 1, h, 1)
        columns = torch.arange(w, device=y.device).view(1, 1, 1, w)
        inside = (rows >= top) & (rows < top + eh) & (columns >= left) & (columns < left + ew)
        if self.noise:
            g = torch.Generator(device=y.device).manual_seed(0 if seed is None else seed)
            return torch.where(inside, torch.randn(y.shape, generator=g, device=y.device, dtype=y.dtype), y)
        values = self.value if isinstance(self.value, (tuple, list)) else (self.value,)
        value = colour.constant(tuple(float(v) for v in values), y.device, y.dtype)
        return torch.where(inside, value.expand(1, c, 1, 1), y)


PIXEL_OPS = (
    ColorJitter,
    RandomEqualize,
    RandomGrayscale,
    RandomSolarize,
    RandomPosterize,
    RandomInvert,
    RandomAutocontrast,
    RandomAdjustSharpness,
    GaussianBlur,
)
AFTER_NORMALIZE = (RandomErasing,)
