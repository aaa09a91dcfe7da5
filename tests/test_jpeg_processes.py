"""JPEG pipelines in processes of their own (`decode_processes`), on CPU: the same batches as in the
loader's process, warnings and errors brought back, a dead process named."""

from __future__ import annotations

import logging
import os
import shutil
import signal

import pytest
import torch

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.loader.jpeg import DecodeError
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
    assert loader.stats()["decoded_by"]["failed"] == 2 and any("undecodable" in n for n in loader.stats()["notes"])
    strict = loaders(store, shuffle=False, on_error="raise")
    with pytest.raises(DecodeError, match="sample 7 cannot be decoded"):
        list(strict)


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
