"""Batched augmentation with per-sample random parameters, on GPU or CPU tensors alike."""

from gpufeed.augment.affine import RandomAffine, RandomRotation
from gpufeed.augment.mix import CutMix, MixUp, MixUpOrCutMix
from gpufeed.augment.ops import (
    CenterCrop,
    ColorJitter,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RandomVerticalFlip,
    Resize,
)
from gpufeed.augment.params import Params
from gpufeed.augment.pipeline import Augment
from gpufeed.augment.pixel import (
    GaussianBlur,
    RandomAdjustSharpness,
    RandomAutocontrast,
    RandomEqualize,
    RandomErasing,
    RandomGrayscale,
    RandomInvert,
    RandomPosterize,
    RandomSolarize,
)
from gpufeed.augment.policies import AutoAugment, RandAugment, TrivialAugmentWide
from gpufeed.augment.schedule import ResolutionRamp

__all__ = [
    "Augment",
    "AutoAugment",
    "CenterCrop",
    "ColorJitter",
    "CutMix",
    "GaussianBlur",
    "MixUp",
    "MixUpOrCutMix",
    "Normalize",
    "Params",
    "RandAugment",
    "RandomAdjustSharpness",
    "RandomAffine",
    "RandomAutocontrast",
    "RandomCrop",
    "RandomEqualize",
    "RandomErasing",
    "RandomGrayscale",
    "RandomHorizontalFlip",
    "RandomInvert",
    "RandomPosterize",
    "RandomResizedCrop",
    "RandomRotation",
    "RandomSolarize",
    "RandomVerticalFlip",
    "ResolutionRamp",
    "Resize",
    "TrivialAugmentWide",
]
