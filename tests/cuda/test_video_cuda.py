"""A video store's clips on a GPU: the same frames and the same augment draws as on the CPU."""

from __future__ import annotations

import pytest
import torch

av = pytest.importorskip("av")

from gpufeed import Clip, Loader, pack, synth  # noqa: E402
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    synth.make_video_folder(root / "v", per_class=3, classes=2, frames=(20, 30), height=48, width=64, gop=8)
    pack(root / "v", root / "s", mode="video", progress=False, workers=1)
    return root / "s"


def _batches(store, device, **kw):
    loader = Loader(store, batch_size=3, device=device, clip=Clip(frames=5, stride=2), seed=5, **kw)
    return [(x.cpu(), y.cpu()) for _ in range(2) for x, y in loader]


def test_gpu_clips_are_the_cpu_clips(store):
    for (g, gy), (c, cy) in zip(_batches(store, "cuda"), _batches(store, "cpu")):
        # (the colour conversion's float arithmetic, CUDA's against the CPU's: a level at most)
        assert g.dtype == torch.uint8 and (g.int() - c.int()).abs().max() <= 1 and torch.equal(gy, cy)


def test_gpu_augmented_clips_match_the_cpu(store):
    ops = [RandomResizedCrop(32), RandomHorizontalFlip(), Normalize()]
    gpu = _batches(store, "cuda", augment=ops, dtype=torch.float32)
    cpu = _batches(store, "cpu", augment=ops, dtype=torch.float32)
    for (g, gy), (c, cy) in zip(gpu, cpu):
        assert g.shape == c.shape == (3, 5, 3, 32, 32) and torch.equal(gy, cy)
        assert (g - c).abs().mean() < 0.02  # the Triton resampler against roi_align: the same crop
