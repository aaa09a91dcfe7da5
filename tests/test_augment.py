"""Batched augmentation matches torchvision sample by sample, within the stated tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as F

from gpufeed import nn as gnn
from gpufeed.augment import (Augment, CenterCrop, ColorJitter, Normalize, RandomHorizontalFlip,
                             RandomResizedCrop, Resize)
from gpufeed.synth import natural_image

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return torch.from_numpy(np.stack([natural_image(rng, 64, 64, i) for i in range(12)]))


def reference(x, box, flip, out_hw):
    left, top, right, bottom = (int(round(v)) for v in box.tolist())
    ref = F.resized_crop(x.permute(2, 0, 1).float(), top, left, bottom - top, right - left, list(out_hw),
                         antialias=True)
    return ref.flip(-1) if flip else ref


def test_rrc_flip_matches_torchvision_when_upscaling(batch):
    aug = Augment([RandomResizedCrop(56, scale=(0.3, 1)), RandomHorizontalFlip(0.5), Normalize(MEAN, STD)])
    params = aug.sample(len(batch), 64, 64, torch.Generator().manual_seed(0))
    out = aug.apply(batch, params, torch.float32)
    assert out.shape == (12, 3, 56, 56) and params.flip.any() and not params.flip.all()
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    for k in range(len(batch)):
        ref = reference(batch[k], params.boxes[k], params.flip[k], (56, 56))
        got = (out[k] * std + mean) * 255
        assert (got - ref).abs().mean() < 1.0  # tolerance when upscaling: < 1 of 255 on average


def test_downscaling_is_antialiased_within_tolerance(batch):
    aug = Augment([RandomResizedCrop(24, scale=(0.6, 1))])
    params = aug.sample(len(batch), 64, 64, torch.Generator().manual_seed(1))
    out = aug.apply(batch, params, torch.float32) * 255
    for k in range(len(batch)):
        ref = reference(batch[k], params.boxes[k], False, (24, 24))
        assert (out[k] - ref).abs().mean() < 3.0  # box vs triangle filter: < 3 of 255 on average


def test_resize_center_crop_chain(batch):
    out = Augment([Resize(48), CenterCrop(40)]).apply(
        batch, Augment([Resize(48), CenterCrop(40)]).sample(len(batch), 64, 64, torch.Generator()), torch.uint8)
    ref = F.center_crop(F.resize(batch.permute(0, 3, 1, 2), [48], antialias=True), [40])
    assert out.shape == ref.shape == (12, 3, 40, 40)
    assert (out.float() - ref.float()).abs().mean() < 3.0


def test_params_are_reproducible_from_the_seed(batch):
    aug = Augment([RandomResizedCrop(32), RandomHorizontalFlip(), ColorJitter(0.4, 0.4, 0.4)])
    a = aug.sample(12, 64, 64, torch.Generator().manual_seed(5))
    b = aug.sample(12, 64, 64, torch.Generator().manual_seed(5))
    c = aug.sample(12, 64, 64, torch.Generator().manual_seed(6))
    assert torch.equal(a.boxes, b.boxes) and torch.equal(a.flip, b.flip) and torch.equal(a.pixel, b.pixel)
    assert not torch.equal(a.boxes, c.boxes)


def test_color_jitter_matches_torchvision(batch):
    aug = Augment([ColorJitter(0.5, 0.5, 0.5)])
    params = aug.sample(len(batch), 64, 64, torch.Generator().manual_seed(2))
    out = aug.apply(batch, params, torch.float32)
    for k in range(len(batch)):
        b, c, s = params.pixel[k].tolist()
        ref = batch[k].permute(2, 0, 1).float() / 255
        ref = F.adjust_saturation(F.adjust_contrast(F.adjust_brightness(ref, b), c), s)
        assert (out[k] - ref).abs().max() < 2e-3


def test_identity_and_uint8_and_channels_last(batch):
    aug = Augment([])
    params = aug.sample(len(batch), 64, 64, torch.Generator())
    assert params.identity
    out = aug.apply(batch, params, torch.uint8, channels_last=True)
    assert torch.equal(out, batch.permute(0, 3, 1, 2)) and out.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="floating"):
        Augment([Normalize()]).apply(batch, params, torch.uint8)


def test_bad_op_order_and_types():
    with pytest.raises(ValueError, match="order"):
        Augment([Normalize(), RandomHorizontalFlip()])
    with pytest.raises(TypeError, match="not a gpufeed.augment op"):
        Augment([object()])
    with pytest.raises(TypeError, match="not a gpufeed.augment op"):
        Augment([RandomHorizontalFlip])  # a class, not an op
    with pytest.raises(ValueError, match="order"):
        Augment([RandomResizedCrop(8), lambda x: x, RandomHorizontalFlip()])  # a callable comes last


def test_nn_normalize_matches_augment_and_exports(batch, tmp_path):
    x = batch.permute(0, 3, 1, 2)
    module = gnn.Normalize(MEAN, STD)
    expected = (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.allclose(module(x), expected, atol=1e-5)
    nhwc = gnn.Normalize(MEAN, STD, dtype=torch.float16, channels=-1)(batch)
    assert nhwc.dtype == torch.float16 and torch.allclose(nhwc.float(), expected.permute(0, 2, 3, 1), atol=1e-2)
    pytest.importorskip("onnx")
    torch.onnx.export(module, (x[:1],), str(tmp_path / "norm.onnx"), input_names=["x"], dynamo=False)
    assert (tmp_path / "norm.onnx").stat().st_size > 0


def test_a_kernel_launch_waits_for_tritons_work_ahead(monkeypatch):
    """`fused_kernels` before a launch waits for the thread that hashes Triton's cache key ahead (two
    threads hashing at once would both pay); asked for without a launch, or on a CPU, it does not."""
    import threading
    import time

    from gpufeed.augment import pipeline

    done = threading.Event()
    ahead = threading.Thread(target=lambda: (time.sleep(1.0), done.set()))
    monkeypatch.setattr(pipeline, "_ahead", [ahead])
    pipeline.triton_ahead(torch.device("cpu"))  # nothing on a CPU
    assert pipeline._ahead == [ahead]
    pipeline.fused_kernels(launch=False)  # imported (or found missing) before the thread starts
    ahead.start()
    pipeline.fused_kernels(launch=False)
    assert not done.is_set()
    pipeline.fused_kernels()
    assert done.is_set()


def test_no_thread_for_tritons_work_ahead_leaves_kernels_usable(monkeypatch):
    """Where no thread can start (the interpreter exiting, a thread limit), a GPU Loader's constructor
    goes on without Triton's work ahead, and later launches don't wait for a thread never started."""
    import threading

    from gpufeed.augment import pipeline

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pipeline, "_ahead", [])
    monkeypatch.setattr(threading.Thread, "start", refuse)
    pipeline.triton_ahead(torch.device("cuda"))
    assert pipeline._ahead == []
    pipeline.fused_kernels()  # nothing to wait for
