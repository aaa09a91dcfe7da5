"""Vertical flips, RandomCrop with padding, RandomAffine and RandomRotation against torchvision
sample by sample with the same parameters, alone and composed with the box-pass ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import InterpolationMode as IM
from torchvision.transforms.v2 import functional as F

from gpufeed.augment import (Augment, CenterCrop, Normalize, RandomAffine, RandomCrop, RandomHorizontalFlip,
                             RandomResizedCrop, RandomRotation, RandomVerticalFlip, Resize)
from gpufeed.synth import natural_image

N, H, W = 8, 24, 28


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(2)
    return torch.from_numpy(np.stack([natural_image(rng, H, W, i) for i in range(N)]))  # NHWC uint8


def run(ops, batch, seed=0):
    aug = Augment(ops)
    params = aug.sample(len(batch), H, W, torch.Generator().manual_seed(seed))
    return params, aug.apply(batch, params, torch.float32) * 255


def draws(seed, *ranges):
    """The uniform draws the ops make first from the plan's generator, in their order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(N, dtype=torch.float64).uniform_(*r, generator=g) for r in ranges]


def chw(batch, k):
    return batch[k].permute(2, 0, 1)


@pytest.mark.parametrize("mode, fill", [("nearest", 0), ("nearest", (10, 200, 30)), ("bilinear", 0),
                                        ("bilinear", 90)])
def test_rotation_matches_torchvision(batch, mode, fill):
    _, out = run([RandomRotation(30, interpolation=mode, fill=fill)], batch)
    (angles,) = draws(0, (-30, 30))
    fill_ = list(fill) if isinstance(fill, tuple) else fill
    for k in range(N):
        want = F.rotate(chw(batch, k).float(), float(angles[k]), IM(mode), fill=fill_)
        assert (out[k] - want).abs().max() < 0.01, (k, (out[k] - want).abs().max())


def test_affine_matches_torchvision(batch):
    op = RandomAffine(20, translate=(0.1, 0.2), scale=(0.8, 1.2), shear=(-5, 10, -8, 4), fill=50)
    _, out = run([op], batch, seed=3)
    g = torch.Generator().manual_seed(3)
    u = lambda lo, hi: torch.empty(N, dtype=torch.float64).uniform_(lo, hi, generator=g)  # noqa: E731
    angle, tx, ty = u(-20, 20), torch.round(u(-0.1 * W, 0.1 * W)), torch.round(u(-0.2 * H, 0.2 * H))
    scale, shx, shy = u(0.8, 1.2), u(-5, 10), u(-8, 4)
    assert tx.abs().max() > 0 and ty.abs().max() > 0
    for k in range(N):
        want = F.affine(chw(batch, k), float(angle[k]), [int(tx[k]), int(ty[k])], float(scale[k]),
                        [float(shx[k]), float(shy[k])], IM.NEAREST, fill=50).float()
        differ = ((out[k] - want).abs() > 0.01).float().mean()
        assert differ < 0.01, (k, differ)  # nearest picks the other pixel only at exact ties


def test_random_crop_with_padding_is_exact(batch):
    params, out = run([RandomCrop((20, 26), padding=(3, 5), fill=(1, 2, 3)), RandomHorizontalFlip()], batch, seed=4)
    g = torch.Generator().manual_seed(4)
    u = torch.rand(N, 2, dtype=torch.float64, generator=g)
    top, left = torch.floor(u[:, 0] * (H + 10 - 20 + 1)), torch.floor(u[:, 1] * (W + 6 - 26 + 1))
    flips = torch.rand(N, generator=g) < 0.5
    assert out.shape == (N, 3, 20, 26) and params.warp is not None and 0 < flips.sum() < N
    for k in range(N):
        padded = F.pad(chw(batch, k), [3, 5, 3, 5], fill=[1, 2, 3])
        want = F.crop(padded, int(top[k]), int(left[k]), 20, 26).float()
        want = want.flip(-1) if flips[k] else want
        assert torch.equal(out[k].round(), want), k


def test_random_crop_without_padding_moves_only_the_box(batch):
    params, out = run([RandomCrop(16)], batch, seed=5)
    assert params.warp is None and out.shape == (N, 3, 16, 16)
    for k in range(N):
        x1, y1 = (int(v) for v in params.boxes[k, :2].tolist())
        assert torch.allclose(out[k], chw(batch, k)[:, y1:y1 + 16, x1:x1 + 16].float(), atol=1e-3)


def test_vertical_flip_then_crop_and_pad_if_needed(batch):
    params, out = run([RandomVerticalFlip(0.5), RandomHorizontalFlip(0.5), CenterCrop((20, 20))], batch, seed=6)
    g = torch.Generator().manual_seed(6)
    v, h = torch.rand(N, generator=g) < 0.5, torch.rand(N, generator=g) < 0.5
    assert 0 < v.sum() < N and params.warp is None
    for k in range(N):
        want = chw(batch, k).float()
        want = want.flip(-2) if v[k] else want
        want = want.flip(-1) if h[k] else want
        assert torch.allclose(out[k], F.center_crop(want, [20, 20]), atol=1e-3), k
    _, grown = run([RandomCrop(30, pad_if_needed=True)], batch, seed=9)
    u = torch.rand(N, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    top, left = torch.floor(u[:, 0] * (36 - 30 + 1)), torch.floor(u[:, 1] * (32 - 30 + 1))  # padded 6 and 2 a side
    for k in range(N):
        want = F.crop(F.pad(chw(batch, k), [2, 6, 2, 6]), int(top[k]), int(left[k]), 30, 30).float()
        assert torch.equal(grown[k].round(), want), k


def test_rotation_composes_with_crops_and_flips(batch):
    """Box pass (resize), warp (rotation), then a flip and a crop composed into the same warp."""
    ops = [Resize((24, 24)), RandomRotation((10, 40)), RandomVerticalFlip(1.0), CenterCrop(16)]
    params, out = run(ops, batch, seed=7)
    (angles,) = draws(7, (10, 40))
    resized = Augment([Resize((24, 24))])
    base = resized.apply(batch, resized.sample(N, H, W, torch.Generator()), torch.float32) * 255
    assert params.warp.sizes == [(24, 24)] and out.shape == (N, 3, 16, 16)
    for k in range(N):
        want = F.center_crop(F.rotate(base[k], float(angles[k]), IM.NEAREST, fill=0).flip(-2), [16, 16])
        assert ((out[k] - want).abs() > 0.01).float().mean() < 0.01, k


def test_warp_settings_must_agree_and_need_one_size():
    with pytest.raises(ValueError, match="agree on interpolation"):
        Augment([RandomRotation(10, interpolation="bilinear"), RandomAffine(5)]).sample(2, 8, 8, torch.Generator())
    Augment([RandomCrop(8, padding=2), RandomRotation(10)]).sample(2, 8, 8, torch.Generator())  # zero fills agree
    with pytest.raises(ValueError, match="one size"):
        Augment([Resize(8), RandomRotation(10)]).sample(2, torch.tensor([8, 9]), torch.tensor([10, 8]),
                                                          torch.Generator())
    with pytest.raises(ValueError, match="Padding mode should be either constant, edge, reflect or symmetric"):
        RandomCrop(8, padding=2, padding_mode="wrap")
    with pytest.raises(ValueError, match="must come before"):
        Augment([RandomRotation(10), RandomCrop(8, padding=2, padding_mode="edge")]).sample(2, 8, 8, torch.Generator())
    with pytest.raises(ValueError, match="expand"):
        RandomRotation(10, expand=True)


def test_normalized_output_and_reproducible(batch):
    ops = [RandomResizedCrop(20, scale=(0.5, 1)), RandomRotation(15, interpolation="bilinear"), Normalize()]
    a, out_a = run(ops, batch, seed=8)
    _, out_b = run(ops, batch, seed=8)
    assert torch.equal(out_a, out_b) and out_a.shape == (N, 3, 20, 20)


@pytest.mark.parametrize("mode", ["edge", "reflect", "symmetric"])
def test_random_crop_padding_modes_match_torchvision(batch, mode):
    ops = [RandomCrop((H, W), padding=(4, 6, 2, 5), padding_mode=mode), RandomRotation(0)]
    params, out = run(ops, batch, seed=10)
    u = torch.rand(N, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    top, left = torch.floor(u[:, 0] * (H + 11 - H + 1)), torch.floor(u[:, 1] * (W + 6 - W + 1))
    for k in range(N):
        padded = F.pad(chw(batch, k), [4, 6, 2, 5], padding_mode=mode)
        want = F.crop(padded, int(top[k]), int(left[k]), H, W).float()
        assert torch.equal(out[k].round(), want), (mode, k)


@pytest.mark.parametrize("ops", [
    [RandomResizedCrop(20, scale=(0.5, 1)), RandomVerticalFlip(), Normalize()],
    [RandomResizedCrop(20, scale=(0.5, 1)), RandomHorizontalFlip(), RandomRotation(20), Normalize()],
], ids=["flips-only", "warp"])
def test_the_gpu_tail_after_the_kernel_gives_the_cpu_batch(batch, ops):
    """What the raw and jpeg GPU paths do after their resampling kernel (`kernel_output`, `complete`),
    fed what the kernel writes, equals the CPU path; and the stream hand-over covers every tensor."""
    from torchvision.ops import roi_align

    aug = Augment(ops)
    params = aug.sample(N, H, W, torch.Generator().manual_seed(11))
    want = aug.apply(batch, params, torch.float32)
    out_dtype, channels_last, scale, shift = aug.kernel_output(params, torch.float32, False, torch.device("cpu"))
    y = roi_align(batch.permute(0, 3, 1, 2).float(), torch.cat([torch.arange(N)[:, None].float(), params.boxes], 1),
                  params.out_hw, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    y = torch.where(params.flip.view(-1, 1, 1, 1).bool(), y.flip(3), y)
    written = (y * scale.view(1, 3, 1, 1) + shift.view(1, 3, 1, 1)).to(out_dtype)  # the kernel's output
    assert torch.allclose(aug.complete(written, params, torch.float32, False), want, atol=1e-4)
    tensors = {id(t) for t in params.tensors()}
    assert id(params.boxes) in tensors and (params.vflip is None or id(params.vflip) in tensors)
    assert params.warp is None or id(params.warp.matrices) in tensors
