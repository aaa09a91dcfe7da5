"""Split each batch between the decoders, run them at once, and start the next batch early.

`start` hands a batch's CPU share to the CPU decoder (worker processes) and its GPU share to a
helper thread that runs the GPU decoders, and returns; `finish` waits for both. The loader starts
batch k+1 before it finishes batch k, so the workers and the GPU decoders decode all the time while
the producer thread resizes and hands batches over: its cycle is the slower decoder's time per
batch, not the sum of the GPU decode, the wait for the CPU and the resize.

The shares follow `steering.Steering`: beside a training loop the CPU decodes all it can and the
GPU decoders what it can't. The CPU's rate is measured on every share: its images over the seconds
the threads or worker processes spent decoding them (`Decoded.busy`). Images a GPU decoder
rejects (CMYK, some progressive files) are decoded on the CPU instead.

Where the CPU can decode a crop alone (`cpu.roi_available`), its share is the batch's cheapest crops
by `cpu.roi_cost` (near the top of their image, small): the GPU decoders decode whole images, so to
them every image costs the same.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from gpufeed.decode.asks import NO_REGION, Asks, crop_regions, reduce_to
from gpufeed.decode.base import Decoded, Encoded, WorkersStopped
from gpufeed.decode.codecs.cpu import CpuDecoder, roi_available, roi_cost
from gpufeed.decode.scheduling.choice import DEFAULT, gpu_decoders, keep_idle, warn_once
from gpufeed.decode.scheduling.shares import GpuShare, GpuShares, Started
from gpufeed.decode.scheduling.steering import Measured, Pace, Steering
from gpufeed.decode.tuning import Tuning


class Scheduler:
    """Decoders for one pipeline: on a GPU those of `use` that can be made here, and a CPU decoder
    (`cpu`, e.g. `DecodeWorkers`; else `cpu_threads` threads)."""

    def __init__(
        self,
        device: torch.device,
        cpu_threads: int,
        use: tuple[str, ...] | None = None,
        cpu=None,
        gpu_turn: threading.Lock | None = None,
        room: tuple[int, int, int] | None = None,
        tuning: Tuning = Tuning(),
        host_threads: int | None = None,
        planar: Callable[[], bool] = lambda: False,
    ):
        """`cpu_threads`: the CPU decoder's threads where `cpu` is None (and for what it can't take);
        `host_threads`: nvImageCodec's host threads (default: `cpu_threads`, at least two).
        `use` None: the default, `DEFAULT` (one GPU decoder, the first of it that can be made here, and the CPU).
        `gpu_turn`: a lock shared by pipelines so that their GPU decodes take turns (the CPU shares,
        resizes and Python of one pipeline then overlap another's GPU decode, never two decodes).
        `room`: (images, width, height) of the batches the GPU decoders make their buffers for.
        `tuning`: the JPEG path's measured settings (stream priority, early GPU shares, steering).
        `planar`: asked as the engines are taken into use (at a batch, where they open on a thread):
        whether they decode YCbCr 4:2:0 photos to their planes (`base.YCC420`), for a consumer whose
        kernel converts them (the answer may wait for Triton's import, which the constructor should not)."""
        self.tuning, self._planar = tuning, planar
        self._gpu_turn = gpu_turn or contextlib.nullcontext()
        self.device = device
        # always there, the fallback for what GPU decoders reject: `cpu` (worker processes) or threads
        self.cpu = cpu or CpuDecoder(cpu_threads)
        self._own_cpu = cpu is None
        # else the CPU decodes only what GPU decoders reject
        cpu_share = "cpu" in (DEFAULT if use is None else use) or device.type != "cuda"
        self.steering = Steering([], cpu_share, tuning)
        self.gpu: list = []  # the GPU decoders, once open (`_use`)
        self.opened_at: float | None = None  # when they were taken into use (time.perf_counter)
        self._streams: dict[str, torch.cuda.Stream | None] = {}
        self._helper: ThreadPoolExecutor | None = None
        make = functools.partial(
            gpu_decoders, device, use, host_threads or max(2, cpu_threads), room, tuning.nv_padding_mb << 20
        )
        # made on a thread of its own (`Tuning.open_ahead`): the GPU decoders take 1-2 s to make and
        # decode once in a fresh process, the CPU workers 0.3 s to start (docs/benchmarks.md,
        # "Start-up and GPU memory"), so the first batches come from the CPU while they open
        self._opening: Future | None = None
        self._decoding = threading.Lock()  # `_timed`'s count of GPU decodes running, and `close`'s flag
        self._in_flight, self._closed = 0, False
        self._open_lock = threading.RLock()  # `start` holds it while `_settle` takes it
        if device.type == "cuda" and tuning.open_ahead:
            opener = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-gpuopen")
            self._opening = opener.submit(make, warm=True)
            opener.shutdown(wait=False)  # its one thread ends with the job
        else:
            self._use(make())
        self.roi = roi_available()  # the workers, if processes, run in this interpreter's environment
        self._cpu_free = 0.0  # when the CPU decoder finished its last share (a perf_counter)
        self.counts: Counter = Counter()
        # per batch, summed: "gpu" from the GPU decoders' start until the last is done, "gpu_wait" the
        # caller's wait for them in `finish`, "cpu" the CPU part's work after that; each decoder's own
        # time (the GPU decoders' calls, "cpu_threads" until the last CPU image from when the CPU could
        # begin the share, "cpu_submitted_to_done" from when it was handed over)
        # a Counter of seconds, floats (typeshed's Counter counts ints)
        self.seconds: dict[str, float] = Counter()  # type: ignore[assignment]
        self._early: ThreadPoolExecutor | None = None  # decodes started batches' GPU shares (`Tuning.gpu_early`)

    def _use(self, decoders: list) -> None:
        """Decode with the GPU decoders `decoders` from the next batch on."""
        self.opened_at = time.perf_counter()
        helpers = len(decoders) - 1  # every GPU decoder but the last decodes on a helper thread
        self._helper = ThreadPoolExecutor(helpers, thread_name_prefix="gpufeed-gpudecode") if helpers > 0 else None
        # a stream per GPU decoder so they overlap; the host waits on it, so results are complete
        cuda = self.device.type == "cuda"
        self._streams = {
            d.name: torch.cuda.Stream(self.device, priority=self.tuning.priority) if cuda else None for d in decoders
        }
        planar = self._planar() if any(d.name == "hw" for d in decoders) else False
        for dec in decoders:
            if dec.name == "hw":
                dec.planar = planar
        self.steering.use_gpu([d.name for d in decoders])
        self.gpu = decoders

    def _settle(self, wait: bool = False, timeout: float | None = None) -> bool:
        """Take the GPU decoders into use once they are open (`wait`: wait for them, at most `timeout`
        seconds); whether they are."""
        opening = self._opening
        if opening is None:
            return True
        if wait:  # outside the lock: the producer goes on meanwhile
            futures.wait([opening], timeout)
        with self._open_lock:  # the producer's thread, and a caller of `opened`
            if self._opening is not opening:  # taken up meanwhile
                return self._opening is None
            if not opening.done():
                return False
            self._opening = None
            self._use(opening.result())
            return True

    def opened(self, timeout: float | None = None) -> bool:
        """Wait until the GPU decoders are open (they open on a thread while the CPU decodes the first
        batches; at most `timeout` seconds); whether they are."""
        return self._settle(wait=True, timeout=timeout)

    @property
    def opening(self) -> bool:
        """Whether GPU decoders are still being made (the CPU decodes meanwhile)."""
        return not self._settle()

    @property
    def names(self) -> list[str]:
        """The decoders in use: the GPU decoders open so far, then the CPU."""
        return [d.name for d in self.gpu] + [self.cpu.name]

    def shares(self, n: int, threads: int | None = None) -> list[int]:
        """Images per decoder (GPU decoders in order, then the CPU) for a batch of `n` (`Steering.shares`;
        `threads` default: the CPU's ready now)."""
        return self.steering.shares(n, self.cpu.threads if threads is None else threads)

    def run(
        self, batch: Encoded, shapes: np.ndarray, boxes: np.ndarray, out_hw: tuple[int, int], pin: bool
    ) -> tuple[list[tuple[Decoded, np.ndarray]], dict[int, str]]:
        """Decode a batch now: `finish(start(...))`."""
        return self.finish(self.start(batch, shapes, boxes, out_hw), pin)

    def start(
        self, batch: Encoded, shapes: np.ndarray, boxes: np.ndarray, out_hw: tuple[int, int], pace: Pace | None = None
    ) -> Started:
        """Split a batch (`shapes` (N, 2) as the store records them, crop `boxes` (N, 4) x0 y0 x1 y1) and
        hand the CPU its share and (`Tuning.gpu_early`) the helper thread the GPU decoders', which they decode
        while the caller goes on. `pace`: what the caller and its consumer waited for since the last
        batch (None: nothing known yet)."""
        # the GPU decoders join as they open; waited for where the CPU may not decode a share
        if not self.steering.cpu_share:
            self._settle(wait=True)
        with self._open_lock:  # the decoders in use and the shares split for them, together
            self._settle()
            decoders = self.gpu
            threads = self.cpu.threads  # read once: workers become ready while batches are made
            self.steering.steer(pace, threads, len(batch))
            shares = self.shares(len(batch), threads)
        starts = np.cumsum([0] + shares)
        regions, cost, order = self._order(shapes, boxes)
        cpu_pos = order[starts[-2] : starts[-1]]
        asks = self._asks(cpu_pos, shapes, boxes, out_hw, regions, cost)
        submitted = time.perf_counter()  # before: the CPU may finish small shares before `submit` returns
        job = self.cpu.submit(batch.take(cpu_pos), shapes[cpu_pos], asks)
        gpu_job = None
        # one thread: batches' GPU shares are decoded one after another. Not woken for a batch whose GPU
        # share is empty (beside a model the workers often decode it all): each wake-up takes the GIL
        if decoders and self.tuning.gpu_early and starts[-2] > 0:
            self._early = self._early or ThreadPoolExecutor(1, thread_name_prefix="gpufeed-gpushare")
            gpu_job = self._early.submit(self._decode_gpu, batch, shapes, order, starts, decoders)
        return Started(
            batch=batch,
            shapes=shapes,
            boxes=boxes,
            out_hw=out_hw,
            order=order,
            starts=starts,
            regions=regions,
            cost=cost,
            cpu_asks=asks,
            cpu_job=job,
            submitted=submitted,
            gpu_job=gpu_job,
            gpu=decoders,
        )

    def _order(self, shapes: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch's crop regions, their CPU cost, and its positions in the order the decoders take them:
        the GPU decoders from the front, the CPU the rest (with crops the CPU decodes alone, the cheapest)."""
        regions = crop_regions(shapes, boxes)
        cost = roi_cost(shapes, regions)
        order = np.argsort(-cost, kind="stable") if self.roi else np.arange(len(shapes))
        return regions, cost, order

    def read_first(self, shapes: np.ndarray, boxes: np.ndarray) -> np.ndarray | None:
        """The positions of a batch (`shapes`, crop `boxes`) whose bytes this process reads ahead, for a
        source that reads a batch's files (a folder read in place): none where the CPU's worker
        processes decode it all (they read their share from the files themselves); with
        `Tuning.read_gpu_share`, the share the GPU decoders would take were the batch split now, and
        `Tuning.read_spare` of the batch next in line (the split moves with the pace; a GPU position
        left out is read as it decodes, `Encoded.readable`). None: every position (CPU threads of this
        process decode, the GPU decoders are still opening, or `read_gpu_share` is off)."""
        if self._own_cpu or self.opening:
            return None
        if not self.gpu:
            return np.zeros(0, np.int64)  # the CPU's workers decode every image (no GPU decoders here)
        if not self.tuning.read_gpu_share:
            return None
        n = len(shapes)
        take = min(n, self.steering.gpu_count(n, self.cpu.threads) + int(np.ceil(self.tuning.read_spare * n)))
        return self._order(shapes, boxes)[2][:take]

    def finish(self, started: Started, pin: bool) -> tuple[list[tuple[Decoded, np.ndarray]], dict[int, str]]:
        """Wait for the GPU decoders' shares of a started batch (decode them now if they were not started)
        and collect the CPU's: ([(part, batch positions of its images)], {position: reason it failed}).
        What it measured goes to the steering and the counters (`_account`)."""
        t0 = time.perf_counter()
        gpu = self._gpu_shares(started)
        t_cpu = time.perf_counter()
        parts, failed, retry = [], {}, []
        for share in gpu.shares:
            pos, part = share.positions, share.part
            parts.append((part, pos[part.kept(len(pos))]))
            retry += [(int(pos[k]), f"{share.decoder.name}: {why}") for k, why in part.failed.items()]
        if retry:  # rejected by a GPU decoder: the CPU decodes them instead
            extra, again = self._on_the_cpu([p for p, _ in retry], started, pin)
            parts.append((extra, again[extra.kept(len(again))]))
            failed.update({retry[i][0]: f"{retry[i][1]}; cpu: {why}" for i, why in extra.failed.items()})
        cpu_pos = started.cpu_pos
        t_wait = time.perf_counter()
        cpu_part = self.cpu.collect(started.cpu_job, self.device, pin)
        cpu_wait = time.perf_counter() - t_wait
        self._decoded_whole(started.cpu_asks, cpu_part, len(cpu_pos))
        parts.append((cpu_part, cpu_pos[cpu_part.kept(len(cpu_pos))]))
        failed.update({int(cpu_pos[i]): why for i, why in cpu_part.failed.items()})
        self._account(
            Measured(
                gpu=gpu,
                gpu_wait=t_cpu - t0,
                retried=len(retry),
                cpu_images=len(cpu_pos),
                cpu_failed=len(cpu_part.failed),
                cpu_wait=cpu_wait,
                cpu_busy=cpu_part.busy,
                cpu_done=cpu_part.done_at,
                submitted=started.submitted,
                failed=len(failed),
                cpu_seconds=time.perf_counter() - t_cpu,
                gpu_images=int(started.starts[-2]),
            )
        )
        return parts, failed

    def _gpu_shares(self, started: Started) -> GpuShares:
        """The GPU decoders' shares of a started batch: decoded on the helper thread, or now."""
        if started.gpu_job is not None:
            return started.gpu_job.result()
        if started.starts[-2] > 0:
            return self._decode_gpu(started.batch, started.shapes, started.order, started.starts, started.gpu)
        return GpuShares(shares=[], seconds=0.0)  # the CPU has the whole batch

    def _on_the_cpu(self, positions: list[int], started: Started, pin: bool) -> tuple[Decoded, np.ndarray]:
        """Images a GPU decoder rejected, decoded by the CPU decoder now: (the part, their positions)."""
        again = np.array(positions)
        asks = self._asks(again, started.shapes, started.boxes, started.out_hw, started.regions, started.cost)
        extra = self.cpu.collect(
            self.cpu.submit(started.batch.take(again), started.shapes[again], asks), self.device, pin
        )
        self._decoded_whole(asks, extra, len(again))
        return extra, again

    def _account(self, m: Measured) -> None:
        """What finishing a batch measured, into the steering (`Steering.observe`) and the counters."""
        self.steering.observe(m)
        self.seconds["gpu_wait"] += m.gpu_wait  # the caller's wait for the GPU shares
        for share in m.gpu.shares:
            self.seconds[share.decoder.name] += share.seconds
            self.counts[share.decoder.name] += len(share.positions) - len(share.part.failed)
        self.seconds["gpu"] += m.gpu.seconds
        if m.retried:
            self.counts["cpu_fallback"] += m.retried
        self.seconds["cpu_wait"] += m.cpu_wait
        if m.cpu_images:
            begun = max(m.submitted, self._cpu_free)
            self.seconds["cpu_threads"] += max(0.0, m.cpu_done - begun)
            self.seconds["cpu_submitted_to_done"] += max(0.0, m.cpu_done - m.submitted)
            self._cpu_free = m.cpu_done
        self.counts["cpu"] += m.cpu_images - m.cpu_failed
        self.counts["failed"] += m.failed
        self.seconds["cpu"] += m.cpu_seconds

    def drop(self, started: Started) -> None:
        """Let go of a started batch that will not be finished (its shares decoded and discarded). An
        error of its GPU share is not raised: nobody asked for those pixels (a loader's `close`)."""
        if started.gpu_job is not None:
            started.gpu_job.exception()  # waits for it
        with contextlib.suppress(WorkersStopped):  # the loader is closing: nothing to let go of
            self.cpu.collect(started.cpu_job, torch.device("cpu"), False)

    def snapshot(self) -> dict:
        """Images decoded, rates and seconds so far, as plain dicts: what `summed` adds up over pipelines."""
        rates = self.steering.rates | {"cpu": self.steering.rates["cpu"] * max(1, self.cpu.threads)}
        return {"counts": dict(self.counts), "rates": rates, "seconds": dict(self.seconds)}

    def _asks(
        self,
        pos: np.ndarray,
        shapes: np.ndarray,
        boxes: np.ndarray,
        out_hw: tuple[int, int],
        regions: np.ndarray,
        cost: np.ndarray,
    ) -> Asks:
        """What the CPU decodes of the images at `pos` (see `decode_one`): a region alone where that is
        cheaper than the whole image."""
        alone = (cost[pos] < 1) if self.roi else np.zeros(len(pos), bool)
        return Asks(reduce_to(shapes[pos], boxes[pos], out_hw), np.where(alone[:, None], regions[pos], NO_REGION))

    def _decoded_whole(self, asks: Asks, part: Decoded, n: int) -> None:
        """Count the images of `part` (of `n` asked for) that the CPU decoded whole though a region alone
        was asked for (nvImageCodec's CPU decoder refused it: correct, but slower), and say so once."""
        asked = int(asks.tries_region()[part.kept(n)].sum())
        whole = asked - int(part.alone().sum()) + part.cut
        if whole > 0:
            self.counts["cpu_whole"] += whole
            warn_once(
                "the CPU decodes whole images where it was to decode crop regions alone (slower): "
                "nvImageCodec's CPU decoder refused them (`gpufeed doctor` says why); counted in "
                "loader.stats()['decoded_by']['cpu_whole']"
            )

    def _decode_gpu(
        self, batch: Encoded, shapes: np.ndarray, order: np.ndarray, starts: np.ndarray, decoders: list
    ) -> GpuShares:
        """Decode every GPU decoder's share of a batch (`decoders`: those in use when it started; at
        once, taking the pipelines' GPU turn). Bytes still in their files (a folder's batch read in
        part, `Tuning.read_gpu_share`) are read first, outside the turn and the decoders' timing: a
        file read is neither GPU work nor the GPU decoders' rate."""
        t0 = time.perf_counter()
        todo = []
        for i, dec in enumerate(decoders):
            pos = np.sort(order[starts[i] : starts[i + 1]])
            if len(pos):
                todo.append((dec, pos, batch.take(pos).readable()))
        with self._gpu_turn:
            jobs = self._gpu_decodes(todo, shapes)
            done = [(dec, pos, job.result() if isinstance(job, Future) else job) for dec, pos, job in jobs]
        shares = [GpuShare(decoder=dec, positions=pos, part=part, seconds=sec) for dec, pos, (part, sec) in done]
        return GpuShares(shares=shares, seconds=time.perf_counter() - t0)

    def _gpu_decodes(self, todo: list[tuple[Any, np.ndarray, Encoded]], shapes: np.ndarray) -> list:
        """Start each GPU decoder on its share (`todo`: (decoder, batch positions, their images)):
        [(decoder, batch positions, (part, seconds) or a future)]; all but the last decode on helper
        threads, so they run at once."""
        jobs: list[tuple[Any, np.ndarray, Future | tuple[Decoded, float]]] = []
        for i, (dec, pos, part) in enumerate(todo):
            stream = self._streams[dec.name]
            if self._helper is not None and i < len(todo) - 1:
                jobs.append((dec, pos, self._helper.submit(self._timed, dec, part, shapes[pos], stream)))
            else:
                jobs.append((dec, pos, self._timed(dec, part, shapes[pos], stream)))
        return jobs

    def _timed(self, dec, batch: Encoded, shapes: np.ndarray, stream) -> tuple[Decoded, float]:
        with self._decoding:  # a producer still running after its loader's close (`close`) decodes nothing
            if self._closed:
                raise RuntimeError(f"gpufeed: the {dec.name} decoder of a closed pipeline asked to decode")
            self._in_flight += 1
        try:
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                part = dec.decode(batch, shapes)
                stream.synchronize()
            return part, time.perf_counter() - t0
        finally:
            with self._decoding:
                self._in_flight -= 1

    def close(self) -> None:
        """Stop the decoders: the GPU decoders' opening waited for, the helper threads ended. The engines'
        decoder is kept for the process's next pipeline (`choice.keep_idle`) unless a decode of this
        one is still running (a producer that outlived its loader's close: the next pipeline would
        share it), and the rates measured here are left to it (`Steering.learn`)."""
        opened: list = []
        with self._open_lock:
            opening, self._opening = self._opening, None
        # its thread ends when the decoders are made (`exception` waits for it): made, not yet in use
        if opening is not None and not opening.cancel() and opening.exception() is None:
            opened = opening.result()
        if self._own_cpu:  # a shared CPU decoder (the worker processes) is its owner's to stop
            self.cpu.close()
        for pool in (self._early, self._helper):  # the early pool first: its jobs use the helpers
            if pool is not None:
                pool.shutdown(wait=True)
        with self._decoding:
            self._closed = True
            idle = self._in_flight == 0
        if idle:
            keep_idle(self.gpu + opened)  # a later Loader takes it back: no engines' decoder made again
        self.steering.learn()  # and starts from the rates measured here


def summed(names: list[str], snapshots: list[dict]) -> dict:
    """`loader.stats()`'s decoder entries from the pipelines' `Scheduler.snapshot()`s."""
    return {
        "decoders": names,
        "decoded_by": dict(sum((Counter(s["counts"]) for s in snapshots), Counter())),
        "decoder_rates": {name: sum(s["rates"].get(name, 0.0) for s in snapshots) for name in names},
        "decode_seconds": dict(sum((Counter(s["seconds"]) for s in snapshots), Counter())),
    }
