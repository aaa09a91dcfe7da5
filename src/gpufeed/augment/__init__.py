"""Batched augmentation with per-sample random parameters, on GPU or CPU tensors alike."""

from gpufeed.augment.ops import (CenterCrop, ColorJitter, Normalize, RandomHorizontalFlip,
                                 RandomResizedCrop, Resize)
from gpufeed.augment.pipeline import Augment, Params

__all__ = [
    "Augment",
    "CenterCrop",
    "ColorJitter",
    "Normalize",
    "Params",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
]
