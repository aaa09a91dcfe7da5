"""Colour and pixel ops and RandomErasing against torchvision, sample by sample with the same
parameters; their drawn parameters; and in the Loader's batches, with a callable of the user's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as F

import gpufeed
from gpufeed.synth import natural_image
from gpufeed.augment import (GaussianBlur, Normalize, RandomAdjustSharpness, RandomAutocontrast, RandomErasing,
                             RandomGrayscale, RandomHorizontalFlip, RandomInvert, RandomPosterize,
                             RandomResizedCrop, RandomSolarize)
from gpufeed.augment.pipeline import Augment


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(1)
    images = np.stack([natural_image(rng, 24, 28, i) for i in range(8)])
    return torch.from_numpy(images).permute(0, 3, 1, 2).float()  # NCHW 0..255, whole numbers


def _every(op, batch):
    """Apply `op` to the whole batch with every sample applying it (flag columns all 1)."""
    cols = torch.ones(len(batch), op.width)
    return op.apply(batch.clone(), cols), cols


@pytest.mark.parametrize("op, reference, tolerance", [
    (RandomGrayscale(), lambda u8: F.rgb_to_grayscale(u8.float() / 255, num_output_channels=3) * 255, 1e-4),
    (RandomSolarize(128), lambda u8: F.solarize(u8, 128).float(), 0),
    (RandomPosterize(3), lambda u8: F.posterize(u8, 3).float(), 0),
    (RandomInvert(), lambda u8: F.invert(u8).float(), 0),
    (RandomAutocontrast(), lambda u8: F.autocontrast(u8).float(), 1.0),  # torchvision truncates to uint8
    (RandomAdjustSharpness(2.0), lambda u8: F.adjust_sharpness(u8, 2.0).float(), 1.0),
    (RandomAdjustSharpness(0.3), lambda u8: F.adjust_sharpness(u8, 0.3).float(), 1.0),
])
def test_pixel_ops_match_torchvision(op, reference, tolerance, batch):
    got, _ = _every(op, batch)
    for k in range(len(batch)):
        want = reference(batch[k].to(torch.uint8))
        assert (got[k] - want).abs().max() <= tolerance + 1e-3, (op, k, (got[k] - want).abs().max())


def test_a_sample_that_draws_no_keeps_its_pixels(batch):
    op = RandomInvert(p=0.5)
    cols = op.draw(len(batch), (24, 28), torch.Generator().manual_seed(0))
    got = op.apply(batch.clone(), cols)
    for k in range(len(batch)):
        assert torch.equal(got[k], 255 - batch[k] if cols[k, 0] else batch[k])
    assert 0 < cols.sum() < len(batch)


def test_gaussian_blur_matches_torchvision_per_sample_sigma(batch):
    op = GaussianBlur(5, sigma=(0.3, 2.0))
    sigmas = op.draw(len(batch), (24, 28), torch.Generator().manual_seed(3))
    assert len(set(sigmas[:, 0].tolist())) == len(batch) and bool(((sigmas >= 0.3) & (sigmas <= 2.0)).all())
    got = op.apply(batch.clone(), sigmas)
    for k in range(len(batch)):
        s = float(sigmas[k, 0])
        want = F.gaussian_blur(batch[k] / 255, [5, 5], [s, s]) * 255
        assert (got[k] - want).abs().max() < 1e-3, k


def test_random_erasing_matches_torchvision_and_draws_like_it(batch):
    op = RandomErasing(p=0.75, value=(0.5, -1.0, 2.0))
    boxes = op.draw(4000, (24, 28), torch.Generator().manual_seed(5))
    erased = boxes[:, 2] > 0
    assert 0.70 < erased.float().mean() < 0.80  # p, less the rare draws where no attempt fits
    area = (boxes[erased, 2] * boxes[erased, 3]) / (24 * 28)
    assert float(area.min()) >= 0.01 and float(area.max()) <= 0.36  # scale (0.02, 0.33), rounded sides
    assert bool((boxes[erased, 0] + boxes[erased, 2] <= 24).all() and (boxes[erased, 1] + boxes[erased, 3] <= 28).all())
    cols = boxes[: len(batch)]
    got = op.apply(batch.clone(), cols)
    value = torch.tensor([0.5, -1.0, 2.0]).view(3, 1, 1)
    for k in range(len(batch)):
        i, j, h, w = (int(v) for v in cols[k].tolist())
        want = F.erase(batch[k], i, j, h, w, value) if h else batch[k]
        assert torch.equal(got[k], want), k


def test_random_erasing_with_noise_is_normal_inside_and_replayed_from_the_plan():
    aug = Augment([RandomErasing(p=1.0, scale=(0.3, 0.33), value="random")])
    params = aug.sample(8, 64, 64, torch.Generator().manual_seed(4))
    assert params.seeds is not None and len(set(params.seeds.tolist())) == 8
    images = torch.full((8, 64, 64, 3), 128, dtype=torch.uint8)
    out = aug.apply(images, params, torch.float32)
    again = aug.apply(images, params, torch.float32)
    assert torch.equal(out, again)  # the same batch, the same noise
    erased = out != 128 / 255
    noise = out[erased]
    assert 0.28 < erased.float().mean() < 0.36 and abs(float(noise.mean())) < 0.05 and 0.9 < float(noise.std()) < 1.1
    other = aug.apply(images[:7], params.rows(1, 8, False), torch.float32)  # another batch: its own noise
    assert not torch.equal(other[0], out[1])
    with pytest.raises(ValueError, match="'random'"):
        RandomErasing(value="noise")


def test_ops_in_a_chain_and_in_the_loader_with_a_callable_of_the_users(tmp_path):
    from PIL import Image

    (tmp_path / "src").mkdir()  # the store goes beside its source, not inside it
    for i in range(12):
        Image.fromarray(natural_image(np.random.default_rng(i), 40, 48, i)).save(tmp_path / "src" / f"{i}.png")
    gpufeed.pack(tmp_path / "src", tmp_path / "s", size=32, workers=1, progress=False)
    seen = []

    def mine(images: torch.Tensor) -> torch.Tensor:  # e.g. a torchvision v2 transform on the batch
        seen.append(images.shape)
        return images * 2

    ops = [RandomResizedCrop(16), RandomHorizontalFlip(), RandomGrayscale(p=1.0), RandomSolarize(100, p=0.5),
           GaussianBlur(3), Normalize(), RandomErasing(p=1.0, value=7.0), mine]
    loader = gpufeed.Loader(tmp_path / "s", batch_size=4, device="cpu", dtype=torch.float32, augment=ops, seed=2)
    images, _ = next(iter(loader))
    assert images.shape == (4, 3, 16, 16) and seen == [(4, 3, 16, 16)]
    assert bool((images == 14.0).any(dim=(1, 2, 3)).all())  # every sample erased to 7, then doubled
    gray = images[:, 0] != 14.0
    assert torch.allclose((images[:, 0] / 2 * 0.229 + 0.485)[gray], (images[:, 1] / 2 * 0.224 + 0.456)[gray],
                          atol=1e-4)  # grayscale: the channels agree before Normalize
    again = gpufeed.Loader(tmp_path / "s", batch_size=4, device="cpu", dtype=torch.float32, augment=ops, seed=2)
    assert torch.equal(next(iter(again))[0], images)  # drawn from the seed: reproducible
    p0, p1 = loader.plan(0, 0)[1].pixel, again.plan(0, 0)[1].pixel
    assert p0.shape == (4, 1 + 1 + 1 + 4) and torch.equal(p0, p1)


def test_equalize_matches_torchvision(batch):
    from gpufeed.augment import RandomEqualize

    flat = batch.clone()
    flat[3] = 77.0  # one value only: left as it is
    got, _ = _every(RandomEqualize(), flat)
    for k in range(len(flat)):
        assert torch.equal(got[k], F.equalize(flat[k].to(torch.uint8)).float()), k


def test_hue_jitter_matches_torchvision_per_sample(batch):
    from gpufeed.augment import ColorJitter

    op = ColorJitter(brightness=0.3, hue=0.4)
    factors = op.draw(len(batch), (24, 28), torch.Generator().manual_seed(7))
    assert factors.shape == (8, 4) and bool((factors[:, 3].abs() <= 0.4).all()) and len(set(factors[:, 3].tolist())) == 8
    got = op.apply(batch.clone(), factors)
    for k in range(len(batch)):
        b, _, _, h = factors[k].tolist()
        want = F.adjust_hue(F.adjust_brightness(batch[k] / 255, b), h) * 255
        assert (got[k] - want).abs().max() < 1e-2, k
    with pytest.raises(ValueError, match=r"hue values should be between \(-0.5, 0.5\)"):
        ColorJitter(hue=0.7)


def test_a_torchvision_v2_transform_as_the_users_op(tmp_path):
    from itertools import permutations

    from PIL import Image
    from torchvision.transforms import v2

    (tmp_path / "src").mkdir()  # the store goes beside its source, not inside it
    for i in range(8):
        Image.fromarray(natural_image(np.random.default_rng(i), 40, 48, i)).save(tmp_path / "src" / f"{i}.png")
    gpufeed.pack(tmp_path / "src", tmp_path / "s", size=32, workers=1, progress=False)
    ops = [RandomResizedCrop(16), RandomHorizontalFlip(), Normalize()]
    make = lambda extra: gpufeed.Loader(tmp_path / "s", batch_size=4, device="cpu", dtype=torch.float32,  # noqa: E731
                                        augment=ops + extra, seed=4)
    plain, images = next(iter(make([])))[0], None
    torch.manual_seed(0)
    for _ in range(5):  # v2 draws one permutation per call, from torch's global generator
        images = next(iter(make([v2.RandomChannelPermutation()])))[0]
        if not torch.equal(images, plain):
            break
    assert images.shape == plain.shape and not torch.equal(images, plain)
    assert any(torch.equal(images, plain[:, list(p)]) for p in permutations(range(3)))
