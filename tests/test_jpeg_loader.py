"""The Loader over jpeg stores on CPU: crops planned from stored sizes, decoded, resized, checked."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as F

import gpufeed
from gpufeed.decode.tuning import Tuning
from conftest import save, smooth
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.loader.jpeg import PREFETCH, DecodeError
from loader_checks import check_resume

OPS = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip(), Normalize((0.5,) * 3, (0.25,) * 3)]


@pytest.fixture(scope="module")
def jpeg_store(tmp_path_factory):
    """48 JPEGs of several sizes in 3 classes; sample i is smooth(i) at one of 4 sizes."""
    root = tmp_path_factory.mktemp("jpeg")
    sizes = [(40, 60), (64, 48), (90, 120), (33, 33)]
    for i in range(48):
        h, w = sizes[i % 4]
        save(root / "src" / f"c{i % 3}" / f"{i:03d}.png", smooth(i, h, w))
    gpufeed.pack(root / "src", root / "store", mode="jpeg", quality=95, workers=2, progress=False)
    return gpufeed.open(root / "store")


def test_batches_match_torchvision_reference(jpeg_store):
    loader = gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, dtype=torch.float32, seed=5)
    assert loader.stats()["decoders"] == ["cpu"]
    for number, (images, labels) in enumerate(loader):
        idx, params = loader.plan(0, number)
        assert images.shape == (12, 3, 24, 24) and labels.tolist() == [jpeg_store[int(i)][1] for i in idx]
        for k, i in enumerate(idx.tolist()):
            image = jpeg_store[i][0].float()
            left, top, right, bottom = (int(round(v)) for v in params.boxes[k].tolist())
            ref = F.resized_crop(image, top, left, bottom - top, right - left, [24, 24], antialias=True)
            ref = ref.flip(-1) if params.flip[k] else ref
            got = (images[k] * 0.25 + 0.5) * 255
            assert (got - ref).abs().mean() < 4.0, (number, k)


def test_every_sample_once_per_epoch_and_resume(jpeg_store):
    loader = gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=OPS, seed=1)
    seen = torch.cat([loader.plan(0, b)[0] for b in range(len(loader))])
    assert sorted(seen.tolist()) == list(range(48))
    make = lambda: gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=OPS, seed=1)  # noqa: E731
    check_resume(make, [0, 2, 5])


def test_dct_downscaled_decode_for_large_crops(tmp_path):
    for i in range(4):
        save(tmp_path / "src" / f"{i}.png", smooth(i, 400, 400))
    gpufeed.pack(tmp_path / "src", tmp_path / "s", mode="jpeg", workers=1, progress=False)
    loader = gpufeed.Loader(tmp_path / "s", batch_size=4, device="cpu", seed=0, dtype=torch.float32,
                            augment=[RandomResizedCrop(32, scale=(0.9, 1))])
    images, _ = next(iter(loader))
    idx, params = loader.plan(0, 0)
    store = gpufeed.open(tmp_path / "s")
    for k, i in enumerate(idx.tolist()):
        left, top, right, bottom = (int(round(v)) for v in params.boxes[k].tolist())
        ref = F.resized_crop(store[i][0].float(), top, left, bottom - top, right - left, [32, 32], antialias=True)
        assert (images[k] * 255 - ref).abs().mean() < 3.0


def _damage(store, sample: int) -> None:
    start, end = int(store.offsets[sample]), int(store.offsets[sample + 1])
    with open(store.path / "data.bin", "r+b") as f:
        f.seek(start)
        f.write(b"\0" * (end - start))


def test_corrupt_sample_is_replaced_or_raises(jpeg_store, tmp_path, caplog):
    import shutil

    shutil.copytree(jpeg_store.path, tmp_path / "s")
    store = gpufeed.open(tmp_path / "s")
    _damage(store, 7)
    # training: batches kept full (the next epoch's first batches are not made as this one ends: they
    # would count the failure again, or not)
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=OPS, tuning=Tuning(carry=False))
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        batches = list(loader)
    assert len(batches) == 6 and all(len(y) == 8 for _, y in batches)
    assert "sample 7 cannot be decoded" in caplog.text
    assert any("undecodable" in n for n in loader.stats()["notes"])
    assert loader.stats()["decoded_by"]["failed"] == 1  # the damaged sample, once in the epoch
    number = next(n for n in range(6) if 7 in loader.plan(0, n)[0].tolist())
    k = loader.plan(0, number)[0].tolist().index(7)
    images = batches[number][0]
    assert any(torch.equal(images[k], images[j]) for j in range(8) if j != k)  # became a copy of another
    strict = gpufeed.Loader(store, batch_size=8, device="cpu", augment=OPS, shuffle=False, on_error="raise")
    with pytest.raises(DecodeError, match="sample 7 cannot be decoded"):
        list(strict)


def test_jpeg_needs_a_fixed_output_and_bad_ops_are_refused_when_built(jpeg_store):
    from gpufeed.augment import CenterCrop, Resize

    with pytest.raises(ValueError, match="images of different sizes"):
        gpufeed.Loader(jpeg_store, device="cpu")
    with pytest.raises(ValueError, match=r"store: augment ops .*Resize\(size=16, max_size=None\).*leave images of different sizes"):
        gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=[Resize(16)])
    with pytest.raises(ValueError, match=r"CenterCrop\(40\) is larger than some images"):  # the 33x33 ones
        gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=[CenterCrop(40)])


def test_evaluation_resize_then_center_crop_matches_torchvision(jpeg_store):
    """torchvision's evaluation transform, Resize(shorter side) then CenterCrop, on images of
    different sizes and aspect ratios: each image is resized with its own aspect kept."""
    from gpufeed.augment import CenterCrop, Resize

    loader = gpufeed.Loader(jpeg_store, batch_size=16, device="cpu", augment=[Resize(32), CenterCrop(28)],
                            dtype=torch.float32, shuffle=False, drop_last=False)
    seen = []
    for number, (images, labels) in enumerate(loader):
        idx, _ = loader.plan(0, number)
        assert images.shape == (len(idx), 3, 28, 28)
        for k, i in enumerate(idx.tolist()):
            ref = F.center_crop(F.resize(jpeg_store[i][0], [32], antialias=True), [28]).float()
            assert (images[k] * 255 - ref).abs().mean() < 4.0, i  # the README's tolerance for downscaling
        seen += idx.tolist()
    assert seen == list(range(48))  # unshuffled, every sample once


def test_decoder_names_checked_and_gpu_decoders_ignored_on_cpu(jpeg_store):
    with pytest.raises(ValueError, match="choose from hw, nvjpeg, cuda, cpu"):
        gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=OPS, decoders=("hw", "fast"))
    loader = gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=OPS, decoders=("cuda", "nvjpeg", "cpu"),
                            prefetch=3)  # fewer than the epoch's 6 batches are carried: see `read` below
    assert loader.stats()["decoders"] == ["cpu"]
    assert sum(len(y) for _, y in loader) == 48
    loader.carried.join()  # the next epoch's first batches, made as this one ended
    stats = loader.stats()  # where the time went, for doctor and training loops
    assert all(stats["seconds"][stage] > 0 for stage in ("read", "decode", "resize"))
    offsets = jpeg_store.offsets
    # read too: the carried batches and the one after them, started by the last of them
    carried = [i for b in range(loader.carried.count + 1) for i in loader.plan(1, b)[0].tolist()]
    read = int(offsets[-1]) + sum(int(offsets[i + 1] - offsets[i]) for i in carried)
    assert stats["decode_seconds"]["cpu_threads"] > 0 and stats["bytes"]["read"] == read


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_batch_of_only_undecodable_samples_is_replaced_in_skip_mode(jpeg_store, tmp_path, caplog, batch_size):
    """Every sample of a batch damaged: skip mode still yields a full batch (the samples after them),
    warns naming the first damaged one, and raise mode names it."""
    import shutil

    shutil.copytree(jpeg_store.path, tmp_path / "s")
    store = gpufeed.open(tmp_path / "s")
    make = lambda **kw: gpufeed.Loader(store, batch_size=batch_size, device="cpu", augment=OPS, seed=1, **kw)  # noqa: E731
    first = make().plan(0, 0)[0]  # training (batches kept full): batch 0's samples, all damaged
    for sample in first.tolist():
        _damage(store, sample)
    loader = make()
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        batches = list(loader)
    assert len(batches) == len(store) // batch_size and all(len(y) == batch_size for _, y in batches)
    assert f"sample {int(first[0])} cannot be decoded" in caplog.text
    after = (first + 1) % len(store)  # the samples after them, with their own labels
    assert not set(after.tolist()) & set(first.tolist())
    assert batches[0][1].tolist() == store.labels[after].tolist()
    assert torch.equal(next(iter(make()))[0], batches[0][0])  # deterministic
    with pytest.raises(DecodeError, match=f"sample {int(first[0])} cannot be decoded"):
        list(make(on_error="raise"))


def test_the_next_batch_is_started_before_this_one_is_finished(jpeg_store, monkeypatch):
    """The workers get batch k+1's share before batch k's GPU share is decoded; a batch started for an
    epoch left early is dropped when the next epoch starts, and batches are those made one by one."""
    want = [images for images, _ in gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, seed=4,
                                                   num_workers=0)]
    loader = gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, seed=4, num_workers=2,
                            prefetch=3)  # fewer than the epoch's 4 batches: one is left to start after them
    (batcher,) = loader.jpeg.pipelines
    sched, events = batcher.scheduler, []
    start, finish, drop = sched.start, sched.finish, sched.drop

    def record(name, call, first=lambda *a: None):
        def recorded(*args, **kwargs):
            events.append((name, first(*args)))
            return call(*args, **kwargs)
        return recorded

    monkeypatch.setattr(sched, "start", record("start", start, lambda batch, *_: len(batch)))
    monkeypatch.setattr(sched, "finish", record("finish", finish))
    monkeypatch.setattr(sched, "drop", record("drop", drop))
    got = [images for images, _ in loader]
    # the last batch starts the next epoch's first, whose first batches are then made ahead
    assert [name for name, _ in events][:9] == ["start", "start", "finish"] + ["start", "finish"] * 3
    assert len(got) == len(want) == 4 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    loader.carried.join()
    events.clear()
    loader.set_epoch(0)  # not the epoch carried into: its batches are dropped
    for _ in loader:  # leave after the first batch: the producer has started one or more after it
        break
    loader.load_state_dict(loader.state_dict())  # a new iter() would begin the next epoch: resume instead
    got = [images for images, _ in loader]  # the rest of the epoch
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want[1:], strict=True))
    loader.carried.join()
    # every batch started was finished or dropped, but the one started last (held for the epoch after);
    # the one held when the events were cleared was dropped
    names = [name for name, _ in events]
    assert names.count("start") == names.count("finish") + names.count("drop") and batcher._next is not None
    assert names.count("drop") >= 1
    loader.close()


def test_a_jpeg_store_is_made_further_ahead_by_default(jpeg_store):
    """A decoded batch's time varies more than a raw store's gather: jpeg stores get the deeper queue
    (raw stores 3, `tests/test_loader.py`), and `prefetch` given is kept."""
    jpeg = gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, num_workers=0)
    given = gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, num_workers=0, prefetch=1)
    assert (jpeg.prefetch, given.prefetch) == (PREFETCH, 1) and PREFETCH > 3
    jpeg.close()
    given.close()


def test_the_next_epochs_first_batches_are_made_as_an_epoch_ends(jpeg_store):
    """Iterating an epoch to its end leaves the next epoch's first `prefetch` batches made; the next
    epoch yields them (the batches a loader starting there makes), and an epoch other than the
    carried one drops them."""
    make = lambda: gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, seed=6,  # noqa: E731
                                  num_workers=0, prefetch=2)
    loader, fresh = make(), make()
    assert loader.carried is None and len(list(loader)) == 4
    carried = loader.carried
    carried.join()
    assert (carried.epoch, carried.start, carried.count, carried.items[0].qsize()) == (1, 0, 2, 2)
    fresh.set_epoch(1)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(loader, fresh, strict=True))  # epoch 1, from the carried ones
    assert loader.carried is not carried and loader.carried.epoch == 2
    loader.set_epoch(5)
    fresh.set_epoch(5)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(loader, fresh, strict=True)) and loader.carried.epoch == 6
    loader.close()
    assert loader.carried is None
    fresh.close()


def test_the_engines_buffers_are_made_for_a_batch_of_the_stores_images():
    from gpufeed.decode.scheduling import choice

    photos = np.array([[375, 500], [500, 375]] * 500)  # height, width
    assert choice.decoder_room(photos, 256) == (256, 512, 512)  # (images, width, height), up to 64
    wide = np.array([[300, 400]] * 995 + [[3000, 4000]] * 5)  # 0.5 % huge ones do not set the size
    assert choice.decoder_room(wide, 64) == (64, 448, 320)
    side = choice.ROOM_SIDE
    assert choice.decoder_room(np.array([[5000, 9000]] * 10), 8) == (8, side, side)
    assert choice.decoder_room(np.array([[5000, 9000]] * 10), 1024) == (choice.ROOM_PIXELS // side**2, side, side)
    assert choice.decoder_room(np.zeros((0, 2), np.int64), 8) is None


def test_a_jpeg_loader_is_made_and_crops_on_a_cpu_without_importing_torchvision(jpeg_store):
    """torchvision's import brings torch._dynamo's and sympy's: seconds before a first batch that never
    uses it (the GPU path's decoders and kernel are ours). The crops on a CPU (and with uint8 output,
    or without Triton) take torchvision's roi_align op alone: its import made a CPU Loader's first
    batch 2.2 s late on the development box, against 0.5 s."""
    import subprocess
    import sys

    code = ("import sys, gpufeed\n"
            "import gpufeed.decode.codecs.nvimgcodec, gpufeed.augment.fused, gpufeed.loader.jpeg_batch\n"
            "from gpufeed.augment import RandomResizedCrop\n"
            f"loader = gpufeed.Loader({str(jpeg_store.path)!r}, batch_size=8, device='cpu', augment=[RandomResizedCrop(24)])\n"
            "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))\n"
            "images, _ = next(iter(loader))\n"
            "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules), tuple(images.shape[1:]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "[] (3, 24, 24)"]


def test_the_box_pass_crops_as_torchvision_s_roi_align():
    """`pipeline.roi_align` is torchvision's op, loaded alone (before torchvision is imported): the same
    numbers as `torchvision.ops.roi_align`, imported after it."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from gpufeed.augment.pipeline import roi_align\n"
            "x = torch.rand(2, 3, 40, 50, generator=torch.Generator().manual_seed(0)) * 255\n"
            "rois = torch.tensor([[0, 1.5, 2.0, 30.0, 35.5], [1, -3.0, 0.0, 50.0, 40.0]])\n"
            "ours = roi_align()(x, rois, 1.0, 16, 24, -1, True)\n"
            "print('torchvision' in sys.modules)\n"
            "from torchvision.ops import roi_align as theirs\n"
            "print(torch.equal(ours, theirs(x, rois, (16, 24), spatial_scale=1.0, sampling_ratio=-1, aligned=True)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_an_image_loader_loads_neither_the_video_path_nor_the_buckets(jpeg_store):
    """A Loader of an image store on this disk imports the modules of video clips (PyAV's helpers,
    NVDEC's) and of a bucket's read-ahead only where it needs them: each import is time before
    the first batch (30 ms of the constructor's 157 on the development box)."""
    import subprocess
    import sys

    paths = ("gpufeed.loader.video", "gpufeed.decode.codecs.video", "gpufeed.decode.codecs.nvdec",
             "gpufeed.loader.inputs.video", "gpufeed.loader.inputs.remote", "gpufeed.store.readahead")
    code = ("import sys, gpufeed\n"
            "from gpufeed.augment import RandomResizedCrop\n"
            f"loader = gpufeed.Loader({str(jpeg_store.path)!r}, batch_size=8, device='cpu', augment=[RandomResizedCrop(24)])\n"
            "next(iter(loader))\n"
            f"print(sorted(m for m in {paths!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_default_workers_leave_the_training_loop_two_cores_or_an_eighth(monkeypatch):
    from gpufeed.loader import cores
    from gpufeed.loader.jpeg import default_workers

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(cores, "cgroup", lambda pid=0: None)  # no CPU quota
    for count, want in ((1, 1), (4, 2), (16, 14), (32, 28), (64, 56)):
        monkeypatch.setattr(cores, "affinity", lambda pid=0, n=count: set(range(n)))
        assert default_workers(gpu) == want and default_workers(cpu) == count


def _machine(monkeypatch, mine: int, launcher: int, local: int, quota: float | None = None, same_cgroup=True):
    """Fake what `cores.rank_cores` reads: this rank's affinity (CPUs 0..mine-1), its launcher's, the
    local ranks, and a CPU quota on the cgroup (shared with the launcher or not)."""
    from gpufeed.loader import cores

    monkeypatch.setattr(cores, "launcher", lambda: 4242)
    monkeypatch.setattr(cores, "affinity", lambda pid=0: set(range(launcher if pid == 4242 else mine)))
    monkeypatch.setattr(cores, "cgroup", lambda pid=0: "/job" if same_cgroup else f"/job/{pid}")
    monkeypatch.setattr(cores, "cpu_quota", lambda path: quota)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))


@pytest.mark.parametrize("mine, launcher, local, quota, same_cgroup, usable", [
    (64, 64, 2, None, True, 32),  # two ranks share the launcher's 64 cores: 32 each
    (32, 64, 2, None, True, 32),  # each bound to its own 32 (numactl, --bind): 32, not 16
    (16, 32, 2, None, True, 16),  # issue 46's H200 pair bound to 16 each: 16 (it was 8: 6 workers)
    (16, 64, 4, None, True, 16),  # four ranks bound to 16 each (it was 4: 2 workers)
    (32, 32, 1, None, True, 32),  # one rank, not under torchrun
    (64, 64, 2, 8.0, True, 4),  # a container's quota of 8 CPUs for its two ranks
    (64, 64, 1, 6.5, True, 6),  # one rank in a container of 6.5 CPUs
    (16, 64, 4, 12.0, False, 12),  # each rank in a cgroup of its own with 12 CPUs (a scheduler's task)
])
def test_a_ranks_cores_are_counted_once(monkeypatch, mine, launcher, local, quota, same_cgroup, usable):
    from gpufeed.loader.cores import rank_cores
    from gpufeed.loader.jpeg import default_workers

    _machine(monkeypatch, mine, launcher, local, quota, same_cgroup)
    assert rank_cores().usable == usable
    assert default_workers(torch.device("cuda")) == max(1, usable - max(2, usable // 8))
    assert str(usable) in rank_cores().describe()


def test_cgroup_quotas_are_read_from_v2_and_v1_files(tmp_path, monkeypatch):
    from gpufeed.loader import cores

    (tmp_path / "job" / "rank").mkdir(parents=True)
    (tmp_path / "job" / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "job" / "rank" / "cpu.max").write_text("max 100000\n")
    assert cores._quota_at(tmp_path / "job") == 4.0 and cores._quota_at(tmp_path / "job" / "rank") is None
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "v1" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores._quota_at(tmp_path / "v1") == 2.5
    (tmp_path / "v1" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cores._quota_at(tmp_path / "v1") is None


def test_a_store_none_of_whose_samples_decodes_is_one_clear_error(jpeg_store, tmp_path):
    """Every sample damaged: a DecodeError naming the store (it recursed, replacement within
    replacement, into a RecursionError)."""
    import shutil

    shutil.copytree(jpeg_store.path, tmp_path / "s")
    store = gpufeed.open(tmp_path / "s")
    for sample in range(len(store)):
        _damage(store, sample)
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=OPS, num_workers=0)
    with pytest.raises(DecodeError, match="the store looks damaged"):
        next(iter(loader))
    evaluation = gpufeed.Loader(store, batch_size=4, device="cpu", augment=OPS, num_workers=0, shuffle=False,
                                drop_last=False)
    assert list(evaluation) == [] and len(evaluation.skipped) == len(store)  # each left out, each named


def test_stats_say_how_the_loader_started(jpeg_store, tmp_path):
    """Seconds from the constructor's call: its return, each decode worker's Ready, the first batch
    (what a one-pass evaluation loses at its start, docs/benchmarks.md "Reading a folder in place")."""
    loader = gpufeed.Loader(jpeg_store, batch_size=12, device="cpu", augment=OPS, num_workers=2)
    start = loader.stats()["start"]
    assert "first_batch_s" not in start and start["gpu_decoders_in_use_s"] is None  # none yet; none on a CPU
    next(iter(loader))
    start = loader.stats()["start"]
    ready = start["workers_ready_s"]
    assert 0 < start["constructor_s"] <= start["first_pass_s"] <= start["first_plan_s"] <= start["first_batch_s"]
    # the constructor's own steps: the store open, then the decode pipelines made and the workers started
    assert 0 <= start["store_opened_s"] <= start["decoding_made_s"] <= start["constructor_s"]
    # the first batch's bytes in hand, then decoded, before it is handed over (where a cold bucket's went)
    assert start["first_pass_s"] <= start["first_read_s"] <= start["first_decoded_s"] <= start["first_batch_s"]
    assert ready and ready == sorted(ready) and len(ready) <= 2 and ready[0] <= start["first_batch_s"]
    for _ in loader:
        pass
    assert loader.stats()["start"]["first_batch_s"] == start["first_batch_s"]  # the loader's first, kept
    loader.close()
    gpufeed.pack(jpeg_store.path.parent / "src", tmp_path / "raw", mode="raw", size=24, workers=1, progress=False)
    plain = gpufeed.Loader(tmp_path / "raw", batch_size=12, device="cpu")
    next(iter(plain))
    assert set(plain.stats()["start"]) == {"store_opened_s", "constructor_s", "first_pass_s", "first_plan_s", "first_batch_s"}
    plain.close()


def test_a_batch_not_started_ahead_for_want_of_its_bytes_is_read_once():
    """Where the next batch's bytes are not there yet (a bucket's shard downloading), it is not started
    ahead, and the batch after it is not read ahead either: that read would be found first by the next
    batch's, thrown away and made again (each read of a bucket's batch holds its shards and counts its
    samples off the fetch ahead's list: twice, a shard still wanted left the list)."""
    from collections import deque
    from types import SimpleNamespace

    from gpufeed.loader.jpeg_batch import JpegBatcher, Upcoming

    class Source:  # a bucket's shards as the batcher sees them: 4 samples a batch, batch k in shard k
        reads_ahead, reads_in_part = True, False

        def __init__(self):
            self.reads, self.downloading = [], {1}

        def ready(self, indices):
            return int(indices[0]) // 4 not in self.downloading

        def read_later(self, indices, first=None):
            self.reads.append(int(indices[0]) // 4)
            return lambda: SimpleNamespace(ends=np.ones(len(indices)), begins=np.zeros(len(indices)))

    batcher = JpegBatcher.__new__(JpegBatcher)  # the reading ahead alone, without decoders
    batcher.images, batcher._reads, batcher._next = Source(), deque(), None
    batcher._shapes = np.ones((40, 2), np.int64)
    batcher.counters = SimpleNamespace(add=lambda *a: None, mark=lambda *a: None)
    batcher.scheduler = SimpleNamespace(start=lambda batch, shapes, boxes, *a: SimpleNamespace(boxes=boxes),
                                        drop=lambda started: None)
    params = SimpleNamespace(boxes=torch.zeros(4, 4), out_hw=(8, 8))
    for k in range(3):  # what making batch k does before its decoders finish
        batcher._started(np.arange(4 * k, 4 * k + 4), params)
        batcher._start_ahead(tuple(Upcoming(torch.arange(4 * j, 4 * j + 4), params) for j in (k + 1, k + 2)), None)
        batcher.images.downloading.clear()  # batch 1's shard came in while batch 0 finished
    assert batcher.images.reads == [0, 1, 2, 3, 4]
