"""The decode workers are the process's, not a loader's (`decode.pool.shared`): a second Loader takes
the running ones (no new process, no start), loaders beside each other each get their own pixels,
a loader gone with shares in flight leaves the next one its own rows, and the workers end once no
loader has held them for `IDLE_SECONDS`."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from conftest import decoded, save, smooth
from gpufeed.augment import Normalize, RandomResizedCrop
from gpufeed.decode.base import Encoded, as_tensor
from gpufeed.decode.pool import shared, worker
from gpufeed.decode.pool.segment import Segment
from gpufeed.decode.pool.workers import DecodeWorkers
from gpufeed.synth import natural_image

CPU = torch.device("cpu")
OPS = [RandomResizedCrop(20, scale=(0.4, 1)), Normalize()]


def _pack(root, n, seed):
    for i in range(n):
        save(root / "src" / f"c{i % 2}" / f"{i:03d}.png", smooth(i + seed, 40 + i, 56))
    gpufeed.pack(root / "src", root / "store", mode="jpeg", quality=92, workers=1, progress=False)
    return root / "store"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    folder = root / "folder"
    rng = np.random.default_rng(5)
    for k in range(10):
        path = folder / f"c{k % 2}" / f"{k:02d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(natural_image(rng, 30 + k, 40, k)).save(path, quality=90)
    return _pack(root / "a", 12, 0), _pack(root / "b", 9, 50), folder


@pytest.fixture(autouse=True)
def no_idle_workers():
    gc.collect()  # a loader an earlier test left in a reference cycle gives its pool back now
    shared.stop_idle()  # each test starts from no running workers, and leaves none
    yield
    shared.stop_idle()


def _loader(path, workers, **kw):
    return gpufeed.Loader(path, batch_size=4, device="cpu", augment=OPS, num_workers=workers, seed=7,
                          fields=("label",), **kw)


def _batches(loader) -> list[dict]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])


def test_a_second_loader_takes_the_running_workers_and_each_gets_its_own_pixels(stores):
    """A training Loader over one store and an evaluation Loader over another store and over a folder
    read in place, made while it lives and iterated in turns with it: the same worker processes
    serve all three (none started after the first), and every batch is what threads decode."""
    a, b, folder = stores
    want = {p: _batches(_loader(p, 0)) for p in (a, b, folder)}
    train = _loader(a, 2)
    it = iter(train)
    got_a = [next(it)]
    pids = sorted(train.jpeg.workers.pids)
    assert not train.stats()["workers_reused"]
    for other in (b, folder):
        evaluation = _loader(other, 2)
        assert sorted(evaluation.jpeg.workers.pids) == pids and evaluation.stats()["workers_reused"]
        got, ev = [], iter(evaluation)
        for batch in ev:  # in turns with the training loader's batches
            got.append({k: v.clone() for k, v in batch.items()})
            got_a += [next(it)] if len(got_a) < len(want[a]) else []
        _same(got, want[other])
        del evaluation, ev
    got_a += list(it)
    _same([{k: v.clone() for k, v in x.items()} for x in got_a], want[a])
    del train, it
    again = _loader(b, 2)  # the last loader gone, a new one within IDLE_SECONDS: still the same workers
    assert sorted(again.jpeg.workers.pids) == pids and again.stats()["workers_reused"]
    _same(_batches(again), want[b])
    other_count = _loader(b, 1)  # another worker count is another pool
    assert not set(other_count.jpeg.workers.pids) & set(pids)


def test_no_worker_outlives_the_idle_time_after_the_last_loader(stores, monkeypatch):
    monkeypatch.setattr(shared, "IDLE_SECONDS", 0.3)
    loader = _loader(stores[0], 2)
    assert len(_batches(loader)) == 3
    procs = [w.proc for w in loader.jpeg.workers._workers]
    pool = loader.jpeg.workers._pool
    second = _loader(stores[1], 2)
    del loader
    gc.collect()
    time.sleep(0.6)  # a loader still holds them
    assert [p.poll() for p in procs] == [None, None]
    del second
    gc.collect()
    assert [p.wait(timeout=10) for p in procs] == [0, 0]
    assert pool not in shared._pools.values()  # (a pool of another test's loader may still be idle)


def test_a_worker_gone_makes_the_next_loader_start_new_ones(stores):
    loader = _loader(stores[0], 2)
    assert len(_batches(loader)) == 3
    pids = loader.jpeg.workers.pids
    os.kill(pids[0], signal.SIGKILL)
    loader.jpeg.workers._workers[0].proc.wait()
    fresh = _loader(stores[1], 2)
    assert not set(fresh.jpeg.workers.pids) & set(pids) and not fresh.stats()["workers_reused"]
    _same(_batches(fresh), _batches(_loader(stores[1], 0)))


def _inputs(store, idx):
    idx = np.array(list(idx))
    return Encoded.of(as_tensor(store.data), np.asarray(store.offsets), idx), np.asarray(store.shapes)[idx]


def test_a_loader_gone_with_shares_in_flight_leaves_their_rows_taken_until_answered(stores):
    """Its tickets still in the pipe (the workers stopped), a loader closes: its rows stay taken, so the
    next loader's share goes to other rows (an answer meant for the old share would land in it), and
    once the workers answered, the rows are free again and the next share gets its own pixels."""
    a, b = gpufeed.open(stores[0]), gpufeed.open(stores[1])
    first = DecodeWorkers(a.data, 2)
    assert first.wait_ready(60)
    pids = first.pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        old = first.submit(*_inputs(a, range(12)))
        first.close()
        second = DecodeWorkers(b.data, 2)
        assert second.pids == pids
        inputs = _inputs(b, range(9))
        job = second.submit(*inputs)
        assert job.start >= old.start + 12 or job.start + 9 <= old.start
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    got = second.collect(job, CPU, pin=False)
    images = [got.base[o : o + h * w * 3].view(h, w, 3).permute(2, 0, 1)
              for o, (h, w) in zip(got.offsets.tolist(), got.sizes.tolist())]
    assert all(torch.equal(x, decoded(d)) for x, d in zip(images, inputs[0].tensors()))
    deadline = time.monotonic() + 30
    while old.pending and time.monotonic() < deadline:
        second._poll(0.05)
    third = second.submit(*_inputs(b, range(3)))  # the old share's rows are given back
    assert third.start == 0
    second.collect(third, CPU, pin=False)
    second.close()


def test_a_worker_lets_go_of_what_the_loader_closed(monkeypatch):
    """A worker maps each loader's source and segments once; one the loader closed (its memfd's fd
    gone, or reused for another file) is let go at the next ticket, so a gone loader's memory is
    freed."""
    monkeypatch.setattr(worker.Maps, "PRUNE", 0.0)
    maps = worker.Maps(os.getpid())  # this process plays the loader
    kept, dropped = Segment(64, CPU), Segment(64, CPU)
    for s in (kept, dropped):
        s.tensor.fill_(s.id % 200)
        assert maps.get(s.fd, s.id, 64, worker._pixels)[0] == s.id % 200
    fd = dropped.fd
    dropped.close()
    reused = Segment(64, CPU)  # may take the closed one's fd number
    maps.prune()
    assert set(maps._mapped) == {kept.fd}  # (`fd` gone, or naming `reused`'s memfd now)
    reused.tensor.fill_(3)
    assert maps.get(reused.fd, reused.id, 64, worker._pixels)[0] == 3
    kept.close()
    reused.close()


def test_a_row_naming_a_closed_fd_now_given_to_another_memfd_fails_instead_of_reading_it():
    """A row's memfd is checked by its inode: where the loader closed it and the fd number went to
    another memfd (another loader's source or segment), the worker's open fails the row."""
    maps = worker.Maps(os.getpid())
    gone = Segment(64, CPU)
    fd, inode = gone.fd, gone.id
    gone.close()
    other = Segment(64, CPU)  # takes the lowest free fd: the closed one's
    assert other.fd == fd and other.id != inode
    with pytest.raises(OSError, match="names another file"):
        maps.get(fd, inode, 64, worker._pixels)
    other.close()


def test_no_share_is_posted_once_its_loader_gave_the_workers_back(stores):
    """A producer still running as its loader closes gets WorkersStopped for its next share, not rows
    on the board that name the loader's closed files."""
    from gpufeed.decode.base import WorkersStopped

    a = gpufeed.open(stores[0])
    workers = DecodeWorkers(a.data, 2)
    assert workers.wait_ready(60)
    workers._pool.leave(workers.tally)  # what close() does first, from another thread
    with pytest.raises(WorkersStopped):
        workers.submit(*_inputs(a, range(4)))
    assert not workers._pool.holds(workers.tally)
    workers.close()


def test_relative_paths_are_read_where_each_loader_was_made(stores, tmp_path, monkeypatch):
    """Workers started for a loader in one working folder serve a loader made in another: a store and a
    folder named by relative paths are read from where their loader's process was when it was made
    (before, each loader's workers started there; the README's bucket example failed so)."""
    a, b, folder = stores
    want = {name: _batches(_loader(path, 0)) for name, path in (("b", b), ("folder", folder))}
    monkeypatch.chdir(a.parent)
    first = _loader(a.name, 2)
    assert len(_batches(first)) == 3
    for name, path in (("b", b), ("folder", folder)):
        monkeypatch.chdir(path.parent)
        again = _loader(path.name, 2)
        assert again.stats()["workers_reused"]
        _same(_batches(again), want[name])


def test_two_loaders_decode_on_the_same_workers_at_once_from_two_threads(stores):
    """A training loader and an evaluation loader each submit and collect their own shares from a
    thread of their own at the same time: every reply goes to its own share, pixels and all."""
    import threading

    a, b = gpufeed.open(stores[0]), gpufeed.open(stores[1])
    clients = [DecodeWorkers(a.data, 2), DecodeWorkers(b.data, 2)]
    assert clients[0].pids == clients[1].pids
    failures: list = []

    def run(client, store, idx):
        try:
            for _ in range(6):
                inputs = _inputs(store, idx)
                got = client.collect(client.submit(*inputs), CPU, pin=False)
                images = [got.base[o : o + h * w * 3].view(h, w, 3).permute(2, 0, 1)
                          for o, (h, w) in zip(got.offsets.tolist(), got.sizes.tolist())]
                assert got.failed == {} and all(torch.equal(x, decoded(d)) for x, d in zip(images, inputs[0].tensors()))
        except BaseException as e:  # reported by the test's thread
            failures.append(e)

    threads = [threading.Thread(target=run, args=args) for args in
               ((clients[0], a, range(12)), (clients[1], b, range(9)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and not any(t.is_alive() for t in threads), failures
    for client in clients:
        client.close()


def test_a_folder_loader_starts_its_workers_before_it_indexes_the_folder(stores, monkeypatch, tmp_path):
    """A Loader of a folder read in place starts its decode workers first, so that their start runs
    beside the folder's listing and index (seconds for a large folder) instead of after it, then takes
    that very pool; one whose folder can't be read leaves the pool to its idle time."""
    from gpufeed.loader import folder as folder_module

    _, _, folder = stores
    folder_module.FolderStore(folder)  # (its index cached: a cold one is read by processes of its own)
    seen = []
    real = folder_module._list
    monkeypatch.setattr(folder_module, "_list", lambda source, **kw: seen.append(dict(shared._pools)) or real(source, **kw))
    loader = _loader(folder, 2)
    assert len(seen) == 1 and list(seen[0]) == [2]  # started before the listing
    assert loader.jpeg.workers._pool is seen[0][2] and seen[0][2].users == 1  # and taken, the same pool
    assert len(_batches(loader)) > 0
    del loader
    gc.collect()
    gone = shutil.copytree(folder, tmp_path / "gone")
    folder_module.FolderStore(gone)
    for path in gone.rglob("*.jpg"):  # (its index cached, its images deleted since)
        path.unlink()
    with pytest.raises(gpufeed.sources.SourceError):
        _loader(gone, 3)
    pool = shared._pools[3]
    assert pool.users == 0 and pool._idle is not None and shared.stop_idle() >= 1
    seen.clear()
    _loader(shutil.copytree(folder, tmp_path / "cold"), 2)
    assert seen == [{}]  # a cold index: not started ahead (its index processes take the cores)
