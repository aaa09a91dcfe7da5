"""MixUp, CutMix and timm's switch between them: formulas, draws, and as the Loader's last op."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.augment import CutMix, MixUp, MixUpOrCutMix, Normalize, RandomResizedCrop, mix
from gpufeed.synth import natural_image


@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.rand(6, 3, 10, 12), torch.tensor([0, 1, 2, 3, 1, 0])


def test_mixup_is_the_weighted_sum_with_the_rolled_batch(batch, monkeypatch):
    images, labels = batch
    monkeypatch.setattr(mix, "_beta", lambda alpha, g: 0.3)
    out, targets = MixUp(num_classes=4, label_smoothing=0.2)(images, labels)
    assert torch.allclose(out, 0.3 * images + 0.7 * images.roll(1, 0))
    smooth = torch.full((6, 4), 0.05).scatter_(1, labels.view(-1, 1), 0.85)
    assert torch.allclose(targets, 0.3 * smooth + 0.7 * smooth.roll(1, 0))
    assert torch.allclose(targets.sum(1), torch.ones(6))


def test_cutmix_pastes_a_box_and_mixes_targets_by_its_area(batch):
    images, labels = batch
    g = torch.Generator().manual_seed(4)
    out, targets = CutMix(num_classes=4)(images, labels, g)
    pasted = (out != images).any(1)[0]  # the box, where rolled pixels differ
    ys, xs = pasted.nonzero(as_tuple=True)
    y1, y2, x1, x2 = int(ys.min()), int(ys.max()) + 1, int(xs.min()), int(xs.max()) + 1
    assert torch.equal(out[..., y1:y2, x1:x2], images.roll(1, 0)[..., y1:y2, x1:x2])
    kept = 1 - (y2 - y1) * (x2 - x1) / (10 * 12)
    one_hot = torch.nn.functional.one_hot(labels, 4).float()
    assert torch.allclose(targets, kept * one_hot + (1 - kept) * one_hot.roll(1, 0))


def test_draws_follow_beta_and_the_switch_probability():
    g = torch.Generator().manual_seed(0)
    lams = torch.tensor([mix._beta(0.8, g) for _ in range(4000)])
    assert abs(float(lams.mean()) - 0.5) < 0.02 and abs(float(lams.var()) - 1 / (4 * 2.6)) < 0.01
    images, labels = torch.rand(4, 3, 16, 16), torch.tensor([0, 1, 0, 1])
    op = MixUpOrCutMix(num_classes=2, switch_prob=0.25, seed=1)
    cut = 0
    for _ in range(400):
        out, _ = op(images, labels)
        inside = (out == images).all(1) | (out == images.roll(1, 0)).all(1)  # CutMix: each pixel one or other
        cut += bool(inside.all())
    assert 0.18 < cut / 400 < 0.32


def test_unlabelled_samples_are_refused_clearly(batch):
    with pytest.raises(ValueError, match=r"labels in 0..3.*-1: a sample without a label"):
        MixUp(num_classes=4)(batch[0], torch.tensor([0, 1, -1, 2, 0, 1]))


def test_as_the_loaders_last_op_reproducible_and_resumable(tmp_path):
    from PIL import Image

    for c in range(2):
        for i in range(6):
            (tmp_path / "src" / f"c{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(natural_image(np.random.default_rng(i), 24, 24, i + c)).save(tmp_path / "src" / f"c{c}" / f"{i}.png")
    gpufeed.pack(tmp_path / "src", tmp_path / "s", size=24, workers=1, progress=False)
    make = lambda: gpufeed.Loader(tmp_path / "s", batch_size=4, device="cpu", dtype=torch.float32, seed=3,  # noqa: E731
                                  augment=[RandomResizedCrop(16), Normalize(), MixUpOrCutMix(num_classes=2)])
    first = list(make())
    assert len(first) == 3 and all(t.shape == (4, 2) and torch.allclose(t.sum(1), torch.ones(4)) for _, t in first)
    assert any(not torch.equal(t, t.round()) for _, t in first)  # soft targets
    again = list(make())
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first[1:], rest, strict=True))
    with pytest.raises(ValueError, match="at most one of MixUp"):
        gpufeed.Loader(tmp_path / "s", batch_size=4, device="cpu",
                       augment=[RandomResizedCrop(16), MixUp(2), CutMix(2)])


def test_a_store_whose_labels_do_not_fit_is_refused_when_the_loader_is_built(tmp_path):
    from PIL import Image

    for i in range(4):
        (tmp_path / "src").mkdir(exist_ok=True)
        Image.fromarray(natural_image(np.random.default_rng(i), 24, 24, i)).save(tmp_path / "src" / f"{i}.png")
    gpufeed.pack(tmp_path / "src", tmp_path / "s", size=16, workers=1, progress=False)  # flat folder: labels -1
    with pytest.raises(ValueError, match=r"MixUp\(num_classes=3\) needs labels in 0..2; the store's are -1..-1"):
        gpufeed.Loader(tmp_path / "s", batch_size=2, device="cpu", augment=[RandomResizedCrop(8), MixUp(3)])
