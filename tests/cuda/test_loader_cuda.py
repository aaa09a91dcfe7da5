"""The Loader on a real GPU: every tier, the side-stream protocol, no races, flat memory."""

from __future__ import annotations

import pytest
import torch

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from loader_checks import check_resume, check_uint8_batches, make_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
OPS = [RandomResizedCrop(28, scale=(0.2, 1)), RandomHorizontalFlip(), Normalize()]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("cuda"), n=192)


@pytest.mark.parametrize("cache", ["gpu", "host", "disk"])
def test_uint8_batches_equal_the_store(store, cache):
    loader = gpufeed.Loader(store, batch_size=32, device="cuda", cache=cache)
    assert loader.tier.name == cache, loader.tier.reason
    assert sorted(check_uint8_batches(loader)) == list(range(192))


@pytest.mark.parametrize("cache", ["gpu", "host", "disk"])
def test_gpu_augment_equals_cpu_augment(store, cache):
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", cache=cache, augment=OPS, dtype=torch.float32)
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=OPS, dtype=torch.float32)
    for (g, gl), (c, cl) in zip(gpu, cpu):
        assert g.is_cuda and torch.equal(gl.cpu(), cl)
        assert (g.cpu() - c).abs().max() < 1e-3


def test_auto_picks_gpu_for_a_small_store(store):
    loader = gpufeed.Loader(store, batch_size=32, device="cuda")
    assert loader.tier.name == "gpu" and "fits" in loader.tier.reason


@pytest.mark.parametrize("cache", ["host", "disk"])
@pytest.mark.parametrize("consumer", ["slow", "frees_at_once"])
def test_no_cross_stream_race(store, cache, consumer):
    """A slow consumer stream (sleep kernel before reading) and one that frees batches at once
    must both see exactly the planned samples: slots and allocator blocks are not reused early."""
    loader = gpufeed.Loader(store, batch_size=16, device="cuda", cache=cache, prefetch=2)
    for epoch in range(2):
        results = []
        for number, (images, labels) in enumerate(loader):
            if consumer == "slow":
                torch.cuda._sleep(2_000_000)
            results.append((number, images.float().sum(), labels.clone()))
            del images, labels
        for number, total, _labels in results:
            idx, _ = loader.plan(epoch, number)
            ref = torch.stack([store[int(i)][0] for i in idx])
            assert total.item() == ref.float().sum().item(), f"epoch {epoch} batch {number}"


def test_resume_on_gpu(store):
    make = lambda: gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, seed=4)  # noqa: E731
    check_resume(make, [0, 2, 5])


@pytest.mark.parametrize("cache", ["gpu", "host", "disk"])
def test_memory_is_flat_over_epochs(store, cache):
    loader = gpufeed.Loader(store, batch_size=32, device="cuda", cache=cache, augment=OPS)
    for _ in loader:
        pass
    torch.cuda.synchronize()
    gpu_before = torch.cuda.memory_allocated()
    rss_before = _rss()
    for _ in range(5):
        for _ in loader:
            pass
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= gpu_before + (1 << 20)
    assert _rss() <= rss_before + (64 << 20)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("cache", ["gpu", "disk"])
def test_colour_ops_erasing_and_a_callable_agree_on_gpu_and_cpu(store, cache):
    from gpufeed.augment import GaussianBlur, RandomAutocontrast, RandomErasing, RandomGrayscale, RandomInvert

    ops = [RandomResizedCrop(28, scale=(0.2, 1)), RandomHorizontalFlip(), RandomGrayscale(0.5), RandomInvert(),
           RandomAutocontrast(), GaussianBlur(3), Normalize(), RandomErasing(p=0.5, value=0.0), lambda x: x * 0.5]
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", cache=cache, augment=ops, dtype=torch.float32)
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=ops, dtype=torch.float32)
    for (g, gl), (c, cl) in zip(gpu, cpu):
        assert g.is_cuda and g.shape == c.shape and torch.equal(gl.cpu(), cl)
        assert (g.cpu() - c).abs().mean() < 1e-3


def test_mixup_cutmix_on_gpu_batches_equal_the_cpus(store):
    from gpufeed.augment import MixUpOrCutMix

    classes = int(store.labels.max()) + 1
    ops = [RandomResizedCrop(28, scale=(0.2, 1)), Normalize(), MixUpOrCutMix(num_classes=classes)]
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", augment=ops, dtype=torch.float32, seed=5)
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=ops, dtype=torch.float32, seed=5)
    for (g, gt), (c, ct) in zip(gpu, cpu):
        assert gt.is_cuda and gt.shape == (32, classes) and torch.allclose(gt.cpu(), ct, atol=1e-6)
        assert (g.cpu() - c).abs().max() < 1e-3


@pytest.mark.parametrize("ops_name", ["geometry", "policy", "vflip_only"])
def test_warps_flips_and_policies_agree_on_gpu_and_cpu(store, ops_name):
    from gpufeed.augment import RandAugment, RandomAffine, RandomCrop, RandomVerticalFlip

    ops = {"geometry": [RandomCrop(28, padding=4), RandomVerticalFlip(), RandomAffine(15, translate=(0.1, 0.1),
                                                                                       shear=5), Normalize()],
           "policy": [RandomResizedCrop(28, scale=(0.3, 1)), RandomHorizontalFlip(), RandAugment(2, 9), Normalize()],
           "vflip_only": [RandomResizedCrop(28), RandomVerticalFlip(), Normalize()]}[ops_name]
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", cache="gpu", augment=ops, dtype=torch.float32)
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=ops, dtype=torch.float32)
    for (g, gl), (c, cl) in zip(gpu, cpu):
        assert g.is_cuda and g.shape == c.shape and torch.equal(gl.cpu(), cl)
        assert (g.cpu() - c).abs().mean() < 2e-2  # nearest sampling may pick the neighbour at ties
    gpu.close()
    cpu.close()


def test_random_erasing_noise_on_gpu_is_replayed_and_normal(store):
    from gpufeed.augment import RandomErasing

    ops = [RandomResizedCrop(28), Normalize(), RandomErasing(p=1.0, value="random")]
    first = next(iter(gpufeed.Loader(store, batch_size=32, device="cuda", cache="gpu", augment=ops, seed=2)))[0]
    again = next(iter(gpufeed.Loader(store, batch_size=32, device="cuda", cache="gpu", augment=ops, seed=2)))[0]
    assert torch.equal(first, again) and first.is_cuda


@pytest.mark.parametrize("instances", [True, False])
def test_masks_on_the_gpu_equal_the_cpus(tmp_path, instances):
    """Instance masks and label maps resampled from their runs on the GPU: the same pixels as on the
    CPU, through a jpeg store's crops, flips and rotations."""
    import numpy as np

    from gpufeed.augment import RandomRotation
    from gpufeed.synth import natural_image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:48, :64]
    data = []
    for k in range(24):
        inst = np.stack([((xx - 8 - j * 9 - k) ** 2 + (yy - 20 - j) ** 2 < 60 + k) for j in range(k % 4 + 1)])
        masks = inst.astype(np.uint8) if instances else (inst * np.arange(1, len(inst) + 1)[:, None, None]).max(0)
        data.append({"image": natural_image(rng, 48, 64, k), "label": 0, "masks": masks})
    gpufeed.pack(data, tmp_path / "s", mode="jpeg", progress=False, workers=1)
    ops = [RandomResizedCrop(32, scale=(0.3, 1)), RandomHorizontalFlip(), RandomRotation(20)]
    kw = dict(batch_size=8, augment=ops, seed=3, fields=("masks",), mask_fill=0 if instances else 255)
    for g, c in zip(gpufeed.Loader(tmp_path / "s", device="cuda", **kw),
                    gpufeed.Loader(tmp_path / "s", device="cpu", **kw), strict=True):
        assert g["masks"].is_cuda and torch.equal(g["masks"].cpu(), c["masks"]) and c["masks"].any()
        if instances:
            assert torch.equal(g["masks_count"].cpu(), c["masks_count"])
        else:
            assert (c["masks"] == 255).any()  # the rotations' corners


def test_batches_by_aspect_ratio_on_the_gpu_equal_the_cpus(tmp_path):
    """`group_by_aspect`: the GPU's padded batches (the hardware and CPU decoders' images resized in one
    kernel, the padding zeroed) have the CPU's shapes, image sizes and masks, and pixels to rounding."""
    import numpy as np

    from gpufeed.augment import Resize
    from gpufeed.synth import natural_image

    rng = np.random.default_rng(0)
    sizes = [(96, 128), (128, 96), (80, 160), (112, 112)]
    data = []
    for k in range(32):
        h, w = sizes[k % 4]
        masks = np.zeros((2, h, w), np.uint8)
        masks[0, 10 : 30 + k, 5:40], masks[1, h // 2 :, w // 3 :] = 1, 1
        data.append({"image": natural_image(rng, h, w, k), "label": k % 3, "masks": masks})
    gpufeed.pack(data, tmp_path / "s", mode="jpeg", progress=False, workers=1)
    kw = dict(batch_size=8, augment=[Resize(64, max_size=100), RandomHorizontalFlip(), Normalize()], seed=3,
              fields=("image", "masks"), group_by_aspect=True, dtype=torch.float32)
    shapes = set()
    for g, c in zip(gpufeed.Loader(tmp_path / "s", device="cuda", **kw),
                    gpufeed.Loader(tmp_path / "s", device="cpu", **kw), strict=True):
        assert g["image"].is_cuda and g["image"].shape == c["image"].shape
        assert torch.equal(g["image_size"].cpu(), c["image_size"]) and torch.equal(g["masks"].cpu(), c["masks"])
        for k, (h, w) in enumerate(c["image_size"].tolist()):
            image = g["image"][k].cpu()
            assert not image[:, h:].any() and not image[:, :, w:].any()
            assert (image[:, :h, :w] - c["image"][k, :, :h, :w]).abs().mean() < 0.05
        shapes.add(tuple(c["image"].shape[2:]))
    assert len(shapes) > 1


def test_parameters_taken_with_host_positions_wait_for_nothing_on_the_gpu():
    """A video Loader's consumer takes each batch's parameters once per frame with positions on the
    host; indexing the GPU's copies with them waited for the training step queued on the stream (a
    sync with the GPU every step, r2plus1d_18 at 83-90 % of its ceiling)."""
    from gpufeed.augment import ColorJitter, RandomAffine, RandomVerticalFlip
    from gpufeed.augment.pipeline import Augment

    flips = [RandomHorizontalFlip(), RandomVerticalFlip()]
    aug = Augment([RandomResizedCrop(28), *flips, RandomAffine(10), ColorJitter(0.4, 0.4, 0.4), Normalize()])
    params = aug.sample(6, 40, 50, torch.Generator().manual_seed(0)).to("cuda")
    rows = torch.arange(6).repeat_interleave(4)
    torch.cuda.set_sync_debug_mode("error")
    try:
        taken = params.take(rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert taken.boxes.is_cuda and torch.equal(taken.boxes.cpu(), params.boxes.cpu()[rows])
    assert torch.equal(taken.flip.cpu(), params.flip.cpu()[rows])
    assert torch.equal(taken.pixel.cpu(), params.pixel.cpu()[rows])
    assert torch.equal(taken.vflip.cpu(), params.vflip.cpu()[rows])
    assert torch.equal(taken.warp.matrices.cpu(), params.warp.matrices.cpu()[:, rows])


def test_masks_stored_pixels_from_host_geometry_wait_for_nothing_on_the_gpu():
    """The masks' torch path (no Triton, no augment ops, or a warp the kernel does not take) located
    each batch's stored pixels on the consumer's thread with blocking copies of the host geometry."""
    import numpy as np

    from gpufeed.augment.masks import stored_pixels
    from gpufeed.augment.pipeline import Augment

    aug = Augment([RandomResizedCrop(28), RandomHorizontalFlip()])
    params = aug.sample(4, 40, 50, torch.Generator().manual_seed(1))
    hw = np.array([[40, 50]] * 4)
    expected = stored_pixels(params, hw, torch.device("cpu"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = stored_pixels(params, hw, torch.device("cuda"))
        plain = stored_pixels(None, hw, torch.device("cuda"), (40, 50))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(plain.cpu(), stored_pixels(None, hw, torch.device("cpu"), (40, 50)))
