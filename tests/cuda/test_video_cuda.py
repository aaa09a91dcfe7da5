"""A video store's clips on a GPU: the same frames and the same augment draws as on the CPU."""

from __future__ import annotations

import pytest
import torch

av = pytest.importorskip("av")

from gpufeed import Clip, Loader, pack, synth  # noqa: E402
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _packed(tmp_path_factory, name: str, frames: tuple[int, int], height: int, width: int):
    """A store of six generated videos (two classes), GOP 8."""
    root = tmp_path_factory.mktemp(name)
    synth.make_video_folder(root / "v", per_class=3, classes=2, frames=frames, height=height, width=width, gop=8)
    pack(root / "v", root / "s", mode="video", progress=False, workers=1)
    return root / "s"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return _packed(tmp_path_factory, "video", (20, 30), 48, 64)


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


@pytest.fixture(scope="module")
def larger(tmp_path_factory):
    """Frames of a size every NVDEC takes (their smallest is 48x16 or more, by generation and codec)."""
    return _packed(tmp_path_factory, "video-nvdec", (24, 40), 128, 176)


def _torchcodec():
    from gpufeed.decode.codecs.nvdec import NvdecUnavailable, open_torchcodec

    try:
        open_torchcodec()
    except NvdecUnavailable as e:
        pytest.skip(str(e))


def test_nvdec_frames_are_the_cpu_decoders(larger):
    """The GPU's engines (TorchCodec's beta backend) give the CPU decoder's frames within the codec's
    tolerance (NVDEC converts to RGB itself: a few levels)."""
    import numpy as np

    from gpufeed import Store
    from gpufeed.decode.codecs.nvdec import NvdecClip, decode_on_gpu
    from gpufeed.decode.codecs.video import ClipRequest, decode_clip

    _torchcodec()
    store = Store(larger)
    for i in range(len(store)):
        index = store.video(i)
        wanted = np.array([0, 3, 9, len(index) - 1, len(index) - 1])
        a, b = int(store.offsets[i]), int(store.offsets[i + 1])
        h, w = (int(x) for x in store.shapes[i][:2])
        frames, fallback = decode_on_gpu(NvdecClip(store.data[a:b], wanted, h, w), torch.device("cuda"))
        cpu = decode_clip(ClipRequest(store.data[a:b], index.pts, index.keyframe, index.stream, wanted))
        diff = (frames.cpu().int() - torch.from_numpy(cpu).int()).abs()
        assert frames.is_cuda and not fallback and diff.float().mean() < 3 and diff.max() < 40, (i, diff.max())


def test_a_loader_decodes_on_nvdec_and_the_cpu_at_once(larger):
    _torchcodec()
    kw = dict(batch_size=4, clip=Clip(frames=4, stride=2), seed=3, fields=["video", "frames"])
    both = Loader(larger, device="cuda", decoders=("nvdec", "cpu"), **kw)
    cpu = Loader(larger, device="cuda", **kw)
    for _ in range(2):
        for x, y in zip(both, cpu, strict=True):
            assert torch.equal(x["frames"], y["frames"]) and torch.equal(x["video"], y["video"])
            assert (x["image"].float() - y["image"].float()).abs().mean() < 3
    side = both.stats()["video"]["nvdec"]
    assert side["off"] is None and side["clips"]["gpu"] > 0 and side["clips"]["cpu"] > 0
    both.close()
    cpu.close()
