"""Batched augmentation with per-sample random parameters, on GPU or CPU tensors alike."""

from gpufeed.augment.ops import (CenterCrop, ColorJitter, Normalize, RandomHorizontalFlip,
                                 RandomResizedCrop, Resize)
from gpufeed.augment.mix import CutMix, MixUp, MixUpOrCutMix
from gpufeed.augment.pipeline import Augment, Params
from gpufeed.augment.pixel import (GaussianBlur, RandomAdjustSharpness, RandomAutocontrast, RandomEqualize,
                                   RandomErasing, RandomGrayscale, RandomInvert, RandomPosterize, RandomSolarize)

__all__ = [
    "Augment",
    "CenterCrop",
    "ColorJitter",
    "CutMix",
    "GaussianBlur",
    "MixUp",
    "MixUpOrCutMix",
    "Normalize",
    "Params",
    "RandomAdjustSharpness",
    "RandomAutocontrast",
    "RandomEqualize",
    "RandomErasing",
    "RandomGrayscale",
    "RandomHorizontalFlip",
    "RandomInvert",
    "RandomPosterize",
    "RandomResizedCrop",
    "RandomSolarize",
    "Resize",
]
