"""The scheduler (`decode/scheduling/scheduler.py`): a batch's GPU share decoded on a helper thread while
the caller goes on, pipelines taking turns on the GPU, dropped batches, and the CPU's measured rate."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import decoded, jpeg_bytes
from gpufeed.decode.base import Encoded, in_place
from gpufeed.decode.scheduling import scheduler
from gpufeed.decode.scheduling.steering import Steering
from gpufeed.decode.tuning import Tuning
from gpufeed.synth import natural_images


def _jpeg(h: int = 90, w: int = 120) -> torch.Tensor:
    return torch.frombuffer(bytearray(jpeg_bytes(natural_images(1, h, w)[0], quality=90)), dtype=torch.uint8)


def _four_jpegs() -> tuple[Encoded, np.ndarray, np.ndarray]:
    """A batch of four 90x120 JPEGs, their shapes and whole-image crop boxes."""
    datas = [_jpeg() for _ in range(4)]
    batch = Encoded.of(torch.cat(datas), np.cumsum([0] + [len(d) for d in datas]), np.arange(4))
    return batch, np.array([[90, 120]] * 4), np.array([[0, 0, 120, 90]] * 4, float)


def _as_on_a_gpu(s: scheduler.Scheduler) -> scheduler.Scheduler:
    """`s` as on a GPU: one GPU decoder, `hw` (the test stands in for its calls by patching
    `Scheduler._timed`), and set rates."""
    s.gpu, s._streams, s.steering = [SimpleNamespace(name="hw")], {"hw": None}, Steering(["hw"], cpu_share=True)
    s.steering.rates.update(hw=1000.0, cpu=1000.0)
    s.steering.gpu_rate = 1000.0
    return s


def _on_the_cpu(s: scheduler.Scheduler, part_batch: Encoded):
    """What a stand-in GPU decoder returns: `part_batch` decoded by the scheduler's CPU decoder."""
    return s.cpu.collect(s.cpu.submit(part_batch, None), torch.device("cpu"), False)


def test_pipelines_sharing_a_turn_never_decode_on_the_gpu_at_once(monkeypatch):
    """Two pipelines' schedulers with a shared `gpu_turn`: their GPU decodes take turns (the CPU share
    and the rest overlap), and without it they do run at once; either way every image is decoded."""
    import threading
    import time

    batch, shapes, boxes = _four_jpegs()

    def overlap(turn) -> int:
        active, most = [0], [0]
        lock = threading.Lock()

        def fake_gpu(self, dec, part_batch, part_shapes, stream):  # stands in for a GPU decoder's call
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            time.sleep(0.05)
            with lock:
                active[0] -= 1
            return _on_the_cpu(self, part_batch), 0.05

        monkeypatch.setattr(scheduler.Scheduler, "_timed", fake_gpu)
        scheds = [_as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1, gpu_turn=turn)) for _ in range(2)]
        results = []
        threads = [threading.Thread(target=lambda s=s: [results.append(s.run(batch, shapes, boxes, (16, 16), False))
                                                        for _ in range(3)]) for s in scheds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in scheds:
            s.close()
        assert len(results) == 6 and all(not failed and sum(len(p) for _, p in parts) == 4 for parts, failed in results)
        return most[0]

    assert overlap(threading.Lock()) == 1
    assert overlap(None) == 2


def test_a_started_batchs_gpu_share_decodes_on_a_helper_while_the_caller_goes_on(monkeypatch):
    """`start` returns while the GPU share decodes on the scheduler's helper thread; `finish` waits for
    it and counts the caller's wait apart from the decode; `drop` waits for a dropped batch's share."""
    import threading

    batch, shapes, boxes = _four_jpegs()
    release, threads = threading.Event(), []

    def fake_gpu(self, dec, part_batch, part_shapes, stream):  # stands in for a GPU decoder's call
        threads.append(threading.current_thread())
        assert release.wait(10)
        return _on_the_cpu(self, part_batch), 0.01

    monkeypatch.setattr(scheduler.Scheduler, "_timed", fake_gpu)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1))
    started = s.start(batch, shapes, boxes, (16, 16))  # the fake decoder holds: start returned anyway
    assert started.gpu_job is not None and not started.gpu_job.done()
    release.set()
    parts, failed = s.finish(started, pin=False)
    assert not failed and sorted(np.concatenate([p for _, p in parts]).tolist()) == [0, 1, 2, 3]
    assert threads and threads[0] is not threading.current_thread()
    assert s.counts["hw"] == 2 and s.counts["cpu"] == 2
    assert s.seconds["hw"] == pytest.approx(0.01) and s.seconds["gpu"] > 0 and "gpu_wait" in s.seconds
    dropped = s.start(batch, shapes, boxes, (16, 16))
    s.drop(dropped)
    assert dropped.gpu_job.done()
    calls, shares = len(threads), s.steering.shares
    s.steering.shares = lambda n, threads: [0, n]  # the CPU has the whole batch: no helper thread woken
    empty = s.start(batch, shapes, boxes, (16, 16))
    parts, failed = s.finish(empty, pin=False)
    assert empty.gpu_job is None and len(threads) == calls and s.counts["cpu"] == 6
    assert sorted(parts[-1][1].tolist()) == [0, 1, 2, 3] and not failed
    s.steering.shares = shares
    s.tuning = Tuning(gpu_early=False)  # the share decoded in `finish`, on the caller's thread
    s.steering.rates["cpu"], calls = 1.0, len(threads)  # a slow CPU: the GPU decoder gets all but one image
    parts, failed = s.finish(s.start(batch, shapes, boxes, (16, 16)), pin=False)
    assert not failed and len(threads) == calls + 1 and threads[-1] is threading.current_thread()
    s.close()


def test_a_dropped_batchs_failed_gpu_share_is_not_raised(monkeypatch):
    def broken_gpu(self, dec, part_batch, part_shapes, stream):
        raise RuntimeError("the GPU decoder failed")

    batch, shapes, boxes = _four_jpegs()
    monkeypatch.setattr(scheduler.Scheduler, "_timed", broken_gpu)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1))
    s.drop(s.start(batch, shapes, boxes, (16, 16)))  # no error: nobody asked for these pixels
    with pytest.raises(RuntimeError, match="the GPU decoder failed"):  # a batch finished says it
        s.finish(s.start(batch, shapes, boxes, (16, 16)), pin=False)
    s.close()


def test_the_cpu_rate_is_its_images_over_its_decoding_seconds(monkeypatch):
    """The CPU's measured rate is per thread (or worker) while it decodes: workers that become ready
    while a share decodes do not dilute it, nor does the time the share waits to be collected."""
    batch, shapes, boxes = _four_jpegs()
    monkeypatch.setattr(scheduler.Scheduler, "_timed", lambda self, dec, part_batch, part_shapes, stream:
                        (_on_the_cpu(self, part_batch), 0.01))
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 2))
    s.steering.rates["cpu"] = 1e6  # the CPU takes the whole batch
    started = s.start(batch, shapes, boxes, (16, 16))
    assert len(started.cpu_pos) == 4
    s.cpu.threads = 12  # as if ten more workers became ready meanwhile
    parts, failed = s.finish(started, pin=False)
    images, seconds = s.steering._spent["cpu"]
    assert not failed and images == 4 and 0 < seconds == s.cpu.busy_seconds
    s.close()


def test_the_cpu_rate_leaves_out_the_images_a_gpu_decoder_rejected(monkeypatch):
    """Images a GPU decoder rejects are decoded on the CPU too, in the same batch: their seconds are
    not the CPU share's, so the CPU's rate is measured on its share's images and seconds alone."""
    batch, shapes, boxes = _four_jpegs()

    def rejecting(self, dec, part_batch, part_shapes, stream):  # a GPU decoder refusing its first image
        images = [decoded(d) for d in part_batch.tensors()]
        return in_place(images[1:], {0: "CMYK"}), 0.01

    monkeypatch.setattr(scheduler.Scheduler, "_timed", rejecting)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 2))
    started = s.start(batch, shapes, boxes, (16, 16))
    cpu_share = len(started.cpu_pos)
    assert 0 < cpu_share < 4  # the GPU decoder has a share of the first batch
    parts, failed = s.finish(started, pin=False)
    images, seconds = s.steering._spent["cpu"]
    assert not failed and s.counts["cpu_fallback"] == 1 and images == cpu_share
    cpu_part = parts[-1][0]  # the CPU's share, collected last
    assert 0 < seconds == cpu_part.busy < s.cpu.busy_seconds  # the retry's seconds are left out
    s.close()


def test_gpu_decoders_that_open_late_join_the_next_batch_and_the_cpu_decodes_meanwhile(monkeypatch):
    """The GPU decoders open on a thread of their own (`Tuning.open_ahead`, on a GPU): until they are
    open the CPU decodes whole batches and they are not named; the first batch after they open is
    split with them; a scheduler whose CPU may take no shares waits for them instead."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    batch, shapes, boxes = _four_jpegs()
    monkeypatch.setattr(scheduler.Scheduler, "_timed", lambda self, dec, b, sh, st: (_on_the_cpu(self, b), 0.01))
    gate = threading.Event()

    def opening(s: scheduler.Scheduler, pool: ThreadPoolExecutor) -> scheduler.Scheduler:
        s._opening = pool.submit(lambda: [SimpleNamespace(name="hw")] if gate.wait(10) else [])
        return s

    with ThreadPoolExecutor(1) as pool:
        s = opening(scheduler.Scheduler(torch.device("cpu"), 1), pool)
        parts, failed = s.run(batch, shapes, boxes, (16, 16), False)
        assert not failed and s.counts["cpu"] == 4 and not s.counts["hw"]
        assert s.opening and s.names == ["cpu"] and not s.opened(timeout=0.01)
        gate.set()
        assert s.opened(10) and not s.opening and s.names == ["hw", "cpu"]
        s.steering.rates.update(hw=1000.0, cpu=1000.0)
        s.steering.gpu_rate = 1000.0
        parts, failed = s.run(batch, shapes, boxes, (16, 16), False)
        assert not failed and s.counts["hw"] == 2 and s.counts["cpu"] == 6
        s.close()
    gate.clear()
    with ThreadPoolExecutor(1) as pool:
        s = opening(scheduler.Scheduler(torch.device("cpu"), 1), pool)
        s.steering.cpu_share = False  # as `decoders=("hw",)` on a GPU: the CPU decodes only what they reject
        threading.Timer(0.2, gate.set).start()
        parts, failed = s.run(batch, shapes, boxes, (16, 16), False)  # waits for the GPU decoder
        assert gate.is_set() and not failed and s.counts["hw"] == 4 and not s.counts["cpu"]
        s.close()


def test_a_batch_read_ahead_reads_first_the_positions_the_gpu_decoders_will_take(monkeypatch):
    """`read_first` names the positions of a batch that a folder read in place reads ahead in this
    process, the CPU's worker processes reading their own: none without GPU decoders; with
    `read_gpu_share`, those `start` would give the GPU decoders (and a spare part next in line).
    None (all) where this process's CPU threads decode too, or with GPU decoders and `read_gpu_share` off."""
    datas = [_jpeg(60 + 10 * k, 120) for k in range(8)]
    batch = Encoded.of(torch.cat(datas), np.cumsum([0] + [len(d) for d in datas]), np.arange(8))
    shapes = np.array([[60 + 10 * k, 120] for k in range(8)])
    boxes = np.array([[0, 0, 120, 30 + 5 * k] for k in range(8)], float)  # crops of different costs
    monkeypatch.setattr(scheduler.Scheduler, "_timed", lambda self, dec, part, shapes, stream: (_on_the_cpu(self, part), 0.01))
    assert scheduler.Scheduler(torch.device("cpu"), 1).read_first(shapes, boxes) is None  # its own CPU threads
    workers = scheduler.CpuDecoder(1)  # stands in for decode workers: a CPU decoder the scheduler was given
    s = scheduler.Scheduler(torch.device("cpu"), 1, cpu=workers)
    assert s.read_first(shapes, boxes).tolist() == []  # the CPU decodes every image
    s = _as_on_a_gpu(s)  # the GPU decoder's rate equals the CPU's one thread: half the batch each
    s.tuning = Tuning(read_gpu_share=False)
    assert s.read_first(shapes, boxes) is None  # with GPU decoders and read_gpu_share off: every position
    s.tuning = Tuning(read_gpu_share=True, read_spare=0)
    first = s.read_first(shapes, boxes)
    started = s.start(batch, shapes, boxes, (16, 16))
    assert len(first) == 4 and sorted(first.tolist()) == sorted(started.order[: started.starts[-2]].tolist())
    s.tuning = Tuning(read_gpu_share=True)
    assert len(s.read_first(shapes, boxes)) == 5  # one spare (read_spare of 8, rounded up), next in line
    s.finish(started, pin=False)
    s.close()
    workers.close()


def test_a_gpu_share_still_in_its_files_is_read_before_the_gpu_turn_and_its_timing(monkeypatch):
    """A folder's batch read in part (`Tuning.read_gpu_share`): the GPU decoders' images not read ahead
    are read before the pipelines' GPU turn is taken and before the decoder's call is timed, so a file
    read neither holds the other pipelines' GPU decodes nor counts as GPU decode time (the steering's
    rates)."""
    import threading

    batch, shapes, boxes = _four_jpegs()
    turn = threading.Lock()
    read_under_turn, seen = [], []

    def fill(part: Encoded) -> None:  # stands in for a folder's lazy read
        read_under_turn.append(turn.locked())

    def fake_gpu(self, dec, part_batch, part_shapes, stream):
        seen.append(part_batch.fill is None)
        return _on_the_cpu(self, part_batch.readable()), 0.01

    monkeypatch.setattr(scheduler.Scheduler, "_timed", fake_gpu)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1, gpu_turn=turn))
    unread = Encoded(batch.data, batch.array, batch.begins, batch.ends, fill=fill)
    parts, failed = s.run(unread, shapes, boxes, (16, 16), pin=False)
    assert not failed and sum(len(pos) for _, pos in parts) == 4
    assert seen == [True] and read_under_turn and not any(read_under_turn)
    s.close()


def test_the_engines_decoder_kept_idle_is_taken_back_by_the_next_pipeline_not_made_again(monkeypatch):
    """A closed pipeline's engines' decoder is kept for the process (`keep_idle`); the next pipeline to
    open the engines on that GPU takes that one (unwarmed: it decoded before) and makes none. Only
    one pipeline has it at a time, and a taken-back decoder let go while another is kept is
    destroyed like any other (no longer marked kept)."""
    from gpufeed.decode.scheduling import choice

    class Engines:
        name, device = "hw", torch.device("cuda", 0)

        def __init__(self):
            self.kept = False

        def keep_for_process(self):
            self.kept = True

        def taken_back(self):
            self.kept = False

    made = []

    def make(device, name, *args):
        made.append(Engines())
        return made[-1]

    def never_warmed(decoder, device):
        raise AssertionError("a taken-back decoder decoded before: no warming")

    monkeypatch.setattr(choice, "_kept", {})
    monkeypatch.setattr(choice, "_nvimgcodec", make)
    gpu = torch.device("cuda", 0)
    first = choice.gpu_decoders(gpu, ("hw", "cpu"), 2)
    choice.keep_idle(first)
    assert first[0].kept and choice._kept == {0: first[0]}
    monkeypatch.setattr(choice, "warmed", never_warmed)
    again = choice.gpu_decoders(gpu, ("hw", "cpu"), 2, warm=True)
    assert again == first and len(made) == 1 and not first[0].kept and choice._kept == {}
    monkeypatch.setattr(choice, "warmed", lambda decoder, device: True)
    beside = choice.gpu_decoders(gpu, None, 2, warm=True)  # another pipeline meanwhile: its own
    assert len(made) == 2 and beside == [made[1]]
    assert choice.gpu_decoders(torch.device("cuda", 1), ("hw",), 2) == [made[2]]  # another GPU's is its own
    choice.keep_idle(beside)
    choice.keep_idle(again)  # the GPU has one kept already
    assert choice._kept == {0: made[1]} and made[1].kept and not made[0].kept
    assert choice.let_go_kept() == 1 and choice._kept == {} and not made[1].kept  # (a benchmark's first Loaders)


def test_a_closed_schedulers_measured_rates_start_the_next_one():
    """A pipeline's scheduler leaves the rates it measured to the process's next (an evaluation pass
    each epoch starts from them, not from the start rates)."""
    from gpufeed.decode.scheduling.steering import CPU_START_RATE

    batch, shapes, boxes = _four_jpegs()
    s = scheduler.Scheduler(torch.device("cpu"), 1)
    s.run(batch, shapes, boxes, (16, 16), pin=False)
    measured = s.steering.rates["cpu"]
    assert measured != CPU_START_RATE
    assert scheduler.Scheduler(torch.device("cpu"), 1).steering.rates["cpu"] == CPU_START_RATE  # s still open
    s.close()
    assert scheduler.Scheduler(torch.device("cpu"), 1).steering.rates["cpu"] == pytest.approx(measured)


class _Engines:
    """An engines' decoder stand-in: `decode` waits until `go` is set (a decode in flight)."""

    name, device = "hw", torch.device("cuda", 0)

    def __init__(self):
        self.kept, self.go, self.decoding = False, threading.Event(), threading.Event()

    def decode(self, batch, shapes):
        self.decoding.set()
        assert self.go.wait(10)
        return "decoded"

    def keep_for_process(self):
        self.kept = True

    def taken_back(self):
        self.kept = False


def test_a_pipeline_closed_while_its_engines_decode_keeps_no_decoder_and_decodes_no_more(monkeypatch):
    """A producer that outlived its loader's close may still be decoding: that decoder is not kept for
    the next pipeline (they would share it), and the closed pipeline's decoders decode no more."""
    import threading
    from types import SimpleNamespace

    from gpufeed.decode.scheduling import choice

    monkeypatch.setattr(choice, "_kept", {})
    s = scheduler.Scheduler(torch.device("cpu"), 1)
    engines, stream = _Engines(), SimpleNamespace(synchronize=lambda: None)
    s.gpu = [engines]
    straggler = threading.Thread(target=s._timed, args=(engines, None, None, stream))
    straggler.start()
    assert engines.decoding.wait(10)
    s.close()
    engines.go.set()
    straggler.join(10)
    assert choice._kept == {} and not engines.kept
    with pytest.raises(RuntimeError, match="closed pipeline"):
        s._timed(engines, None, None, stream)

    idle = scheduler.Scheduler(torch.device("cpu"), 1)  # no decode running at its close: kept
    other = _Engines()
    other.go.set()
    idle.gpu = [other]
    assert idle._timed(other, None, None, stream)[0] == "decoded"
    idle.close()
    assert choice._kept == {0: other} and other.kept


def test_a_pipeline_closed_before_taking_its_opened_decoders_into_use_still_keeps_the_engines(monkeypatch):
    """The GPU decoders opened on their thread, and the pipeline closed before a batch took them into use
    (a Loader closed before its first batches): its engines' decoder is kept all the same (one taken
    back from the process was lost, and the next Loader made another)."""
    from concurrent.futures import Future

    from gpufeed.decode.scheduling import choice

    monkeypatch.setattr(choice, "_kept", {})
    s = scheduler.Scheduler(torch.device("cpu"), 1)
    engines, opened = _Engines(), Future()
    opened.set_result([engines])
    s._opening = opened
    s.close()
    assert choice._kept == {0: engines} and engines.kept


def test_the_engines_planar_choice_is_asked_as_they_are_taken_into_use():
    """`planar` (whether the engines give YCbCr planes: only where Triton's resize kernel imports) is
    asked when GPU decoders opened on their thread are taken into use, not by the constructor, which
    would wait for Triton's import (0.35-0.39 s of a fresh process's start); the answer is the engines'."""
    from concurrent.futures import ThreadPoolExecutor

    asked: list[str] = []
    gate = threading.Event()
    engines = SimpleNamespace(name="hw", planar=None)

    def planar() -> bool:
        asked.append(threading.current_thread().name)
        return False

    with ThreadPoolExecutor(1) as pool:
        s = scheduler.Scheduler(torch.device("cpu"), 1, planar=planar)
        s._opening = pool.submit(lambda: [engines] if gate.wait(10) else [])
        assert not asked
        gate.set()
        assert s.opened(10) and s.names == ["hw", "cpu"]
        assert asked == [threading.current_thread().name] and engines.planar is False
        s.close()
