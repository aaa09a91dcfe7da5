"""JPEG pipelines in processes of their own (`decode_processes`), on CPU: the same batches as in the
loader's process, warnings and errors brought back, a dead process named."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.loader.jpeg import DecodeError
from gpufeed.loader.sampler import ShardedBatchSampler
from loader_checks import check_resume
from test_jpeg_loader import _damage, jpeg_store  # noqa: F401 (a fixture)

OPS = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip(), Normalize((0.5,) * 3, (0.25,) * 3)]


@pytest.fixture
def loaders():
    """Makes loaders with pipeline processes and closes them after the test."""
    made = []

    def make(store, **kw):
        kw = {"batch_size": 8, "device": "cpu", "augment": OPS, "decode_processes": 2, "decode_workers": 2} | kw
        made.append(gpufeed.Loader(store, **kw))
        return made[-1]

    yield make
    for loader in made:
        loader.close()


def test_same_batches_as_in_process_across_epochs_and_an_abandoned_one(jpeg_store, loaders):  # noqa: F811
    here = loaders(jpeg_store, seed=4, decode_processes=0)
    there = loaders(jpeg_store, seed=4, decode_pipelines=2)
    assert there.procs is not None and there.stats()["decoders"] == ["cpu"]
    it = iter(there)
    next(it)
    it.close()  # batches asked for by the abandoned iteration must not leak into the next epoch
    there.set_epoch(0)
    for _ in range(2):
        pairs = list(zip(here, there))
        assert len(pairs) == 6
        for (a, ya), (b, yb) in pairs:
            assert torch.equal(a, b) and torch.equal(ya, yb)
    stats = there.stats()
    assert stats["decoded_by"]["cpu"] >= 2 * 48 and stats["seconds"]["decode"] > 0
    assert stats["seconds"]["idle"] > 0 and stats["seconds"]["handoff"] > 0  # a process's pipelines' own stages


def test_next_epoch_asked_for_early_kept_or_dropped(jpeg_store, loaders):  # noqa: F811
    here = loaders(jpeg_store, seed=4, decode_processes=0)
    there = loaders(jpeg_store, seed=4)
    assert len(list(there)) == 6
    assert there.procs._ahead.pending[0] == (1, 0)  # epoch 1's first batches are on their way
    for epoch in (1, 3):  # 1 goes on where epoch 0's look-ahead left off, 3 drops it
        here.set_epoch(epoch)
        there.set_epoch(epoch)
        pairs = list(zip(here, there))
        assert len(pairs) == 6 and all(torch.equal(a, b) and torch.equal(ya, yb) for (a, ya), (b, yb) in pairs)


def test_left_late_in_an_epoch_and_resumed(jpeg_store, loaders):  # noqa: F811
    here = loaders(jpeg_store, seed=5, decode_processes=0)
    there = loaders(jpeg_store, seed=5)
    it = iter(there)
    for _ in range(5):
        next(it)
    it.close()  # epoch 1's batches are asked for already; the resumed epoch 0 must not ask for them again
    assert there.procs._ahead.pending[1][0] == 1
    want = [b for _, b in zip(range(5), here)] and list(here) + list(here) + list(here)
    got = list(there)
    pending = list(there.procs._ahead.pending)
    assert pending == [(1, k) for k in range(len(pending))]  # each of epoch 1's batches asked for once
    got += list(there) + list(there)
    assert len(got) == len(want) == 13
    assert all(torch.equal(a, b) and torch.equal(ya, yb) for (a, ya), (b, yb) in zip(want, got))


def test_resume_with_processes(jpeg_store, loaders):  # noqa: F811
    check_resume(lambda: loaders(jpeg_store, seed=1, decode_pipelines=1), [0, 3])


def test_corrupt_sample_warned_once_from_a_process_or_raised(jpeg_store, tmp_path, loaders, caplog):  # noqa: F811
    shutil.copytree(jpeg_store.path, tmp_path / "s")
    store = gpufeed.open(tmp_path / "s")
    _damage(store, 7)
    loader = loaders(store, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        batches = [list(loader) for _ in range(2)]
    assert all(len(y) == 8 for epoch in batches for _, y in epoch)
    assert caplog.text.count("sample 7 cannot be decoded") == 1
    stats = loader.stats()  # the first batch of epoch 2 may have been decoded ahead, and counted, too
    assert stats["decoded_by"]["failed"] in (2, 3) and any("undecodable" in n for n in stats["notes"])
    strict = loaders(store, shuffle=False, on_error="raise")
    with pytest.raises(DecodeError, match="sample 7 cannot be decoded"):
        list(strict)


def test_a_failed_batch_raises_when_it_is_due(jpeg_store, tmp_path, loaders):  # noqa: F811
    # batches of 9 of 48 samples leave 3 out of each epoch: a sample left out of epoch 0 and in the
    # first batch of epoch 1 fails in epoch 1 only, though that batch is asked for (and fails) during
    # epoch 0. Process 0, which has epoch 0's first batch, is held for a second: meanwhile the loader
    # reads every reply of process 1, epoch 1's failed first batch among them
    seed, sample = next((seed, int(np.setdiff1d(first, np.concatenate(epoch0))[0])) for seed in range(200)
                        for epoch0, first in [_batches(len(jpeg_store), seed)]
                        if len(np.setdiff1d(first, np.concatenate(epoch0))))
    shutil.copytree(jpeg_store.path, tmp_path / "s")
    store = gpufeed.open(tmp_path / "s")
    _damage(store, sample)
    loader = loaders(store, seed=seed, batch_size=9, on_error="raise", decode_pipelines=1)
    held = loader.procs._procs[0].pid
    os.kill(held, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (held, signal.SIGCONT)).start()
    assert len(list(loader)) == 5
    with pytest.raises(DecodeError, match=f"sample {sample} cannot be decoded"):
        next(iter(loader))


def _batches(samples: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The batches of epoch 0 and the first of epoch 1 of a test loader's sampler (batches of 9)."""
    sampler = ShardedBatchSampler(samples, 9, shuffle=True, seed=seed, rank=0, world_size=1, drop_last=True)
    return [b.numpy() for b in sampler.batches(0)], sampler.batches(1)[0].numpy()


def test_dead_process_is_named(jpeg_store, loaders):  # noqa: F811
    loader = loaders(jpeg_store, decode_processes=1)
    os.kill(loader.procs._procs[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"JPEG pipeline process 0 \(pid \d+\) exited with code -9"):
        list(loader)


def test_bad_process_count(jpeg_store):  # noqa: F811
    for bad in (-1, "2"):
        with pytest.raises(ValueError, match=f"decode_processes must be an int, 0 or more, got {bad!r}"):
            gpufeed.Loader(jpeg_store, batch_size=8, device="cpu", augment=OPS, decode_processes=bad)


def test_unavailable_processes_fall_back_to_the_in_process_defaults(jpeg_store, loaders, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setattr("gpufeed.loader.procs.unavailable", lambda: "no forkserver here")
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        loader = loaders(jpeg_store, seed=4, decode_workers=None)
    assert "JPEG pipeline processes unavailable (no forkserver here)" in caplog.text
    assert loader.procs is None and len(loader.jpeg) == 1  # a CPU device's in-process default, not 2 per process
    assert sum(len(y) for _, y in loader) == 48


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU the reason is what is tested")
def test_sleeping_waits_say_why_they_cannot_be_set_without_a_gpu():
    from gpufeed.loader.pipeline_process import _sleeping_waits

    why = _sleeping_waits(torch.device("cuda", 0))
    assert isinstance(why, str) and ("no CUDA driver library" in why or "CUDA error" in why), why
