"""RandAugment, TrivialAugmentWide and AutoAugment: each op against torchvision's with the same
magnitude, the drawn ops and magnitudes against torchvision's distributions, the order of colour and
geometric ops within a sample, and the Loader (reproducible, resumable)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode as IM
from torchvision.transforms.v2 import functional as F

import gpufeed
from gpufeed.augment import Augment, AutoAugment, Normalize, RandAugment, RandomResizedCrop, TrivialAugmentWide
from gpufeed.augment.policies import AUTO_POLICIES, ID, IMAGENET, OPS, magnitudes
from gpufeed.synth import natural_image

N, H, W = 6, 24, 28


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    return torch.from_numpy(np.stack([natural_image(rng, H, W, i) for i in range(N)]))  # NHWC uint8


def torchvision_op(image: torch.Tensor, name: str, m: float) -> torch.Tensor:
    """What torchvision's policies do for op `name` at signed magnitude `m` (uint8 CHW)."""
    shear = math.degrees(math.atan(m))
    return {
        "Identity": lambda: image,
        "ShearX": lambda: F.affine(image, 0.0, [0, 0], 1.0, [shear, 0.0], IM.NEAREST, None, [0, 0]),
        "ShearY": lambda: F.affine(image, 0.0, [0, 0], 1.0, [0.0, shear], IM.NEAREST, None, [0, 0]),
        "TranslateX": lambda: F.affine(image, 0.0, [int(m), 0], 1.0, [0.0, 0.0], IM.NEAREST, None),
        "TranslateY": lambda: F.affine(image, 0.0, [0, int(m)], 1.0, [0.0, 0.0], IM.NEAREST, None),
        "Rotate": lambda: F.rotate(image, m, IM.NEAREST, fill=None),
        "Brightness": lambda: F.adjust_brightness(image, 1 + m),
        "Color": lambda: F.adjust_saturation(image, 1 + m),
        "Contrast": lambda: F.adjust_contrast(image, 1 + m),
        "Sharpness": lambda: F.adjust_sharpness(image, 1 + m),
        "Posterize": lambda: F.posterize(image, int(m)),
        "Solarize": lambda: F.solarize(image, 255 * m),
        "AutoContrast": lambda: F.autocontrast(image),
        "Equalize": lambda: F.equalize(image),
        "Invert": lambda: F.invert(image),
    }[name]()


class Forced(RandAugment):
    """RandAugment with each slot's op fixed (the magnitude and its sign still drawn)."""

    def __init__(self, names, magnitude=9, wide=False):
        super().__init__(num_ops=len(names), magnitude=magnitude)
        self.names, self.wide = names, wide

    def _choose(self, n, h, w, g):
        ops = torch.tensor([ID[name] for name in self.names]).repeat(n, 1)
        return ops, magnitudes(self.wide, self.num_magnitude_bins, h, w)[ops, self.magnitude]


def run(op, batch, seed=0):
    aug = Augment([op])
    params = aug.sample(len(batch), H, W, torch.Generator().manual_seed(seed))
    return params, aug.apply(batch, params, torch.float32) * 255


@pytest.mark.parametrize("name", OPS)
def test_each_op_matches_torchvision(batch, name):
    params, out = run(Forced([name], magnitude=12), batch)
    blends = ("Brightness", "Color", "Contrast")  # compared on float images: torchvision's uint8 path rounds its gray
    for k in range(N):
        m = float(params.pixel[k, 1])
        image = batch[k].permute(2, 0, 1)
        if name in blends:
            want = torchvision_op(image.float() / 255, name, m) * 255
        else:
            want = torchvision_op(image, name, m).float()
        diff = (out[k] - want).abs()
        if name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"):
            assert (diff > 0.01).float().mean() < 0.01, (name, k)  # nearest: the other pixel only at ties
        else:
            assert diff.max() <= (0.01 if name in blends else 1.0 + 1e-3), (name, k, diff.max())  # uint8 rounding


def test_signs_are_drawn_and_magnitudes_follow_the_bin(batch):
    params, _ = run(Forced(["Rotate"], magnitude=9), batch.repeat(20, 1, 1, 1))
    m = params.pixel[:, 1]
    assert torch.allclose(m.abs(), torch.full_like(m, 9.0)) and 0.3 < (m < 0).float().mean() < 0.7  # 30 * 9 / 30


def test_colour_then_turn_keeps_torchvisions_fill(batch):
    """Invert then Rotate: the corners stay black (filled after the colour op); Rotate then Invert:
    they turn white, as torchvision's order gives."""
    for names, corner in ((["Invert", "Rotate"], 0.0), (["Rotate", "Invert"], 255.0)):
        params, out = run(Forced(names, magnitude=30), batch)
        for k in range(N):
            want = batch[k].permute(2, 0, 1)
            for slot, name in enumerate(names):
                want = torchvision_op(want, name, float(params.pixel[k, 2 * slot + 1]))
            assert float(out[k, :, 0, 0].mean()) == corner
            assert ((out[k] - want.float()).abs() > 1.01).float().mean() < 0.01, (names, k)


def test_rand_augment_draws_like_torchvision():
    aug = Augment([RandAugment(num_ops=2, magnitude=9)])
    params = aug.sample(7000, 32, 32, torch.Generator().manual_seed(1))
    ops = params.choices.long()
    assert ops.shape == (7000, 2) and int(ops.max()) == ID["Equalize"]  # 14 ops: Invert is not in RandAugment
    counts = torch.bincount(ops.ravel(), minlength=len(OPS))[:14].float()
    assert float((counts / counts.mean() - 1).abs().max()) < 0.1  # uniform
    rotate = params.pixel[:, 1][ops[:, 0] == ID["Rotate"]]
    assert torch.allclose(rotate.abs(), torch.full_like(rotate, 9.0))


def test_trivial_augment_draws_bins_uniformly():
    aug = Augment([TrivialAugmentWide()])
    params = aug.sample(6000, 32, 32, torch.Generator().manual_seed(2))
    ops, m = params.choices[:, 0].long(), params.pixel[:, 1]
    rotate = m[ops == ID["Rotate"]].abs()
    bins = torch.round(rotate / (135.0 / 30)).long()
    assert len(rotate) > 300 and len(set(bins.tolist())) > 25 and float(rotate.max()) <= 135.0


def test_auto_augment_imagenet_probabilities():
    aug = Augment([AutoAugment()])
    params = aug.sample(20000, 32, 32, torch.Generator().manual_seed(3))
    ops = params.choices.long()
    expected = sum(p for pair in IMAGENET for op, p, _ in pair if op == "Equalize") / len(IMAGENET)
    rate = float((ops == ID["Equalize"]).sum()) / 20000
    assert abs(rate - expected) < 0.02 and expected > 0.4
    assert not bool((ops == ID["TranslateX"]).any())  # not in the ImageNet policy
    with pytest.raises(ValueError, match="not one of"):
        AutoAugment("mnist")


@pytest.mark.parametrize("name", ["imagenet", "cifar10", "svhn"])
def test_auto_augment_policies_are_torchvisions(name):
    from torchvision.transforms import AutoAugmentPolicy, v2

    theirs = [tuple(pair) for pair in v2.AutoAugment(AutoAugmentPolicy(name))._policies]
    assert list(AUTO_POLICIES[name]) == theirs
    ops = Augment([AutoAugment(AutoAugmentPolicy(name))]).sample(500, 32, 32, torch.Generator()).choices
    assert ops.shape == (500, 2)


def test_policy_position_is_checked():
    with pytest.raises(ValueError, match="at most one policy"):
        Augment([RandAugment(), RandomResizedCrop(8)])
    with pytest.raises(ValueError, match="at most one policy"):
        Augment([RandAugment(), TrivialAugmentWide()])


def test_loader_with_rand_augment_is_reproducible_and_resumable(tmp_path):
    rng = np.random.default_rng(4)
    folder = tmp_path / "images"
    for k in range(24):
        (folder / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(natural_image(rng, 24, 24, k)).save(folder / f"c{k % 2}" / f"{k}.png")
    gpufeed.pack(folder, tmp_path / "store", size=16)
    ops = [RandomResizedCrop(16, scale=(0.5, 1)), RandAugment(2, 9), Normalize()]
    make = lambda: gpufeed.Loader(tmp_path / "store", batch_size=8, device="cpu", seed=5, augment=ops)  # noqa: E731
    loader = make()
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    second = next(it)
    resumed = make()
    resumed.load_state_dict(state)
    again = next(iter(resumed))
    assert first[0].shape == (8, 3, 16, 16) and torch.equal(second[0], again[0])
    assert torch.equal(first[0], next(iter(make()))[0])
