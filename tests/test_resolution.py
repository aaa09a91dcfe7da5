"""Resolution schedules: each epoch's augment chain at the size the schedule gives (FFCV's
progressive resizing), the same sizes and pixels after a resume."""

from __future__ import annotations

import pytest
import torch

import gpufeed
from gpufeed.augment import (
    Augment,
    CenterCrop,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ResolutionRamp,
    Resize,
)
from loader_checks import make_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("res"), n=48, side=32)


def test_a_ramp_rises_from_low_to_high_in_multiples():
    ramp = ResolutionRamp(160, 192, 10, 13)  # FFCV's ImageNet recipe, in multiples of 32
    assert [ramp(e) for e in (0, 10, 11, 12, 13, 40)] == [160, 160, 160, 192, 192, 192]
    assert [ResolutionRamp(16, 24, 0, 2, multiple=4)(e) for e in range(4)] == [16, 20, 24, 24]
    with pytest.raises(ValueError, match="start <= end"):
        ResolutionRamp(16, 24, 3, 2)
    with pytest.raises(TypeError):
        ResolutionRamp(16.5, 24, 0, 2)


def test_a_chain_at_another_size_scales_its_sizes():
    ops = Augment([Resize(256), CenterCrop(224), Normalize()]).at_size((160, 160)).ops
    assert ops[0] == Resize(183) and ops[1] == CenterCrop((160, 160)) and isinstance(ops[2], Normalize)
    crop = Augment([RandomResizedCrop(224, scale=(0.3, 1)), RandomHorizontalFlip()]).at_size((128, 96)).ops[0]
    assert crop.size == (128, 96) and crop.scale == (0.3, 1)
    with pytest.raises(ValueError, match="needs an op that fixes the output size"):
        Augment([Resize(64), Normalize()]).at_size((32, 32))


def test_each_epoch_comes_at_its_size_and_a_resume_keeps_it(store):
    ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip(), Normalize()]
    kw = dict(batch_size=8, device="cpu", augment=ops, seed=3, dtype=torch.float32,
              resolution=ResolutionRamp(16, 24, 0, 2, multiple=4))
    loader = gpufeed.Loader(store, **kw)
    sides = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        shapes = {tuple(images.shape[2:]) for images, _ in loader}
        sides.append(shapes)
    assert sides == [{(16, 16)}, {(20, 20)}, {(24, 24)}]
    # a job stopped after two batches of epoch 1 and resumed elsewhere goes on at 20 px, with the same pixels
    loader.set_epoch(1)
    whole = [images for images, _ in loader]
    loader.set_epoch(1)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    resumed = gpufeed.Loader(store, **kw)
    resumed.load_state_dict(state)
    rest = [images for images, _ in resumed]
    assert len(rest) == len(whole) - 2 and all(torch.equal(a, b) for a, b in zip(rest, whole[2:], strict=True))


def test_a_schedule_needs_a_chain_that_fixes_the_size(store):
    with pytest.raises(ValueError, match="needs an op that fixes the output size"):
        gpufeed.Loader(store, batch_size=8, device="cpu", augment=[Resize(20)], resolution=lambda e: 16)
    with pytest.raises(ValueError, match="returned 0.5"):
        gpufeed.Loader(store, batch_size=8, device="cpu", augment=[CenterCrop(20)], resolution=lambda e: 0.5)
    with pytest.raises(ValueError, match="resolution is a schedule"):
        gpufeed.Loader(store, batch_size=8, device="cpu", resolution=lambda e: 16)
