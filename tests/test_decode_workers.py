"""CPU JPEG decode in worker processes: same pixels as the thread decoder, failures per image,
a dead worker survived, shared buffers reused and removed, and the encoded bytes' tiers."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

import gpufeed
from conftest import decoded, jpeg_bytes, save, smooth
from gpufeed.augment import Normalize, RandomResizedCrop
from gpufeed.decode.pool import protocol
from gpufeed.decode.base import Encoded, WorkersStopped
from gpufeed.decode.codecs import cpu as cpu_module
from gpufeed.decode.codecs import pixels as pixels_module
from gpufeed.decode.codecs.cpu import CpuDecoder
from gpufeed.decode.pool import workers as workers_module
from gpufeed.decode.asks import Asks
from gpufeed.decode.pool.workers import DecodeWorkers
from gpufeed.decode.tuning import Tuning
from gpufeed.decode.pool import jobs as jobs_module
from gpufeed.decode.pool import shared
from gpufeed.decode.pool.board import Board
from gpufeed.decode.pool.jobs import Job
from gpufeed.loader import tiers
from gpufeed.store.reader import as_tensor

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegw")
    for i, (h, w) in enumerate([(40, 60), (64, 48), (90, 120), (33, 33)] * 3):
        save(root / "src" / f"c{i % 2}" / f"{i:03d}.png", smooth(i, h, w))
    gpufeed.pack(root / "src", root / "store", mode="jpeg", quality=95, workers=1, progress=False)
    return gpufeed.open(root / "store")


def _inputs(store, idx):
    idx = np.array(list(idx))
    return Encoded.of(as_tensor(store.data), np.asarray(store.offsets), idx), np.asarray(store.shapes)[idx]


def _images(part):
    return [part.base.as_strided((3, h, w), tuple(s), int(o))
            for (h, w), s, o in zip(part.sizes.tolist(), part.strides.tolist(), part.offsets.tolist())]


def _same_as_pillow(got, batch, shapes) -> None:
    assert np.array_equal(got.sizes, shapes)
    assert all(torch.equal(image, decoded(d)) for image, d in zip(_images(got), batch.tensors()))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pool(store):
    workers = DecodeWorkers(store.data, 2)
    assert workers.wait_ready(60)
    yield workers
    workers.close()


def test_where_each_workers_start_went_is_told(pool):
    """Each worker says when its steps ended (one clock for every process): the median step times add
    up to the start, from being spawned to being heard ready."""
    steps = pool.start_seconds()
    assert set(steps) == {"python", "imports", "codec", "heard"} and all(v >= 0 for v in steps.values()), steps
    first = min(w.spawned_at for w in pool._workers)
    assert 0 < sum(steps.values()) <= max(pool.ready_times) - first + 1e-3


def test_processes_decode_the_same_pixels_as_threads(store, pool):
    idx = list(range(len(store)))
    datas, shapes = _inputs(store, idx)
    asks = Asks.whole(len(idx))
    big = [tuple(s) for s in store.shapes.tolist()].index((90, 120))
    asks.reduce_to[big] = (60, 45)  # a DCT-reduced decode (Pillow draft) goes through the worker too
    threads = CpuDecoder(2)
    want = threads.collect(threads.submit(datas, shapes, asks), CPU, pin=False)
    try:
        for _ in range(2):  # the second batch reuses the first one's shared buffer
            got = pool.collect(pool.submit(datas, shapes, asks), CPU, pin=False)
            assert got.failed == {} and np.array_equal(got.sizes, want.sizes) and got.done_at > 0
            assert all(torch.equal(a, b) for a, b in zip(_images(got), _images(want)))
            assert got.sizes[big].tolist() == [45, 60]
        assert len(pool._staging._free) == 1  # one segment, reused
        assert pool.busy["workers_wall"] > 0
    finally:
        threads.close()


def test_cpu_decoders_leave_hwc_pixels_as_libjpeg_wrote_them(store, pool):
    """No CHW transpose on the CPU (it cost more than the decode): threads and processes pack HWC."""
    datas, shapes = _inputs(store, range(len(store)))
    threads = CpuDecoder(2)
    try:
        for dec in (threads, pool):
            got = dec.collect(dec.submit(datas, shapes), CPU, pin=False)
            w = got.sizes[:, 1]
            assert got.strides.tolist() == np.stack([np.ones_like(w), 3 * w, np.full_like(w, 3)], 1).tolist()
            assert np.array_equal(np.diff(got.offsets), (got.sizes[:, 0] * w * 3)[:-1])  # back to back
            _same_as_pillow(got, datas, shapes)
    finally:
        threads.close()


def test_jobs_collected_out_of_order_get_their_own_images(store, pool):
    """The scheduler submits a batch's CPU share, then GPU rejects on the same workers, and collects
    the rejects first: each must get its own rows of the board and its own done records."""
    first, second = _inputs(store, range(0, 8)), _inputs(store, [9, 10, 11])
    decoded = pool.decoded
    a = pool.submit(*first)
    b = pool.submit(*second)
    first_ticket = min(a.sequence.values())  # the pool's workers may have served earlier loaders
    assert sorted(a.sequence.values()) == list(range(first_ticket, first_ticket + 4))  # two tickets per worker
    assert b.start >= a.start + 8 or b.start + 3 <= a.start
    got_b = pool.collect(b, CPU, pin=False)
    got_a = pool.collect(a, CPU, pin=False)
    _same_as_pillow(got_a, *first)
    _same_as_pillow(got_b, *second)
    # each collect's decoding seconds are its own job's (the scheduler's CPU rate), not all the pool's
    assert 0 < got_b.busy < pool.busy_seconds and 0 < got_a.busy < pool.busy_seconds
    assert got_b.busy + got_a.busy == pytest.approx(pool.busy_seconds, rel=1e-5)
    # a worker's rate (the doctor's): every image decoded over the seconds spent on them
    assert pool.decoded - decoded == 11 and pool.rate == pytest.approx(11 / pool.busy_seconds, rel=1e-5)


def test_a_share_goes_to_starting_workers_cut_for_all_of_them(store, monkeypatch):
    """A share submitted as the workers start waits for none to be heard ready, and is cut for all of
    them, each taking a ticket as it comes up. (Cut for the first one heard, a fresh Loader's first
    batch went in two halves to two workers while the rest, ready a moment later, had none to take;
    and a fresh process heard its workers 0.2 s after they were ready, its threads busy with Triton
    and the GPU decoders' start.)"""
    shared.stop_idle()  # a pool an earlier test left idle would be ready
    workers = DecodeWorkers(store.data, 4)
    try:
        cuts = []
        post = workers._pool.post
        with monkeypatch.context() as m:
            m.setattr(workers._pool, "post", lambda *a: cuts.append(a[5]) or post(*a))
            batch = _inputs(store, range(12))
            job = workers.submit(*batch)
        assert not any(w.ready for w in workers._workers)  # none heard before the share went
        assert isinstance(job, Job) and cuts == [2]  # 12 images in tickets of 2, 2 a worker: not 2 of 6
        _same_as_pillow(workers.collect(job, CPU, pin=False), *batch)
        assert workers.busy["threads_wall"] == 0 and workers.decoded == 12  # all by the workers
    finally:
        workers.close()


def test_a_share_given_to_starting_workers_that_all_die_is_decoded_on_threads(store):
    """A share posted while the workers start, every one of them killed before it read a ticket: its
    images are decoded on threads, each once, none lost."""
    shared.stop_idle()
    workers = DecodeWorkers(store.data, 2)
    try:
        batch = _inputs(store, range(12))
        job = workers.submit(*batch)
        for pid in workers.pids:
            os.kill(pid, signal.SIGKILL)
        _same_as_pillow(workers.collect(job, CPU, pin=False), *batch)
        assert workers.busy["threads_wall"] > 0 and workers.decoded == 12
    finally:
        workers.close()


def test_polling_a_pool_whose_workers_all_exited_waits_instead_of_spinning(store, monkeypatch):
    """Once every worker has exited, the done pipe is at its end and always readable: a poll with a
    timeout must still wait (it returned at once, so a share's wait spun a core until the workers'
    ends were read)."""
    from gpufeed.decode.pool import relay as relay_module

    workers = DecodeWorkers(store.data, 2)
    try:
        assert workers.wait_ready(60)
        for pid in workers.pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(w.dead is None for w in workers._workers) and time.monotonic() < deadline:
            workers._poll(0.05)
        calls = []
        real = relay_module.select.select
        monkeypatch.setattr(relay_module.select, "select", lambda *a: calls.append(1) or real(*a))
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            workers._poll(0.05)
        assert len(calls) < 20, len(calls)  # about 6 waits of 0.05 s, not thousands of returns
    finally:
        workers.close()


def test_two_pipelines_share_the_pool_at_once(store, pool):
    """Each pipeline thread submits and collects its own batches while the other does too: the reader
    thread routes every reply to its own job."""
    import threading

    failures: list = []

    def pipeline(idx):
        try:
            for _ in range(5):
                inputs = _inputs(store, idx)
                _same_as_pillow(pool.collect(pool.submit(*inputs), CPU, pin=False), *inputs)
        except BaseException as e:  # reported by the test's thread
            failures.append(e)

    threads = [threading.Thread(target=pipeline, args=(idx,)) for idx in (range(0, 7), range(5, 12))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and not any(t.is_alive() for t in threads), failures


def test_a_job_waiting_when_the_pool_closes_is_woken_at_once(store, caplog):
    """A pipeline waiting for replies when the workers are stopped (close(), or the interpreter's exit
    running the pool's finalizer) is woken at once with `WorkersStopped`, instead of waiting forever
    (an iteration's clean-up then waited on that pipeline at exit); one that submits after the stop
    (a producer still running at exit) gets it at once. Neither is an undecodable sample or a
    worker's death, and neither is logged as one."""
    workers = DecodeWorkers(store.data, 1)
    assert workers.wait_ready(60)
    job = workers.submit(*_inputs(store, range(12)))
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        workers._stop()  # what close() and the exit-time finalizer do first
        t0 = time.monotonic()
        with pytest.raises(WorkersStopped, match="stopped"):
            workers.collect(job, CPU, pin=False)
        assert time.monotonic() - t0 < 5
        with pytest.raises(WorkersStopped):
            workers.submit(*_inputs(store, range(12)))
    assert caplog.text == ""
    workers.close()


def test_workers_never_import_torch_or_main(store, pool):
    for pid in pool.pids:
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps
        cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")
        assert cmdline[1:3] == ["-m", "gpufeed.decode.pool.worker"]


def test_workers_end_when_the_ticket_pipe_closes(store):
    """What happens when the loader's process ends, however it ends: its end of the pipe closes."""
    workers = DecodeWorkers(store.data, 2)
    assert workers.wait_ready(60)
    os.close(workers._relay._tickets_w)
    assert [w.proc.wait(timeout=4) for w in workers._workers] == [0, 0]
    workers.close()


def test_a_loader_with_workers_closes_at_once_and_leaves_nothing_open(store):
    """close() returns at once and gives the workers back to the process (kept for its next loader,
    `shared`); once no loader holds them they end with code 0, and nothing of either is left open."""
    gc.collect()  # a loader an earlier test left in a reference cycle gives its pool back now
    shared.stop_idle()  # what earlier tests left
    before = _fds()
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=[RandomResizedCrop(16), Normalize()],
                            num_workers=2, seed=1)
    assert sum(1 for _ in loader) == 3
    procs = [w.proc for w in loader.jpeg.workers._workers]
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 4 and [p.poll() for p in procs] == [None, None]  # kept for the next loader
    assert shared.stop_idle() >= 1 and [p.wait(timeout=4) for p in procs] == [0, 0]  # (>=: another test's too)
    del loader
    assert _fds() <= before


def test_a_bad_image_fails_alone_and_a_view_of_another_store_is_refused(store, tmp_path):
    broken = tmp_path / "bad.bin"
    good = bytes(store.data[int(store.offsets[0]) : int(store.offsets[1])])
    broken.write_bytes(good + b"\xff\xd8 not a jpeg at all")
    data = np.memmap(broken, dtype=np.uint8, mode="r")
    workers = DecodeWorkers(data, 1)
    try:
        both = Encoded.of(as_tensor(data), np.array([0, len(good), len(data)]), np.array([0, 1]))
        shapes = np.array([list(store.shapes[0])] * 2)
        part = workers.collect(workers.submit(both, shapes), CPU, pin=False)
        assert list(part.failed) == [1] and part.sizes.tolist() == [list(store.shapes[0])]
        small = np.array([[2, 2], list(store.shapes[0])])  # the store records less
        part = workers.collect(workers.submit(both.take([0, 0]), small), CPU, pin=False)
        assert "larger than the store records it" in part.failed[0] and 1 not in part.failed
        foreign = Encoded.of(torch.zeros(10, dtype=torch.uint8), np.array([0, 10]), np.array([0]))
        with pytest.raises(ValueError, match="byte ranges of the store"):
            workers.submit(foreign, shapes[:1])
    finally:
        workers.close()


def test_workers_write_only_what_was_asked_back_to_back(store, pool, tmp_path):
    """A share's pixels take the room its asks need (a region, a DCT-reduced size), not whole stored
    images, so one short copy uploads them; a region refused alone is cut from the whole
    image and said to be (here a TGA image), and its pixels are the same."""
    png = save(tmp_path / "p.tga", smooth(7, 40, 60)).read_bytes()  # a format nvImageCodec does not read
    good = bytes(store.data[int(store.offsets[0]) : int(store.offsets[1])])
    path = tmp_path / "mixed.bin"
    path.write_bytes(good + png)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    workers = DecodeWorkers(data, 1)
    try:
        batch = Encoded.of(as_tensor(data), np.array([0, len(good), len(data)]), np.array([0, 1, 0]))
        shapes = np.array([list(store.shapes[0]), [40, 60], list(store.shapes[0])])  # (40, 60) both
        asks = Asks(np.array([[0, 0], [0, 0], [30, 20]]), np.array([[5, 7, 25, 40], [3, 4, 30, 50], [-1] * 4]))
        part = workers.collect(workers.submit(batch, shapes, asks), CPU, pin=False)
        assert part.cut == (1 if cpu_module.roi_available() else 2)  # without nvImageCodec the JPEG's too
        assert part.failed == {} and part.regions[:2].tolist() == asks.regions[:2].tolist()
        assert part.sizes.tolist() == [[20, 33], [27, 46], [20, 30]]  # 40x60 to 30x20: halved
        assert part.base.numel() == int(asks.nbytes(shapes).sum()) == (20 * 33 + 27 * 46 + 20 * 30) * 3
        whole = [decoded(batch.tensors()[0]).permute(1, 2, 0), torch.from_numpy(smooth(7, 40, 60))]
        got = [part.base[o : o + h * w * 3].view(h, w, 3) for o, (h, w) in zip(part.offsets.tolist(),
                                                                              part.sizes.tolist())]
        assert torch.equal(got[0], whole[0][5:25, 7:40]) and torch.equal(got[1], whole[1][3:30, 4:50])
    finally:
        workers.close()


def test_a_region_refused_alone_is_cut_on_threads_too(store, tmp_path):
    """Tickets no worker will answer are decoded on threads into the same room: a region refused alone
    is cut there as a worker cuts it, and counted."""
    tga = save(tmp_path / "p.tga", smooth(3, 40, 60)).read_bytes()
    path = tmp_path / "one.bin"
    path.write_bytes(tga)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    workers = DecodeWorkers(data, 1)
    assert workers.wait_ready(60)
    try:
        os.kill(workers._workers[0].proc.pid, 9)
        deadline = time.monotonic() + 30
        while workers._workers[0].dead is None and time.monotonic() < deadline:
            workers._poll(0.05)  # reads its stdout's end: nothing else polls the pool
        workers._living = lambda: 1  # as if read before it was found dead: its tickets go to threads
        batch = Encoded.of(as_tensor(data), np.array([0, len(data)]), np.array([0]))
        asks = Asks(np.zeros((1, 2), np.int64), np.array([[3, 4, 30, 50]]))
        part = workers.collect(workers.submit(batch, np.array([[40, 60]]), asks), CPU, pin=False)
        assert part.failed == {} and part.cut == 1 and part.regions.tolist() == [[3, 4, 30, 50]]
        assert torch.equal(part.base.view(27, 46, 3), torch.from_numpy(smooth(3, 40, 60))[3:30, 4:50])
    finally:
        workers.close()


def test_a_reduced_decode_has_the_size_room_was_reserved_for(tmp_path):
    """Pillow's DCT scaling (its `draft`) and the loader's reservation (`Asks.nbytes`) agree on sizes;
    an image the DCT cannot reduce (a PNG) is averaged down to the same size."""
    for k, (h, w) in enumerate([(375, 500), (500, 375), (101, 67), (64, 64), (33, 250)]):
        jpeg = np.frombuffer(jpeg_bytes(smooth(k, h, w), quality=90), np.uint8)
        png = np.frombuffer(save(tmp_path / f"{k}.png", smooth(k, h, w)).read_bytes(), np.uint8)
        for want in [(w // 2, h // 2), (w // 3, h // 5), (w // 8, h // 8), (w // 9 + 1, h // 9 + 1), (w, h)]:
            asks = Asks(np.array([want]), np.array([[-1] * 4]))
            room = int(asks.nbytes(np.array([[h, w]]))[0])
            for data in (jpeg, png):
                assert pixels_module.pillow(data, want).size == room, (h, w, want)


def test_a_dead_worker_is_survived_on_threads(store, caplog):
    # six batches, at most one made ahead: batches are left for the workers after the first (with three
    # batches and six ahead, all could be made before the kill: it failed so in one full-suite run)
    ops = [RandomResizedCrop(16), Normalize()]
    kw = dict(batch_size=2, device="cpu", augment=ops, seed=3, prefetch=1, tuning=Tuning(carry=False))
    want = [images for images, _ in gpufeed.Loader(store, num_workers=0, **kw)]
    loader = gpufeed.Loader(store, num_workers=2, **kw)
    it = iter(loader)
    first = next(it)[0]
    for pid in loader.jpeg.workers.pids:
        os.kill(pid, 9)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        rest = [images for images, _ in it]
    loader.close()
    assert "JPEG decode worker" in caplog.text and "stopped" in caplog.text
    assert len(rest) == 5 and all(torch.equal(a, b) for a, b in zip([first] + rest, want))
    assert loader.stats()["decoded_by"].get("failed", 0) == 0


def test_a_job_given_a_worker_already_known_dead_is_decoded_on_threads(store, monkeypatch):
    """The pool's list of live workers is read before its lock is taken: a worker the reply thread
    finds dead in between may still be given chunks. They are decoded on threads, not waited for."""
    workers = DecodeWorkers(store.data, 2)
    assert workers.wait_ready(60)
    try:
        for w in workers._workers:
            os.kill(w.proc.pid, 9)
        deadline = time.monotonic() + 30
        while any(w.dead is None for w in workers._workers) and time.monotonic() < deadline:
            workers._poll(0.05)  # reads their stdout's end: nothing else polls the pool
        monkeypatch.setattr(workers, "_living", lambda: 2)  # as read before they were found dead
        inputs, got = _inputs(store, range(0, 4)), []
        collect = threading.Thread(target=lambda: got.append(workers.collect(workers.submit(*inputs),
                                                                             CPU, pin=False)), daemon=True)
        collect.start()
        collect.join(30)
        assert not collect.is_alive(), "a chunk given a dead worker was waited for"
        _same_as_pillow(got[0], *inputs)
    finally:
        workers.close()


def test_two_jobs_on_dead_workers_are_decoded_on_threads(store, caplog):
    workers = DecodeWorkers(store.data, 2)
    assert workers.wait_ready(60)
    try:
        first, second = _inputs(store, range(0, 6)), _inputs(store, [7, 8])
        a, b = workers.submit(*first), workers.submit(*second)
        for w in workers._workers:
            os.kill(w.proc.pid, 9)
            w.proc.wait()
        with caplog.at_level(logging.WARNING, logger="gpufeed"):
            got_a = workers.collect(a, CPU, pin=False)
            got_b = workers.collect(b, CPU, pin=False)
            third = _inputs(store, [1, 2])
            got_c = workers.collect(workers.submit(*third), CPU, pin=False)
        assert caplog.text.count("stopped") == 2 and caplog.text.count("no JPEG decode worker is left") == 1
        _same_as_pillow(got_a, *first)
        _same_as_pillow(got_b, *second)
        _same_as_pillow(got_c, *third)
        # the doctor's rate counts what threads decoded for the dead workers, as `busy_seconds` times it
        assert workers.decoded == 6 + 2 + 2 and workers.rate == pytest.approx(10 / workers.busy_seconds)
    finally:
        workers.close()


def test_no_room_for_a_shared_buffer_decodes_on_threads(store, monkeypatch, caplog):
    def full(nbytes, device):
        raise OSError(28, f"No space left on device for {nbytes} bytes")

    ops = [RandomResizedCrop(16), Normalize()]
    want = [images for images, _ in gpufeed.Loader(store, batch_size=4, device="cpu", augment=ops, seed=2,
                                                   num_workers=0)]
    monkeypatch.setattr(workers_module, "Segment", full)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=ops, seed=2, num_workers=2)
        got = [images for images, _ in loader]
    loader.close()
    assert "no shared buffer for decoded JPEGs" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want) == 3


def test_encoded_bytes_tiers_on_cpu(store):
    assert tiers.materialize(store, CPU, "auto").name == "host"
    assert tiers.materialize(store, CPU, "disk").name == "disk"
    with pytest.raises(ValueError, match="CUDA"):
        tiers.materialize(store, CPU, "gpu")
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=[RandomResizedCrop(8)], cache="disk")
    assert loader.stats()["tier"] == "disk" and len(list(loader)) == 3
    loader.close()


def test_a_late_answer_for_rows_now_another_shares_is_ignored(store, pool):
    """A share's rows go to the next share once it is collected: an answer that comes late for the
    first (its worker was taken for dead, its ticket decoded on threads) must not finish the second."""
    first = _inputs(store, range(0, 4))
    a = pool.submit(*first)
    pool.collect(a, CPU, pin=False)
    second = _inputs(store, range(4, 8))
    b = pool.submit(*second)
    assert b.start == a.start and b.share != a.share
    late = np.zeros(1, protocol.DONE)
    late["row"], late["count"], late["share"] = a.start, 4, a.share
    pool._answered(late)  # nobody polled since b was submitted: all of b's tickets are pending
    assert b.start in b.pending and len(b.pending) == len(b.sequence)
    _same_as_pillow(pool.collect(b, CPU, pin=False), *second)


def test_a_ticket_read_but_never_taken_is_decoded_on_threads(store, caplog):
    """A worker killed between reading a ticket and taking its rows leaves a ticket nobody holds: once
    a death is known, it is decoded on threads after a grace, and the other tickets by the living."""
    workers = DecodeWorkers(store.data, 2)
    assert workers.wait_ready(60)
    try:
        os.kill(workers.pids[0], 9)
        workers._workers[0].proc.wait()
        inputs = _inputs(store, range(0, 8))
        with caplog.at_level(logging.WARNING, logger="gpufeed"):
            os.kill(workers.pids[1], signal.SIGSTOP)  # (else it may take every ticket before the read below)
            try:
                job = workers.submit(*inputs)
                stolen = os.read(workers._relay._tickets_r, protocol.TICKET.itemsize)  # read, never taken
            finally:
                os.kill(workers.pids[1], signal.SIGCONT)
            assert len(stolen) == protocol.TICKET.itemsize
            got: list = []
            collect = threading.Thread(target=lambda: got.append(workers.collect(job, CPU, pin=False)), daemon=True)
            collect.start()
            collect.join(30)
        assert not collect.is_alive(), "a ticket nobody holds was waited for"
        assert "stopped" in caplog.text
        _same_as_pillow(got[0], *inputs)
    finally:
        workers.close()


def test_the_tickets_no_living_worker_answers_are_told_apart():
    """`Job.lost`: a ticket still in the pipe, or taken by a living worker, is left to the workers; one
    taken by a dead worker is lost, and one read but never taken once its grace is over; with no
    worker alive, every pending ticket is."""
    board = Board(rows=16)
    try:
        job = Job(0, 7, None, None, Asks.whole(16), {0: 0, 4: 1, 8: 2, 12: 3}, {0: 4, 4: 4, 8: 4, 12: 4})
        board.rows["worker"][[0, 4, 8, 12]] = [0, 1, -1, -1]  # taken by 0 (alive) and 1 (dead); 8 and 12 untaken
        dead, read_upto = [False, True], 3  # tickets 0-2 of the pipe were read, 12's is still there
        assert job.lost(board, dead, read_upto, now=100.0) == {4: 4}  # 8's grace starts now
        assert job.lost(board, dead, read_upto, now=100.0 + jobs_module.UNCLAIMED_GRACE / 2) == {4: 4}
        assert job.lost(board, dead, read_upto, now=100.0 + 2 * jobs_module.UNCLAIMED_GRACE) == {4: 4, 8: 4}
        assert job.lost(board, [True, True], read_upto, now=100.0) == job.pending
    finally:
        board.close()


def test_encoded_joined_addresses_each_image_given():
    batch = Encoded.joined([b"ab", bytearray(b""), np.frombuffer(b"cde", np.uint8)])
    assert [bytes(a) for a in batch.arrays()] == [b"ab", b"", b"cde"] and len(batch) == 3
    assert [bytes(t.numpy()) for t in batch.tensors()] == [b"ab", b"", b"cde"]
    assert len(Encoded.joined([])) == 0


@pytest.mark.parametrize("paths", [[], [""], ["a"], ["", "b", ""], ["/x/y.jpg", "é.jpg", os.fsdecode(b"caf\xe9-\xff.jpg"), "rel/z.png"]])
def test_a_file_table_gives_back_each_path_as_the_os_names_it(paths):
    """The decode workers' table of a folder's files (encoded all at once): each path back as it was,
    a name whose bytes are not UTF-8 included, relative ones in the loader's working folder."""
    table = protocol.FileTable(protocol.FileTable.pack(paths), cwd="/work")
    assert [table[k] for k in range(len(paths))] == [os.path.join("/work", p) for p in paths]
    assert [os.fsencode(table[k]) for k in range(len(paths))] == [os.fsencode(os.path.join("/work", p)) for p in paths]
