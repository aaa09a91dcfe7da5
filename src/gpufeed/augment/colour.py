"""Colour kernels on float NCHW batches on the 0..255 scale, with one factor per sample.

torchvision's formulas (its uint8 results are these, rounded); the ops in `pixel` and the
policies in `policies` call them on whole batches or on the samples that drew an op.
"""

from __future__ import annotations

import functools

import torch

GRAY = (0.2989, 0.587, 0.114)


@functools.lru_cache(maxsize=64)
def constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A (1, len(values), 1, 1) tensor on `device`, made once: a tensor built from Python numbers per
    batch is a blocking host-to-device copy, which would wait for every kernel queued on the stream.
    Shared: never write to it."""
    return torch.tensor(values, dtype=dtype).view(1, -1, 1, 1).to(device)


def gray(y: torch.Tensor) -> torch.Tensor:
    return (y * constant(GRAY, y.device, y.dtype)).sum(1, keepdim=True)


def _per_sample(f: torch.Tensor | float, y: torch.Tensor) -> torch.Tensor | float:
    """A factor for every sample (a tensor on y's device), or one number for all."""
    return f if isinstance(f, float) else f.to(y.dtype).view(-1, 1, 1, 1)


def brightness(y: torch.Tensor, f: torch.Tensor | float) -> torch.Tensor:
    return (y * _per_sample(f, y)).clamp_(0, 255)


def contrast(y: torch.Tensor, f: torch.Tensor | float) -> torch.Tensor:
    f = _per_sample(f, y)
    return (f * y + (1 - f) * gray(y).mean((2, 3), keepdim=True)).clamp_(0, 255)


def saturation(y: torch.Tensor, f: torch.Tensor | float) -> torch.Tensor:
    f = _per_sample(f, y)
    return (f * y + (1 - f) * gray(y)).clamp_(0, 255)


def sharpness(y: torch.Tensor, f: torch.Tensor | float) -> torch.Tensor:
    """Blend with a smoothed copy (torchvision's 3x3 kernel, borders kept): f > 1 sharpens, f < 1 blurs."""
    kernel = torch.ones(3, 3, device=y.device, dtype=y.dtype)
    kernel[1, 1] = 5.0
    kernel = (kernel / 13).expand(y.shape[1], 1, 3, 3)
    smooth = torch.nn.functional.conv2d(y, kernel, groups=y.shape[1]).round()  # uint8 in torchvision
    degenerate = y.clone()
    degenerate[:, :, 1:-1, 1:-1] = smooth
    f = _per_sample(f, y)
    return (f * y + (1 - f) * degenerate).clamp(0, 255)


def posterize(y: torch.Tensor, bits: torch.Tensor | float) -> torch.Tensor:
    """Keep the `bits` high bits of each rounded value."""
    step = 2.0 ** (8 - _per_sample(bits, y))
    return torch.floor(y.round() / step) * step


def solarize(y: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    return torch.where(y >= _per_sample(threshold, y), 255 - y, y)


def invert(y: torch.Tensor, _: torch.Tensor | None = None) -> torch.Tensor:
    return 255 - y


def autocontrast(y: torch.Tensor, _: torch.Tensor | None = None) -> torch.Tensor:
    """Stretch each channel of a sample to 0..255 (its min to 0, its max to 255)."""
    low, high = y.amin((2, 3), keepdim=True), y.amax((2, 3), keepdim=True)
    flat = high <= low
    scale = torch.where(flat, torch.ones_like(high), 255 / (high - low).clamp_min(1e-6))
    low = torch.where(flat, torch.zeros_like(low), low)
    return ((y - low) * scale).clamp(0, 255)


def equalize(y: torch.Tensor, _: torch.Tensor | None = None) -> torch.Tensor:
    """Histogram equalization of each channel (PIL's and torchvision's lookup table, on rounded values)."""
    n, c, h, w = y.shape
    values = y.round().clamp(0, 255).long().reshape(n * c, h * w)
    hist = torch.zeros(n * c, 256, device=y.device, dtype=torch.long).scatter_add_(1, values, torch.ones_like(values))
    last = 255 - (hist > 0).flip(1).long().argmax(1)  # the highest value present
    step = (h * w - hist.gather(1, last[:, None])) // 255
    lut = (hist.cumsum(1) + step // 2) // step.clamp_min(1)
    lut = torch.cat([torch.zeros_like(lut[:, :1]), lut[:, :-1]], 1).clamp(0, 255)  # shifted by one
    return torch.where(step > 0, lut.gather(1, values), values).reshape(n, c, h, w).to(y.dtype)
