"""Batch-level ops on (images, labels): MixUp, CutMix, and timm's per-batch choice between them.

Each mixes every sample with the next one in the batch (the batch rolled by one, as torchvision
does) and returns soft targets (N, num_classes): the one-hot labels, optionally smoothed, mixed by
the same weight as the pixels (for CutMix, the area actually pasted). As the last op of a Loader's
`augment` list, its random draws come from (seed, epoch, batch number), so a resumed run mixes the
same way; called by hand, pass a `torch.Generator` or it uses its own, seeded by `seed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpufeed.augment import checks


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """(N, num_classes) float: one-hot, with `smoothing` spread over all classes (timm's way).
    Labels on the CPU are range-checked here; a Loader checks its store's labels once instead (a
    check of GPU labels would wait for the GPU every batch)."""
    if not labels.is_cuda and labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"MixUp/CutMix need labels in 0..{num_classes - 1}; the batch has "
            f"{int(labels.min())}..{int(labels.max())} (-1: a sample without a label)"
        )
    off = smoothing / num_classes
    out = torch.full((len(labels), num_classes), off, device=labels.device)
    return out.scatter_(1, labels.long().view(-1, 1), 1 - smoothing + off)


def _check(op: _Mix, alphas: tuple[str, ...]) -> None:
    """num_classes, the Beta distributions' `alphas` (above 0: at 0 every draw is 0/0), label_smoothing, seed."""
    name = type(op).__name__
    checks.integer(op.num_classes, name, "num_classes", 1, "a positive int")
    for alpha in alphas:
        if checks.number(getattr(op, alpha), name, alpha) <= 0:
            raise ValueError(f"{name}: {alpha} should be positive, got {getattr(op, alpha)!r}")
    if not 0.0 <= checks.number(op.label_smoothing, name, "label_smoothing") <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be between 0.0 and 1.0, got {op.label_smoothing!r}")
    checks.integer(op.seed, name, "seed")


def _beta(alpha: float, g: torch.Generator) -> float:
    """One draw of Beta(alpha, alpha) from `g`: the share of the first of two Gamma(alpha) draws."""
    a = torch._standard_gamma(torch.full((2,), float(alpha)), generator=g)
    return float(a[0] / a.sum())


class _Mix:
    num_classes: int
    label_smoothing: float
    seed: int

    def _generator(self, g: torch.Generator | None) -> torch.Generator:
        if g is not None:
            return g
        if not hasattr(self, "_own"):
            self._own = torch.Generator().manual_seed(self.seed)
        return self._own


@dataclass
class _Pair(_Mix):
    """The fields MixUp and CutMix share, and their targets: mixed by the same weight as the pixels."""

    num_classes: int
    alpha: float = 1.0
    label_smoothing: float = 0.0
    seed: int = 0

    def __post_init__(self):
        _check(self, ("alpha",))

    def _targets(self, labels: torch.Tensor, weight: float) -> torch.Tensor:
        targets = soft_targets(labels, self.num_classes, self.label_smoothing)
        return targets * weight + targets.roll(1, 0) * (1 - weight)


@dataclass
class MixUp(_Pair):
    """images = λ x + (1 - λ) x_rolled, targets likewise; λ ~ Beta(alpha, alpha) per batch."""

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, g: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lam = _beta(self.alpha, self._generator(g))
        mixed = images * lam + images.roll(1, 0) * (1 - lam)
        return mixed.to(images.dtype), self._targets(labels, lam)


@dataclass
class CutMix(_Pair):
    """Paste a box of the rolled batch into each image (area about 1 - λ, λ ~ Beta(alpha, alpha) per
    batch, clipped at the borders as torchvision does); targets mixed by the area pasted."""

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, g: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._generator(g)
        lam = _beta(self.alpha, g)
        h, w = images.shape[-2:]
        cx, cy = (int(v) for v in torch.randint(0, 1 << 30, (2,), generator=g) % torch.tensor([w, h]))
        r = 0.5 * math.sqrt(1.0 - lam)
        half_w, half_h = int(r * w), int(r * h)
        x1, y1, x2, y2 = max(cx - half_w, 0), max(cy - half_h, 0), min(cx + half_w, w), min(cy + half_h, h)
        mixed = images.clone()
        mixed[..., y1:y2, x1:x2] = images.roll(1, 0)[..., y1:y2, x1:x2]
        return mixed, self._targets(labels, 1.0 - (x2 - x1) * (y2 - y1) / (w * h))


@dataclass
class MixUpOrCutMix(_Mix):
    """timm's recipe: per batch, CutMix with probability `switch_prob`, else MixUp; smoothed targets."""

    num_classes: int
    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.1
    seed: int = 0

    def __post_init__(self):
        _check(self, ("mixup_alpha", "cutmix_alpha"))
        checks.probability(self.switch_prob, "MixUpOrCutMix", "switch_prob")

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, g: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._generator(g)
        if float(torch.rand(1, generator=g)) < self.switch_prob:
            return CutMix(self.num_classes, self.cutmix_alpha, self.label_smoothing)(images, labels, g)
        return MixUp(self.num_classes, self.mixup_alpha, self.label_smoothing)(images, labels, g)


BATCH_OPS = (MixUp, CutMix, MixUpOrCutMix)
