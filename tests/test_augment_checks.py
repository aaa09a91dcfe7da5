"""Every augment op refuses a bad parameter when it is made, with torchvision's wording where it has one,
instead of failing at the first batch in a kernel or giving inf, NaN or empty batches; valid edge
values still construct and run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpufeed.augment import (Augment, AutoAugment, CenterCrop, ColorJitter, CutMix, GaussianBlur, MixUp,
                             MixUpOrCutMix, Normalize, RandAugment, RandomAdjustSharpness, RandomAffine,
                             RandomAutocontrast, RandomCrop, RandomEqualize, RandomErasing, RandomGrayscale,
                             RandomHorizontalFlip, RandomInvert, RandomPosterize, RandomResizedCrop, RandomRotation,
                             RandomSolarize, RandomVerticalFlip, Resize, TrivialAugmentWide)

NAN, INF = float("nan"), float("inf")
P = "`p` should be a floating point value in the interval [0.0, 1.0]"
SIZE = "size values should be positive"

BAD = [
    # sizes: positive ints, one or two of them, within the bound
    (lambda: RandomResizedCrop(-5), ValueError, SIZE),
    (lambda: RandomResizedCrop((32, -1)), ValueError, SIZE),
    (lambda: RandomResizedCrop(0), ValueError, SIZE),
    (lambda: RandomResizedCrop(224.5), TypeError, "size should be an int or a sequence of 1 or 2 ints"),
    (lambda: RandomResizedCrop(True), TypeError, "size should be an int"),
    (lambda: RandomResizedCrop((224, 224, 3)), ValueError, "Please provide only two dimensions (h, w) for size"),
    (lambda: RandomResizedCrop(100000), ValueError, "32768 pixels a side"),
    (lambda: RandomResizedCrop((20000, 20000)), ValueError, "268435456 pixels an image"),
    (lambda: Resize(0), ValueError, SIZE),
    (lambda: Resize("224"), TypeError, "size should be an int"),
    (lambda: CenterCrop([]), ValueError, "Please provide only two dimensions"),
    (lambda: RandomCrop((8, 0)), ValueError, SIZE),
    # scale and ratio: (min, max), in range
    (lambda: RandomResizedCrop(8, scale=(0.5, 0.1)), ValueError, "scale should be of kind (min, max)"),
    (lambda: RandomResizedCrop(8, scale=0.5), TypeError, "scale should be a sequence of two floats"),
    (lambda: RandomResizedCrop(8, scale=(-0.1, 1)), ValueError, "scale values should be non-negative"),
    (lambda: RandomResizedCrop(8, ratio=(0, 1)), ValueError, "ratio values should be positive"),
    (lambda: RandomResizedCrop(8, ratio=(4 / 3, 3 / 4)), ValueError, "ratio should be of kind (min, max)"),
    (lambda: RandomResizedCrop(8, scale=(0.1, NAN)), ValueError, "finite"),
    (lambda: RandomResizedCrop(8, attempts=0), ValueError, "attempts should be a positive int"),
    # probabilities
    (lambda: RandomHorizontalFlip(p=1.5), ValueError, P),
    (lambda: RandomVerticalFlip(p=-0.1), ValueError, P),
    (lambda: RandomVerticalFlip(p=NAN), ValueError, P),
    (lambda: RandomHorizontalFlip(p="0.5"), TypeError, "`p` should be a number"),
    (lambda: RandomErasing(p=2), ValueError, P),
    (lambda: RandomGrayscale(p=2), ValueError, P),
    (lambda: RandomInvert(p=-1), ValueError, P),
    (lambda: RandomAutocontrast(p=1.01), ValueError, P),
    (lambda: RandomEqualize(p=INF), ValueError, P),
    (lambda: RandomSolarize(128, p=1.1), ValueError, P),
    (lambda: RandomPosterize(4, p=-0.5), ValueError, P),
    (lambda: RandomAdjustSharpness(2, p=3), ValueError, P),
    # RandomCrop's padding, fill and padding_mode
    (lambda: RandomCrop(8, padding=2.5), ValueError, "Padding must be an int or a 1, 2, or 4 element of tuple or list"),
    (lambda: RandomCrop(8, padding=(1, 2, 3)), ValueError, "Padding must be an int or a 1, 2, or 4 element"),
    (lambda: RandomCrop(8, padding=-1), ValueError, "padding should be non-negative"),
    (lambda: RandomCrop(8, padding_mode="wrap"), ValueError, "Padding mode should be either constant, edge, reflect"),
    (lambda: RandomCrop(8, padding=2, fill=(1, 2)), ValueError, "fill should be one value or one per channel (3)"),
    (lambda: RandomCrop(8, padding=2, fill="red"), TypeError, "Got inappropriate fill arg"),
    (lambda: RandomCrop(8, padding=2, fill=NAN), ValueError, "finite"),
    # Normalize
    (lambda: Normalize(mean=(0.5, 0.5)), ValueError, "mean should be one value or one per channel (3)"),
    (lambda: Normalize(std=0), ValueError, "std evaluated to zero, leading to division by zero"),
    (lambda: Normalize(std=(0.2, 0.0, 0.2)), ValueError, "std evaluated to zero"),
    (lambda: Normalize(std=(0.2, -0.2, 0.2)), ValueError, "std values should be positive"),
    (lambda: Normalize(mean=(0.5, NAN, 0.5)), ValueError, "finite"),
    (lambda: Normalize(mean="abc"), TypeError, "mean should be a number or a sequence of numbers"),
    # ColorJitter: torchvision's _check_input
    (lambda: ColorJitter(brightness=-1), ValueError, "If brightness is a single number, it must be non negative"),
    (lambda: ColorJitter(hue=-0.1), ValueError, "If hue is a single number, it must be non negative"),
    (lambda: ColorJitter(hue=0.7), ValueError, "hue values should be between (-0.5, 0.5) and increasing"),
    (lambda: ColorJitter(contrast=(1.5, 0.5)), ValueError, "contrast values should be between (0, inf) and increasing"),
    (lambda: ColorJitter(saturation=(-1, 1)), ValueError, "saturation values should be between (0, inf)"),
    (lambda: ColorJitter(saturation=(1, 2, 3)), TypeError, "should be a single number or a sequence with length 2"),
    (lambda: ColorJitter(brightness=INF), ValueError, "finite"),
    (lambda: ColorJitter(brightness=NAN), ValueError, "finite"),
    # RandomRotation and RandomAffine: torchvision's _setup_angle and sequence checks
    (lambda: RandomRotation(NAN), ValueError, "finite"),
    (lambda: RandomRotation(-10), ValueError, "If degrees is a single number, it must be positive"),
    (lambda: RandomRotation((10, -10)), ValueError, "degrees should be of kind (min, max)"),
    (lambda: RandomRotation((1, 2, 3)), ValueError, "degrees should be a sequence of length 2"),
    (lambda: RandomRotation("10"), TypeError, "degrees should be a sequence of length 2"),
    (lambda: RandomRotation(10, center=(1,)), ValueError, "center should be a sequence of length 2"),
    (lambda: RandomRotation(10, interpolation="bicubic"), ValueError, "interpolation must be 'nearest' or 'bilinear'"),
    (lambda: RandomRotation(10, fill=(1, 2)), ValueError, "fill should be one value or one per channel"),
    (lambda: RandomAffine(0, translate=(0.5, 1.5)), ValueError, "translation values should be between 0 and 1"),
    (lambda: RandomAffine(0, translate=0.1), TypeError, "translate should be a sequence of length 2"),
    (lambda: RandomAffine(0, scale=(0, 1)), ValueError, "scale values should be positive"),
    (lambda: RandomAffine(0, scale=(1.2, 0.8)), ValueError, "scale should be of kind (min, max)"),
    (lambda: RandomAffine(0, shear=(1, 2, 3)), ValueError, "shear should be a sequence of length 2 or 4"),
    (lambda: RandomAffine(0, shear=(0, 0, 10, -10)), ValueError, "shear should be of kind (min, max)"),
    (lambda: RandomAffine(0, shear=-5), ValueError, "If shear is a single number, it must be positive"),
    (lambda: RandomAffine(INF), ValueError, "finite"),
    (lambda: RandomAffine(0, fill="x"), TypeError, "Got inappropriate fill arg"),
    # pixel ops
    (lambda: GaussianBlur(4), ValueError, "Kernel size value should be an odd and positive number"),
    (lambda: GaussianBlur(-3), ValueError, "Kernel size value should be an odd and positive number"),
    (lambda: GaussianBlur((3, 3, 3)), ValueError, "Kernel size should be a tuple/list of two integers"),
    (lambda: GaussianBlur(3.0), TypeError, "kernel_size should be an int"),
    (lambda: GaussianBlur(3, sigma=0), ValueError, "sigma values should be positive and of the form (min, max)"),
    (lambda: GaussianBlur(3, sigma=(2, 1)), ValueError, "sigma values should be positive and of the form (min, max)"),
    (lambda: GaussianBlur(3, sigma=(1, 2, 3)), ValueError, "If sigma is a sequence its length should be 1 or 2"),
    (lambda: GaussianBlur(3, sigma="1"), TypeError, "sigma should be a number or a sequence of numbers"),
    (lambda: RandomPosterize(9), ValueError, "bits must be a positive integer in the range [0, 8]"),
    (lambda: RandomPosterize(4.5), TypeError, "bits must be a positive integer in the range [0, 8]"),
    (lambda: RandomSolarize(NAN), ValueError, "finite"),
    (lambda: RandomAdjustSharpness(-1), ValueError, "sharpness_factor (-1) is not non-negative"),
    # RandomErasing
    (lambda: RandomErasing(scale=(0.5, 0.1)), ValueError, "scale should be of kind (min, max)"),
    (lambda: RandomErasing(scale=(0.1, 1.5)), ValueError, "Scale should be between 0 and 1"),
    (lambda: RandomErasing(scale=0.1), TypeError, "scale should be a sequence of two floats"),
    (lambda: RandomErasing(ratio=(0, 1)), ValueError, "ratio values should be positive"),
    (lambda: RandomErasing(value=(1, 2)), ValueError, "value should be one value or one per channel (3)"),
    (lambda: RandomErasing(value="x"), ValueError, "If value is str, it should be 'random'"),
    (lambda: RandomErasing(value=object()), TypeError, "Argument value should be either a number or str or a sequence"),
    (lambda: RandomErasing(attempts=0), ValueError, "attempts should be a positive int"),
    # policies
    (lambda: RandAugment(num_ops=-1), ValueError, "num_ops >= 0"),
    (lambda: RandAugment(magnitude=31), ValueError, "0 <= magnitude < num_magnitude_bins"),
    (lambda: RandAugment(magnitude=2.5), TypeError, "magnitude should be an int"),
    (lambda: RandAugment(num_magnitude_bins=1), ValueError, "num_magnitude_bins should be at least 2"),
    (lambda: RandAugment(interpolation="bicubic"), ValueError, "interpolation must be 'nearest' or 'bilinear'"),
    (lambda: RandAugment(fill=(1, 2)), ValueError, "fill should be one value or one per channel"),
    (lambda: TrivialAugmentWide(num_magnitude_bins=0), ValueError, "num_magnitude_bins should be at least 2"),
    (lambda: TrivialAugmentWide(interpolation="cubic"), ValueError, "interpolation must be"),
    (lambda: AutoAugment(fill="x"), TypeError, "Got inappropriate fill arg"),
    (lambda: AutoAugment("cifar"), ValueError, "not one of"),
    # batch ops
    (lambda: MixUp(0), ValueError, "num_classes should be a positive int"),
    (lambda: CutMix(2.5), TypeError, "num_classes should be an int"),
    (lambda: MixUp(10, alpha=0), ValueError, "alpha should be positive"),
    (lambda: CutMix(10, alpha=-1), ValueError, "alpha should be positive"),
    (lambda: MixUp(10, alpha=NAN), ValueError, "finite"),
    (lambda: MixUp(10, label_smoothing=1.5), ValueError, "label_smoothing must be between 0.0 and 1.0"),
    (lambda: MixUpOrCutMix(10, switch_prob=2), ValueError, "`switch_prob` should be a floating point value"),
    (lambda: MixUpOrCutMix(10, cutmix_alpha=0), ValueError, "cutmix_alpha should be positive"),
    (lambda: MixUpOrCutMix(10, mixup_alpha=-1), ValueError, "mixup_alpha should be positive"),
    (lambda: MixUpOrCutMix(10, label_smoothing=-0.1), ValueError, "label_smoothing must be between 0.0 and 1.0"),
    (lambda: MixUpOrCutMix(-3), ValueError, "num_classes should be a positive int"),
]


@pytest.mark.parametrize("make, error, fragment", BAD, ids=range(len(BAD)))
def test_bad_parameters_are_refused_when_the_op_is_made(make, error, fragment):
    with pytest.raises(error) as caught:
        make()
    assert fragment in str(caught.value)
    assert type(caught.value) is error  # not a subclass nor a torch error


GOOD = [
    lambda: RandomHorizontalFlip(p=0), lambda: RandomHorizontalFlip(p=1), lambda: RandomVerticalFlip(0.0),
    lambda: RandomResizedCrop(8, scale=(1, 1), ratio=(1, 1)), lambda: RandomResizedCrop(8, scale=(0, 1)),
    lambda: RandomResizedCrop(np.int64(8)), lambda: RandomResizedCrop(2**14, attempts=1),
    lambda: RandomResizedCrop(8, scale=(0.5, 2)), lambda: CenterCrop(1), lambda: RandomCrop([8]),
    lambda: RandomCrop(8, padding=[1, 2]), lambda: RandomCrop(8, padding=(1, 2, 3, 4), fill=(1, 2, 3),
                                                              padding_mode="reflect"),
    lambda: Resize((8, 6)), lambda: Normalize(0.5, 0.5), lambda: Normalize(torch.tensor([0.5, 0.4, 0.3]), [0.2]),
    lambda: ColorJitter(0, 0, 0, 0), lambda: ColorJitter(brightness=2, hue=0.5),
    lambda: ColorJitter(brightness=(0.5, 1.5), contrast=[1, 1], hue=(-0.5, 0.5)),
    lambda: RandomRotation(0), lambda: RandomRotation([5, 5], center=(1, 2), fill=(1, 2, 3)),
    lambda: RandomAffine(0, translate=(0, 1), scale=(1, 1), shear=(0, 0, -5, 5), fill=None),
    lambda: GaussianBlur(1, sigma=0.1), lambda: GaussianBlur([3, 5], sigma=[0.5]), lambda: GaussianBlur([3]),
    lambda: RandomPosterize(0), lambda: RandomPosterize(8, p=1), lambda: RandomSolarize(0, p=0),
    lambda: RandomAdjustSharpness(0), lambda: RandomErasing(p=1, scale=(0, 1), value="random"),
    lambda: RandomErasing(value=(0.1, 0.2, 0.3)), lambda: RandomErasing(value=[1]),
    lambda: RandAugment(num_ops=0, magnitude=0), lambda: RandAugment(magnitude=30, fill=128),
    lambda: TrivialAugmentWide(num_magnitude_bins=2), lambda: AutoAugment("cifar10", "bilinear", (1, 2, 3)),
    lambda: MixUp(1), lambda: CutMix(10, alpha=0.1, label_smoothing=1.0),
    lambda: MixUpOrCutMix(10, switch_prob=0), lambda: MixUpOrCutMix(10, switch_prob=1, label_smoothing=0),
]


@pytest.mark.parametrize("make", GOOD, ids=range(len(GOOD)))
def test_valid_edge_values_still_construct(make):
    make()


def test_sizes_and_channels_are_normalised_as_torchvision_reads_them():
    assert RandomResizedCrop([8]).size == (8, 8) and RandomResizedCrop([8, 6]).size == (8, 6)
    assert Resize([8]).size == 8  # one value in a list: the shorter side, as torchvision
    assert type(RandomResizedCrop(np.int64(8)).size) is int
    n = Normalize(0.5, [0.25])
    assert n.mean == (0.5, 0.5, 0.5) and n.std == (0.25, 0.25, 0.25)
    assert GaussianBlur([3])._ks == (3, 3)


def test_edge_values_give_finite_batches_of_the_asked_size():
    x = torch.arange(2 * 16 * 16 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, 16, 16, 3)
    aug = Augment([RandomResizedCrop([8], scale=(1, 1)), RandomHorizontalFlip(1), ColorJitter((0.5, 1.5), hue=(-0.1, 0.1)),
                   Normalize(0.5, [0.25]), RandomErasing(p=1, value=[0])])
    out = aug.apply(x, aug.sample(2, 16, 16, torch.Generator().manual_seed(0)))
    assert out.shape == (2, 3, 8, 8) and bool(torch.isfinite(out).all())
