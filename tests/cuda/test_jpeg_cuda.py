"""jpeg stores on a real GPU: the GPU decoders and CPU decode workers together give the CPU path's batches."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import gpufeed
from conftest import claiming, mixed_folder
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.decode import Scheduler
from gpufeed.decode.base import Encoded, as_tensor, hwc_strides
from gpufeed.decode.codecs.cpu import roi_available, roi_cost
from gpufeed.decode.asks import crop_regions
from gpufeed.synth import encode_jpegs, make_image_folder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
OPS = [RandomResizedCrop(64, scale=(0.2, 1)), RandomHorizontalFlip(), Normalize()]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegcuda")
    make_image_folder(root / "src", per_class=48, classes=4, height=150, width=200)
    gpufeed.pack(root / "src", root / "store", mode="jpeg", reencode=False, workers=4, progress=False)
    return gpufeed.open(root / "store")


def test_gpu_batches_match_cpu_batches_and_use_both_decoders(store):
    # enough CPU workers that the CPU's rate earns it a share of every batch
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, dtype=torch.float32, seed=3,
                         num_workers=8, decoders=("hw", "nvjpeg", "cuda", "cpu"))
    assert gpu.jpeg.workers.wait_ready(60) and gpu.jpeg.opened(60)
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=OPS, dtype=torch.float32, seed=3)
    names = gpu.stats()["decoders"]
    assert "nvjpeg" in names and names[-1] == "cpu"
    if importlib.util.find_spec("nvidia.nvimgcodec"):  # the [nvimgcodec] extra brings two more
        assert names == ["hw", "nvjpeg", "cuda", "cpu"], names
    for (g, gl), (c, cl) in zip(gpu, cpu, strict=True):
        assert g.is_cuda and g.shape == (32, 3, 64, 64) and torch.equal(gl.cpu(), cl)
        # nvJPEG and libjpeg-turbo differ by rounding; DCT-reduced CPU decodes by a little more
        assert (g.cpu() - c).abs().mean() < 0.05, (g.cpu() - c).abs().mean()
    counts = gpu.stats()["decoded_by"]
    assert all(counts.get(name, 0) > 0 for name in names) and counts.get("failed", 0) == 0, counts
    start = gpu.stats()["start"]  # where the start went: Triton's work ahead ended before the first batch
    assert start["triton_ready_s"] is not None and start["triton_ready_s"] <= start["first_batch_s"], start
    assert "triton_ready_s" not in cpu.stats()["start"]


def test_corrupt_sample_replaced_on_gpu(store, tmp_path, caplog):
    shutil.copytree(store.path, tmp_path / "s")
    damaged = gpufeed.open(tmp_path / "s")
    start, end = int(damaged.offsets[3]), int(damaged.offsets[4])
    with open(tmp_path / "s" / "data.bin", "r+b") as f:
        f.seek(start + 20)
        f.write(b"\xff" * (end - start - 40))
    # training (shuffled, whole batches): replaced; an evaluation pass leaves it out (test_jpeg_loader.py)
    loader = gpufeed.Loader(damaged, batch_size=32, device="cuda", augment=OPS, shuffle=True)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        batches = [(x.cpu(), y.cpu()) for x, y in loader]
    assert len(batches) == len(damaged) // 32 and all(len(y) == 32 for _, y in batches)
    assert "sample 3 cannot be decoded" in caplog.text


def test_the_gpu_decoders_open_while_the_cpu_decodes_the_first_batches(store):
    """With `Tuning.open_ahead` (the default) the GPU decoders are made, and decode once, on a thread of
    their own: the constructor does not wait for them, the CPU decodes until they are open, then they
    take shares; the batches are those of a loader that opened them in its constructor."""
    from gpufeed.decode.tuning import Tuning

    kw = dict(batch_size=32, device="cuda", augment=OPS, dtype=torch.float32, seed=6, num_workers=3)
    ahead, made = gpufeed.Loader(store, **kw), gpufeed.Loader(store, **kw, tuning=Tuning(open_ahead=False))
    assert len(made.stats()["decoders"]) == 2  # made in the constructor
    first = [(x.cpu(), y.cpu()) for x, y in ahead]
    assert ahead.jpeg.opened(60) and ahead.stats()["decoders"] == made.stats()["decoders"]
    for _ in range(2):
        for _ in ahead:
            pass
    assert ahead.stats()["decoded_by"].get(made.stats()["decoders"][0], 0) > 0
    for (a, al), (m, ml) in zip(first, made, strict=True):
        assert torch.equal(al, ml.cpu()) and (a - m.cpu()).abs().mean() < 0.05
    ahead.close()
    made.close()


def test_a_gpu_loaders_constructor_leaves_triton_to_its_thread(store, monkeypatch):
    """Whether Triton's kernels import is first asked by a batch, not by the constructor (which, in a
    fresh process, waited 0.35-0.39 s there for the import `triton_ahead`'s thread was making); the
    batches are still finished by the kernels, and the engines give them YCbCr planes where they
    import, as before."""
    from gpufeed.augment.pipeline import fused_kernels
    from gpufeed.loader import jpeg_batch

    asked: list[bool] = []
    constructing = [True]

    def spy(*args, **kwargs):
        asked.append(constructing[0])
        return fused_kernels(*args, **kwargs)

    monkeypatch.setattr(jpeg_batch, "fused_kernels", spy)
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, dtype=torch.float32, seed=3)
    constructing[0] = False
    assert True not in asked, "the constructor asked whether Triton's kernels import"
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=OPS, dtype=torch.float32, seed=3)
    for (g, gl), (c, cl) in zip(gpu, cpu, strict=True):
        assert g.is_cuda and torch.equal(gl.cpu(), cl) and (g.cpu() - c).abs().mean() < 0.05
    assert asked and gpu.jpeg.opened(60)
    kernels = fused_kernels(launch=False) is not None
    for pipeline in gpu.jpeg.pipelines:
        assert pipeline.fused == kernels
        assert all(d.planar == kernels for d in pipeline.scheduler.gpu if d.name == "hw")
    gpu.close()


@pytest.mark.skipif(not importlib.util.find_spec("nvidia.nvimgcodec"), reason="needs nvImageCodec")
def test_an_idle_engines_decoder_is_kept_for_the_process_after_a_loader_goes(store, monkeypatch):
    """Once a Loader closes, one of its engines' decoders is kept for the process (where its GPU has none
    kept yet), marked never to be destroyed (a later decoder's first decode then takes 0.1 s instead
    of 1 s): it still decodes after the Loader is closed and collected, and the next Loader takes it
    back rather than making one."""
    import gc

    from gpufeed.decode.scheduling import choice

    monkeypatch.setattr(choice, "_kept", {})  # (earlier tests' loaders kept one)
    loader = gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, num_workers=2)
    assert loader.jpeg.opened(60)
    engines = [d for p in loader.jpeg.pipelines for d in p.scheduler.gpu if d.name == "hw"]
    if not engines:
        pytest.skip("no hardware JPEG engines on this GPU")
    for _ in loader:
        pass
    loader.close()
    del loader
    gc.collect()
    kept = choice._kept[torch.cuda.current_device()]
    assert any(kept is d for d in engines) and kept._batches.kept
    assert choice.warmed(kept, torch.device("cuda"))
    # the next Loader takes it back rather than making one, and decodes its batches with it
    after = gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, num_workers=2)
    assert after.jpeg.opened(60)
    assert [d for p in after.jpeg.pipelines for d in p.scheduler.gpu if d.name == "hw"] == [kept]
    assert not kept._batches.kept and torch.cuda.current_device() not in choice._kept
    assert sum(len(batch[0]) for batch in after) == len(store)
    assert after.stats()["decoded_by"].get("hw", 0) > 0
    after.close()
    assert choice._kept[torch.cuda.current_device()] is kept and kept._batches.kept


def test_memory_flat_over_epochs(store):
    loader = gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS)
    assert loader.jpeg.opened(60)  # its buffers are made in the first pass, not while a later one starts
    for _ in loader:
        pass
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        for _ in loader:
            pass
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (8 << 20)


@pytest.mark.parametrize("cache", ["host", "disk", "gpu"])
def test_cpu_workers_feed_the_gpu_from_each_tier(store, cache, caplog):
    """Worker processes' shared buffers, page-locked, copied to the device for the resize kernel."""
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        gpu = gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, dtype=torch.float32, seed=4,
                             decoders=("cpu",), num_workers=3, cache=cache)
    assert gpu.stats()["tier"] == ("disk" if cache == "disk" else "host")
    assert ("decoders read bitstreams from host memory" in caplog.text) == (cache == "gpu")
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=OPS, dtype=torch.float32, seed=4)
    for _ in range(2):  # the second epoch reuses the shared buffers
        for (g, gl), (c, cl) in zip(gpu, cpu, strict=True):
            assert torch.equal(gl.cpu(), cl) and (g.cpu() - c).abs().mean(dim=(1, 2, 3)).max() < 0.05
    gpu.carried.join()  # and the next epoch's first batches, made as the second ended
    assert gpu.stats()["decoded_by"]["cpu"] == (2 * len(gpu) + gpu.carried.count) * 32
    gpu.close()


def test_one_cuda_context_and_workers_without_one(store):
    """All GPU work runs in the training process: no other process of the loader makes a CUDA context
    (without MPS, contexts time-slice the GPU with the model)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi to list the GPU's processes")
    with gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, num_workers=3) as gpu:
        assert gpu.jpeg.workers.wait_ready(60) and gpu.jpeg.opened(60)
        for _ in gpu:
            pass
        assert len(gpu.stats()["decoders"]) == 2  # the default: one GPU decoder and the CPU
        workers = set(gpu.jpeg.workers.pids)
        listed = {int(pid) for pid in subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                                     capture_output=True, text=True, check=True).stdout.split()}
    assert len(workers) == 3 and not workers & listed, listed
    assert os.getpid() in listed or not listed  # pid namespaces may hide ours


def test_decode_workers_leave_the_gpu_alone(store):
    """Decoding regions through nvImageCodec's CPU backend makes no CUDA context in the workers (each
    would hold GPU memory)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi to list the GPU's processes")
    with gpufeed.Loader(store, batch_size=32, device="cuda", augment=OPS, decoders=("cpu",), num_workers=3) as gpu:
        for _ in gpu:
            pass
        workers = set(gpu.jpeg.workers.pids)
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.split()
    assert workers and not workers & {int(pid) for pid in listed}, listed


@pytest.mark.skipif(not roi_available(), reason="nvImageCodec not installed")
def test_the_cpu_share_is_the_cheapest_crops(store):
    sched = Scheduler(torch.device("cuda"), 2, ("nvjpeg", "cpu"))
    try:
        assert sched.opened(60)
        sched.steering.rates = {"nvjpeg": 3000.0, "cpu": 500.0}  # per CPU thread, of 2
        sched.steering.gpu_rate = 3000.0  # a quarter of every batch for the CPU
        idx = np.arange(32)
        batch = Encoded.of(as_tensor(store.data), np.asarray(store.offsets), idx)
        shapes = np.asarray(store.shapes)[idx].astype(np.int64)
        rng = np.random.default_rng(0)
        y0, x0 = rng.integers(0, 100, 32), rng.integers(0, 150, 32)
        boxes = np.stack([x0, y0, x0 + rng.integers(10, 50, 32), y0 + rng.integers(10, 50, 32)], 1).astype(float)
        parts, failed = sched.run(batch, shapes, boxes, (64, 64), pin=True)
        cost = roi_cost(shapes, crop_regions(shapes, boxes))
        positions = [pos.tolist() for _, pos in parts]
        assert not failed and sorted(sum(positions, [])) == list(range(32))
        assert sorted(positions[-1]) == sorted(np.argsort(cost, kind="stable")[:8].tolist())
        assert parts[-1][0].regions.tolist() == crop_regions(shapes, boxes)[positions[-1]].tolist()
    finally:
        sched.close()


def test_evaluation_ops_and_two_pipelines_taking_turns_match_the_cpu(store, monkeypatch):
    """Resize(shorter side) + CenterCrop on images of different sizes, and two pipelines whose GPU
    decodes take turns: the GPU batches equal the CPU's, in order, every sample once."""
    from gpufeed.augment import CenterCrop, Resize
    from gpufeed.decode.tuning import Tuning

    ops = [Resize(72), CenterCrop(64), Normalize()]
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", augment=ops, dtype=torch.float32, shuffle=False,
                         drop_last=False, num_workers=4, tuning=Tuning(pipelines=2))
    assert len(gpu.jpeg.pipelines) == 2 and gpu.jpeg.pipelines[0].scheduler._gpu_turn is \
        gpu.jpeg.pipelines[1].scheduler._gpu_turn
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=ops, dtype=torch.float32, shuffle=False,
                         drop_last=False)
    seen = 0
    for (g, gl), (c, cl) in zip(gpu, cpu, strict=True):
        assert g.shape == c.shape and torch.equal(gl.cpu(), cl)
        assert (g.cpu() - c).abs().mean() < 0.05
        seen += len(gl)
    assert seen == len(store)
    gpu.close()
    cpu.close()


def _gpu_matches_cpu(store, ops, seed, tolerance):
    gpu = gpufeed.Loader(store, batch_size=32, device="cuda", augment=ops, dtype=torch.float32, seed=seed,
                         num_workers=4)
    cpu = gpufeed.Loader(store, batch_size=32, device="cpu", augment=ops, dtype=torch.float32, seed=seed)
    for (g, gl), (c, cl) in zip(gpu, cpu, strict=True):
        assert g.shape == c.shape and torch.equal(gl.cpu(), cl)
        assert (g.cpu() - c).abs().mean() < tolerance
    gpu.close()
    cpu.close()


def test_colour_ops_and_erasing_on_jpeg_batches_match_the_cpu(store):
    from gpufeed.augment import GaussianBlur, RandomErasing, RandomGrayscale

    ops = [RandomResizedCrop(64, scale=(0.2, 1)), RandomGrayscale(0.5), GaussianBlur(5), Normalize(),
           RandomErasing(p=0.5)]
    _gpu_matches_cpu(store, ops, 3, 0.05)


def test_warps_and_policies_on_jpeg_batches_match_the_cpu(store):
    from gpufeed.augment import RandomRotation, RandomVerticalFlip, TrivialAugmentWide

    ops = [RandomResizedCrop(64, scale=(0.2, 1)), RandomVerticalFlip(), RandomRotation(20), TrivialAugmentWide(),
           Normalize()]
    _gpu_matches_cpu(store, ops, 4, 0.08)


@pytest.mark.parametrize("share", [False, True])
def test_a_folder_read_in_place_on_the_gpu_gives_its_stores_batches(store, share):
    """The store was packed with reencode=False from its folder: the same bytes, read in place (`share`:
    only the GPU decoders' likely share read ahead, `Tuning.read_gpu_share`, the rest as they ask)."""
    from gpufeed.decode.tuning import Tuning

    folder = store.path.parent / "src"
    kw = dict(batch_size=32, device="cuda", augment=OPS, dtype=torch.float32, seed=5, num_workers=4,
              fields=("label", "source"))
    in_place = gpufeed.Loader(folder, **kw, tuning=Tuning(read_gpu_share=share, read_spare=0))
    packed = gpufeed.Loader(store, **kw)
    assert in_place.tier.name == "files" and len(in_place.store) == len(store)
    for a, b in zip(in_place, packed, strict=True):
        assert a["source"] == b["source"] and torch.equal(a["label"], b["label"])
        # the batch is shared out between GPU and CPU decoders by their rates: nvJPEG and libjpeg differ a little
        assert (a["image"] - b["image"]).abs().mean() < 0.05
    in_place.close()
    packed.close()


def test_a_mixed_folder_in_place_on_the_gpu_gives_its_stores_pixels_each_image_once(tmp_path):
    """Every kind packing reads (PNG, WebP, progressive, CMYK, gray, 16-bit, turned) is served in place
    through the GPU decoders with the packed store's pixels; the file cut short is named when the folder
    is indexed, as packing names it, and never served."""
    root = mixed_folder(tmp_path / "img")
    gpufeed.pack(root, tmp_path / "store", mode="jpeg", reencode=False, max_side=4096, workers=2, progress=False)
    kw = dict(batch_size=8, device="cuda", augment=OPS, dtype=torch.float32, seed=5, num_workers=2,
              shuffle=False, drop_last=False, fields=("label", "source"))
    in_place, packed = gpufeed.Loader(root, **kw), gpufeed.Loader(tmp_path / "store", **kw)
    assert in_place.store.reencoded == 8 and len(in_place.store) == len(packed.store) == 15
    assert in_place.store.skipped[0] in packed.store.manifest.skipped  # cut.jpg, for the same reason
    seen = []
    for a, b in zip(in_place, packed, strict=True):
        assert a["source"] == b["source"] and torch.equal(a["label"], b["label"])
        assert (a["image"] - b["image"]).abs().mean() < 0.05  # decoders differ a little between runs' shares
        seen += a["source"]
    assert len(seen) == len(set(seen)) == 15 and not any(s.endswith("cut.jpg") for s in seen)
    assert os.path.basename(in_place.store.skipped[0]["path"]) == "cut.jpg" and not in_place.skipped
    in_place.close()
    packed.close()


def _encoded(sizes, gen, bad=()):
    """Random-pixel JPEGs of `sizes` as a batch; positions in `bad` are bytes no decoder reads."""
    return Encoded.joined([b"\xff\xd8 not a jpeg" if k in bad else
                           encode_jpegs([torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=gen).numpy()],
                                        quality=90)[0] for k, (h, w) in enumerate(sizes)])


@pytest.mark.skipif(not importlib.util.find_spec("nvidia.nvimgcodec"), reason="needs nvImageCodec")
def test_the_engines_ycbcr_planes_resize_as_their_rgb():
    """Photos (4:2:0, odd sizes too) decoded by the engines to their YCbCr planes and converted in the
    resize kernel give what the same photos decoded to RGB give, within a level on average. The kernel
    samples the chroma planes at each point where the decoder upsamples them first (libjpeg's fancy
    upsampling): where chroma changes sharply and a small crop is magnified, a pixel may differ by
    tens of levels (as nvJPEG's plain upsampling differs from libjpeg's); a plane misplaced would
    differ by tens of levels on average."""
    from gpufeed.augment import fused
    from gpufeed.decode.base import YCC420
    from gpufeed.decode.codecs.nvimgcodec import NvImgCodecDecoder
    from gpufeed.synth import encode_jpegs, photos

    try:
        dec = NvImgCodecDecoder(torch.device("cuda"), "hw")
    except Exception as e:  # no engines on this GPU
        pytest.skip(f"nvImageCodec hw: {e}")
    sizes = [(375, 500), (101, 77), (64, 64), (333, 211)]
    batch = Encoded.joined(encode_jpegs(photos(sizes)))
    outs = []
    for planar in (False, True):
        dec.planar = planar
        part = dec.decode(batch)
        assert not part.failed and (part.strides[:, 0] == YCC420).all() == planar
        n, dev = len(sizes), "cuda"
        boxes = torch.tensor([[w * 0.1, h * 0.2, w * 0.9, h * 0.95] for h, w in sizes], device=dev).view(-1)
        out = torch.empty((n, 3, 96, 96), device=dev)
        as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        fused.resample_packed(part.base, as_dev(part.offsets), as_dev(part.sizes), as_dev(part.strides),
                              torch.arange(n, device=dev), boxes, torch.zeros(n, device=dev), out,
                              torch.ones(3, device=dev), torch.zeros(3, device=dev))
        outs.append(out)
    levels = (outs[0] - outs[1]).abs()
    assert levels.mean() < 1 and levels.max() < 48, (levels.mean(), levels.max())


@pytest.mark.skipif(not importlib.util.find_spec("nvidia.nvimgcodec"), reason="needs nvImageCodec")
@pytest.mark.parametrize("name", ["hw", "cuda"])
def test_nvimgcodec_c_api_decodes_what_its_binding_does(name):
    """The C API's batch (one buffer, images at aligned offsets) has the pixels nvImageCodec's Python
    binding decodes, the same images failed, and the next batch (other sizes) decodes into the
    handles and the buffer of the first as well; a hostile header is refused."""
    from gpufeed.decode.codecs.nvimgcodec import NvImgCodecDecoder
    from gpufeed.decode.codecs.pixels import nvimgcodec

    nv, gen = nvimgcodec(), torch.Generator().manual_seed(1)
    kind = {"hw": nv.BackendKind.HW_GPU_ONLY, "cuda": nv.BackendKind.HYBRID_CPU_GPU}[name]
    try:
        native = NvImgCodecDecoder(torch.device("cuda"), name)
        binding = nv.Decoder(backends=[nv.Backend(kind)])
    except Exception as e:  # no engines on this GPU
        pytest.skip(f"nvImageCodec {name}: {e}")
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)
    first = None
    for sizes, bad in (([(64, 64), (80, 64), (33, 47), (96, 128)], {2}), ([(80, 100), (64, 96), (72, 100)], ())):  # fits the first buffer
        batch = _encoded(sizes, gen, bad)
        got = native.decode(batch)
        if first is None:  # the buffer is decoded into again once the event handed back with it completed
            first = got.base.data_ptr()
            done = torch.cuda.current_stream().record_event()
            got.on_done(done)
            done.synchronize()
        else:
            assert got.base.data_ptr() == first
        want = binding.decode(batch.arrays(), params=params)
        torch.cuda.synchronize()
        assert sorted(got.failed) == sorted(k for k, image in enumerate(want) if image is None) == sorted(bad)
        assert got.sizes.tolist() == [list(s) for k, s in enumerate(sizes) if k not in bad]
        assert (got.strides == hwc_strides(got.sizes)).all() and (got.offsets % 256 == 0).all()
        for (h, w), off, image in zip(got.sizes.tolist(), got.offsets.tolist(), [im for im in want if im is not None]):
            a, b = got.base[off: off + h * w * 3].view(h, w, 3), torch.as_tensor(image, device="cuda")
            assert torch.equal(a, b), (name, (a.int() - b.int()).abs().max())
    good = bytes(_encoded([(64, 64)], gen).array)  # a header that claims 60000 x 60000 is refused unallocated
    hostile = claiming(good, 60000, 60000)
    data = np.frombuffer(good + hostile, np.uint8)
    got = native.decode(Encoded.of(torch.from_numpy(data.copy()), np.array([0, len(good), len(data)]), np.arange(2)))
    assert list(got.failed) == [1] and "claims 60000x60000" in got.failed[1] and got.sizes.tolist() == [[64, 64]]
