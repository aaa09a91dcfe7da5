"""The Loader on CPU tensors: same pipeline as on the GPU, checked against the store."""

from __future__ import annotations

import threading

import pytest
import torch
from torchvision.transforms.v2 import functional as F

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from loader_checks import check_resume, check_uint8_batches, make_store

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("loader"))


@pytest.mark.parametrize("cache", ["disk", "host"])
def test_uint8_batches_equal_the_store(store, cache):
    loader = gpufeed.Loader(store, batch_size=16, device="cpu", cache=cache, seed=3)
    assert loader.tier.name == cache and len(loader) == 6 and loader.prefetch == 3  # a raw store's default
    seen = check_uint8_batches(loader)
    assert sorted(seen) == list(range(96))


def test_augmented_batch_equals_torchvision_reference(store):
    ops = [RandomResizedCrop(40, scale=(0.3, 1)), RandomHorizontalFlip(), Normalize(MEAN, STD)]
    loader = gpufeed.Loader(store, batch_size=16, device="cpu", augment=ops, dtype=torch.float32, seed=1)
    images, labels = next(iter(loader))
    idx, params = loader.plan(0, 0)
    assert images.shape == (16, 3, 40, 40) and images.dtype == torch.float32
    for k, i in enumerate(idx.tolist()):
        image, label = store[i]
        left, top, right, bottom = (int(round(v)) for v in params.boxes[k].tolist())
        ref = F.resized_crop(image.float(), top, left, bottom - top, right - left, [40, 40], antialias=True)
        ref = ref.flip(-1) if params.flip[k] else ref
        ref = (ref / 255 - 0.5) / 0.25
        assert labels[k] == label
        assert (images[k] - ref).abs().mean() < 1.0 / 255 / 0.25


def test_ranks_get_disjoint_equal_shards(store):
    loaders = [gpufeed.Loader(store, batch_size=8, device="cpu", rank=r, world_size=3) for r in range(3)]
    assert len({len(x) for x in loaders}) == 1
    seen = [check_uint8_batches(x) for x in loaders]
    assert sorted(i for s in seen for i in s) == list(range(96))


def test_epochs_reshuffle_and_are_reproducible(store):
    a = gpufeed.Loader(store, batch_size=32, device="cpu", seed=7)
    b = gpufeed.Loader(store, batch_size=32, device="cpu", seed=7)
    first = [y.tolist() for _, y in a]
    assert a.epoch == 1 and a.state_dict()["batch"] == 0
    second = [y.tolist() for _, y in a]
    assert [y.tolist() for _, y in b] == first
    assert a.plan(0, 0)[0].tolist() != a.plan(1, 0)[0].tolist()
    b.set_epoch(1)
    assert [y.tolist() for _, y in b] == second


@pytest.mark.parametrize("augment", [None, [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize()]])
def test_resume_mid_epoch_yields_exactly_the_rest(store, augment):
    make = lambda: gpufeed.Loader(store, batch_size=16, device="cpu", augment=augment, seed=2)  # noqa: E731
    check_resume(make, [0, 1, 3, 5])


def test_breaking_out_stops_the_producer(store):
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", prefetch=2)
    for _ in range(3):
        for k, _batch in enumerate(loader):
            if k == 1:
                break
    state = loader.state_dict()
    assert (state["epoch"], state["batch"]) == (2, 2)  # each loop a new pass over the next epoch
    assert not [t for t in threading.enumerate() if t.name == "gpufeed-producer"]


def test_close_stops_the_pools(store, tmp_path):
    with gpufeed.Loader(store, batch_size=8, device="cpu", gather_threads=2) as loader:
        for _ in loader:
            pass
        threads = list(loader.gather._pool._threads)
    assert threads and not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="was closed"):  # said at once, not by a stopped pool
        iter(loader).__next__()


def test_channels_last_and_dtypes(store):
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", channels_last=True)
    images, _ = next(iter(loader))
    assert images.dtype == torch.uint8 and images.is_contiguous(memory_format=torch.channels_last)
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=[Normalize()], dtype=torch.bfloat16)
    assert next(iter(loader))[0].dtype == torch.bfloat16


def test_clear_errors(store, tmp_path):
    with pytest.raises(ValueError, match="not a valid torch device"):
        gpufeed.Loader(store, device="gpu0")
    with pytest.raises(ValueError, match="runs on 'cuda' or 'cpu'"):
        gpufeed.Loader(store, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            gpufeed.Loader(store, device="cuda")
    with pytest.raises(ValueError, match="larger than this rank's shard"):
        gpufeed.Loader(store, batch_size=64, device="cpu", world_size=2, rank=0)
    with pytest.raises(ValueError, match="cache must be one of"):
        gpufeed.Loader(store, batch_size=8, device="cpu", cache="ssd")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        gpufeed.Loader(store, batch_size=8, device="cpu", cache="gpu")
    other = gpufeed.Loader(store, batch_size=8, device="cpu", seed=1)
    with pytest.raises(ValueError, match="seed"):
        gpufeed.Loader(store, batch_size=8, device="cpu", seed=0).load_state_dict(other.state_dict())


def test_jpeg_and_damaged_stores_are_refused(store, tmp_path):
    gpufeed.pack(store.manifest.settings["source"], tmp_path / "j", mode="jpeg", workers=1, progress=False)
    with gpufeed.Loader(tmp_path / "j", batch_size=4, device="cpu") as one_size:  # needs no augment (issue 63)
        assert next(iter(one_size))[0].shape == (4, 3, 32, 32)
    import shutil

    shutil.copytree(store.path, tmp_path / "cut")
    with open(tmp_path / "cut" / "images.u8", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(gpufeed.StoreError, match="bytes on disk"):
        gpufeed.Loader(tmp_path / "cut", device="cpu")


def test_a_step_waiting_for_an_epoch_s_plan_runs_once_it_is_made_never_for_one_that_failed(caplog):
    """`Planner.when_made` (a remote store's next epoch, fetched ahead once planned): the step runs on
    the planner thread when the plan is made, at once where it is made; not where planning failed
    (that error is raised where the plan is asked for); a step that raises is logged, not lost."""
    from gpufeed.loader.planner import _Ahead

    gate, calls, ran = threading.Event(), [], threading.Event()

    def plan(epoch):
        assert gate.wait(30)
        if epoch == 2:
            raise ValueError("no plan")
        return f"plan {epoch}"

    def broken(plan):
        raise RuntimeError("a broken step")

    made, failed = _Ahead(plan, 1), _Ahead(plan, 2)
    for ahead in (made, failed):
        ahead.then(calls.append)
        ahead.then(broken)
        ahead.then(lambda plan: ran.set())
    assert calls == []
    gate.set()
    assert ran.wait(30) and made.result() == "plan 1"
    with pytest.raises(ValueError, match="no plan"):
        failed.result()
    made.then(calls.append)  # made already: at once, here
    assert calls == ["plan 1", "plan 1"]
    logged = [r.getMessage() for r in caplog.records if r.name == "gpufeed.loader.planner"]
    assert logged == ["gpufeed: a step waiting for epoch 1's plan failed"]
    gate.clear()
    dropped = _Ahead(plan, 3)
    dropped.then(calls.append)
    dropping = threading.Thread(target=dropped.drop)  # (a resume forgot it, or the planner closed)
    dropping.start()
    while dropped._then is not None:  # dropped: it waits for the plan and its steps to be over
        dropping.join(0.01)
    gate.set()
    dropping.join(30)
    dropped.then(calls.append)
    assert not dropping.is_alive() and dropped.result() == "plan 3" and calls == ["plan 1", "plan 1"]


def test_epochs_are_planned_ahead_on_threads_with_the_same_plan(store):
    """No planning process (a fork of a threaded process is unsafe, and the child outlived a killed
    parent): the next epochs are planned on daemon threads, and give the plan made in place."""
    with gpufeed.Loader(store, batch_size=8, device="cpu", augment=[Normalize()], dtype=torch.float32) as loader:
        first = [y for _, y in loader]
        assert sorted(loader._planner._ahead) == [1, 2]
        assert all(t.daemon for t in threading.enumerate() if t.name == "gpufeed-planner")
        second = [y for _, y in loader]
    with gpufeed.Loader(store, batch_size=8, device="cpu", augment=[Normalize()], dtype=torch.float32) as fresh:
        fresh.set_epoch(1)
        again = [y for _, y in fresh]
    assert len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(second, again))


def test_the_first_epoch_is_planned_while_the_loader_starts(store):
    """The first pass's plan is made on a planner thread from the constructor on (made at the pass's
    start, it held up a bucket's first downloads), the plan made in place; one never asked for (the
    user's `set_epoch` came first) is dropped at the next pass, its thread ended."""
    with gpufeed.Loader(store, batch_size=8, device="cpu", augment=[Normalize()], dtype=torch.float32) as loader:
        ahead = loader._planner._ahead[0]
        made = ahead.result()
        assert loader._planner.ready(0) is made and torch.equal(made.indices, loader._planner.now(0).indices)
        assert len([y for _, y in loader]) == len(loader) and loader._planner._current == (0, made)
    with gpufeed.Loader(store, batch_size=8, device="cpu") as loader:
        unasked = loader._planner._ahead[0]
        loader.set_epoch(3)
        assert len([y for _, y in loader]) == len(loader)
        assert sorted(loader._planner._ahead) == [4, 5] and unasked._then is None and unasked._settled.is_set()


def test_a_batch_is_not_sorted_by_sample_or_class(tmp_path):
    """Samples within a batch come in the epoch's seeded random order: an ImageFolder store's labels
    follow its sorted files, so sorted indices would give class-sorted batches."""
    from conftest import save, pixels

    for i in range(64):
        save(tmp_path / "src" / f"c{i // 16}" / f"{i:03d}.png", pixels(i, 8, 8))
    gpufeed.pack(tmp_path / "src", tmp_path / "s", size=8, workers=1, progress=False)
    loader = gpufeed.Loader(tmp_path / "s", batch_size=32, device="cpu", seed=3)
    batches = [(loader.plan(0, b)[0], labels) for b, (_, labels) in enumerate(loader)]
    assert all(not torch.equal(idx, idx.sort().values) for idx, _ in batches)
    assert all(not torch.equal(labels, labels.sort().values) for _, labels in batches)
    again = gpufeed.Loader(tmp_path / "s", batch_size=32, device="cpu", seed=3)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(batches, again))  # the order is the plan's


def test_load_state_dict_refuses_what_no_loader_of_this_shape_wrote(store):
    loader = gpufeed.Loader(store, batch_size=16, device="cpu", rank=1, world_size=2)
    good = loader.state_dict()
    for bad, why in [({**good, "batch": -1}, "batch=-1"), ({**good, "epoch": -2}, "epoch=-2"),
                     ({**good, "batch": 99}, "past the"), ({**good, "batch": 1.5}, "not an int"),
                     ({**good, "seed": 5}, "seed=5"), ({**good, "world_size": 0}, "world_size=0"),
                     ({**good, "segments": [[2]]}, "segments="), ({"epoch": 0}, "not a gpufeed.Loader state_dict")]:
        with pytest.raises(ValueError, match=why):
            loader.load_state_dict(bad)
    loader.load_state_dict({**good, "batch": 2})
    assert len(list(loader)) == len(loader) - 2


def _ranks(store, world, **kw):
    return [gpufeed.Loader(store, batch_size=4, device="cpu", rank=r, world_size=world, **kw) for r in range(world)]


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (2, 1), (1, 4)])
def test_a_job_resumed_at_another_world_size_covers_exactly_the_rest(store, before, after):
    """The state is the job's (the same on every rank); at W' it continues with what no rank had yielded,
    each sample once with pad=False, and then the next epoch whole (issue 48)."""
    first = _ranks(store, before, shuffle=True, seed=3, drop_last=False, pad=False)
    seen, states = [], []
    for loader in first:
        it = iter(loader)
        for number in range(3):
            next(it)
            seen += loader.plan(0, number)[0].tolist()
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)
    second = _ranks(store, after, shuffle=True, seed=3, drop_last=False, pad=False)
    rest = []
    for loader in second:
        loader.load_state_dict(states[1 % len(states)])
        for number, _ in enumerate(loader):
            rest += loader.plan(0, number)[0].tolist()
        assert loader.epoch == 1 and loader.state_dict()["segments"] == []
    assert sorted(seen + rest) == list(range(96))
    # a second resume in the same epoch, at yet another world size, still covers the rest exactly
    third = _ranks(store, 2, shuffle=True, seed=3, drop_last=False, pad=False)
    again = []
    for loader in third:
        loader.load_state_dict(states[0])
        it = iter(loader)
        next(it)
        again += loader.plan(0, loader.state_dict()["batch"] - 1)[0].tolist()  # the batch just yielded
        mid = loader.state_dict()
    assert mid["segments"] == ([] if before == 2 else [[before, 3]])
    fourth = _ranks(store, 3, shuffle=True, seed=3, drop_last=False, pad=False)
    tail = []
    for loader in fourth:
        loader.load_state_dict(mid)
        for number, _ in enumerate(loader):
            tail += loader.plan(0, number)[0].tolist()
    assert sorted(seen + again + tail) == list(range(96))


def test_a_resume_at_the_same_world_size_replays_the_same_batches(store):
    loaders = _ranks(store, 2, shuffle=True, seed=5, augment=[RandomResizedCrop(16)])
    it = iter(loaders[1])
    next(it)
    state = loaders[1].state_dict()
    rest = [images for images, _ in it]
    resumed = _ranks(store, 2, shuffle=True, seed=5, augment=[RandomResizedCrop(16)])[1]
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, (b, _) in zip(rest, resumed, strict=True))


def test_close_returns_once_its_threads_ended_and_a_waiting_consumer_is_told(store):
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", cache="disk", prefetch=1)
    it = iter(loader)
    next(it)
    loader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(("gpufeed-producer", "gpufeed-planner"))]
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_a_consumer_waiting_on_another_thread_when_the_loader_closes_is_woken(store, monkeypatch):
    """A producer stopped by close() leaves its consumer a word instead of nothing to wait for."""
    import time

    from gpufeed.loader import feeds

    loader = gpufeed.Loader(store, batch_size=8, device="cpu", cache="disk", prefetch=1)
    made = []
    make = feeds.gather_copy

    def slow(*args):  # the second batch is finished only once the loader is closing: it is never put
        if made:
            while not loader._closed:
                time.sleep(0.01)
            time.sleep(0.2)
        made.append(1)
        return make(*args)

    monkeypatch.setattr(feeds, "gather_copy", slow)
    it = iter(loader)
    next(it)
    outcome = []

    def consume():
        try:
            next(it)
            outcome.append("a batch")
        except RuntimeError as e:
            outcome.append(str(e))

    waiter = threading.Thread(target=consume, daemon=True)
    waiter.start()
    time.sleep(0.2)
    loader.close()
    waiter.join(10)
    assert not waiter.is_alive(), "the consumer still waits for a batch nobody makes"
    assert "closed" in outcome[0]


def test_a_store_cut_short_before_a_pass_is_a_store_error(tmp_path):
    import os

    from gpufeed.store.format import StoreError

    path = make_store(tmp_path).path
    loader = gpufeed.Loader(path, batch_size=16, device="cpu", cache="disk")
    os.truncate(path / "images.u8", 100)
    with pytest.raises(StoreError, match="changed while read"):
        next(iter(loader))


def test_cuda_asked_for_without_cuda_says_how_to_run_on_the_cpu(store, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match='device="cpu"'):
        gpufeed.Loader(store, batch_size=16, device="cuda")
