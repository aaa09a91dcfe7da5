"""CPU JPEG decoding in worker processes, written straight into shared buffers.

Why processes: decode threads in the training process would share its GIL with the training loop.
Why not multiprocessing: a forked worker inherits the loader's threads and locks; a spawned or
forkserver one imports the user's `__main__` (re-running an unguarded script) and leaves a server
process behind. Each worker here is a fresh interpreter started with exec (`spawn`,
`python -m gpufeed.decode.pool.worker`).

What the training process does per batch is what costs the training loop (each time one of our
threads wakes or comes back from a system call it takes the GIL back, and the training thread, which
lets go of it in every op, waits): a share is a few numpy assignments into the job board, one write
of all its tickets, and, when it is wanted, reads of the done records by the thread that waits for
it, with no thread of ours in between (`protocol` has the board and the records).

Lifecycle: workers start in the background; until one says `Ready`, `threads` is 0 and the
scheduler gives the CPU no share (the GPU decoders serve the first batches). Workers end when the
ticket pipe closes (at `close()`, when the pool is garbage-collected or the interpreter exits, or
when the loader's process dies) and within a quarter second of their parent going away, SIGKILL
included. A worker that dies is named in one warning; the tickets it held (or that nobody can take
any more) are decoded on threads, and the others go on.

Pixels: a batch's CPU share is decoded into a `segment.Segment` of the loader's process, page-locked
on a GPU, so its pixels reach the device in one DMA copy.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import Counter

import numpy as np
import torch

from gpufeed.decode.asks import Asks
from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, WorkersStopped, hwc_strides, in_place, to_device
from gpufeed.decode.codecs.cpu import CpuDecoder
from gpufeed.decode.pool import protocol, spawn
from gpufeed.decode.pool.board import Board
from gpufeed.decode.pool.jobs import Job
from gpufeed.decode.pool.relay import Relay
from gpufeed.decode.pool.segment import Segment, unavailable

log = logging.getLogger(__name__)

STOPPED = "the JPEG decode workers were stopped (the loader was closed, or the interpreter is exiting)"


class DecodeWorkers:
    """`workers` CPU decode processes over one store's encoded bytes (`data`, a memory map of the
    store's file; None for a folder read in place, whose `files` the rows name by index), used as
    the CPU decoder (`submit`, `collect`) of every pipeline of a loader, from their threads at once.
    Raises RuntimeError where processes can't be used here."""

    name = "cpu"

    def __init__(
        self,
        data: np.memmap | None,
        workers: int,
        device: torch.device = torch.device("cpu"),
        files=None,
        tickets: int = 2,
    ):
        self.tickets = tickets  # per ready worker in each share (`Tuning.tickets`): taken as they come free
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if data is not None and (not isinstance(data, np.memmap) or data.filename is None):
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.device, self.size = device, workers
        self._board = Board(files=files)
        self._base, self._nbytes = (0, 0) if data is None else (data.ctypes.data, data.nbytes)
        store = ("", 0) if data is None else (str(data.filename), int(data.offset))
        setup = protocol.WorkerSetup(
            store=store[0],
            offset=store[1],
            nbytes=self._nbytes,
            parent=os.getpid(),
            index=0,
            board_fd=self._board.fd,
            board_rows=self._board.size,
            tickets_fd=-1,
            done_fd=-1,
            files_fd=self._board.files_fd,
            files_size=self._board.files_size,
        )
        self._relay = Relay(setup, workers, [self._board])
        self._staging = PinnedStaging(alloc=self._segment)  # the pixels' segments
        self._jobs: dict[int, Job] = {}  # by first row
        self._tickets: dict[int, Job] = {}  # every pending ticket's first row -> its job
        self._shares = itertools.count()
        self._lock = threading.RLock()  # the jobs, the workers' states, the ticket pipe
        self._local = threading.local()  # per pipeline thread: its thread decoder
        self._thread_decoders: list[CpuDecoder] = []
        self._said: set[str] = set()
        self.busy: Counter = Counter()  # the workers' seconds: wall, and CPU (below wall: starved of cores)
        self.decoded = 0  # images decoded (or failed) in `busy_seconds`: by the workers, and by threads for them

    def _segment(self, nbytes: int) -> Segment:
        """A new shared segment for the pixels of CPU shares (page-locked on a GPU: counted, as it takes a while)."""
        t0 = time.perf_counter()
        made = Segment(nbytes, self.device)
        # (seconds are floats, which a Counter adds too; typeshed's Counter counts ints)
        self.busy.update(segments_made=1, segments_seconds=time.perf_counter() - t0)  # type: ignore[call-overload]
        return made

    @property
    def _workers(self) -> list[spawn.Worker]:
        return self._relay.workers

    @property
    def _stop(self):
        return self._relay.stop

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def threads(self) -> int:
        """Workers ready to decode (0 while they start): the scheduler sizes the CPU's share by it."""
        return len(self._relay.live(self._answered, self._died))

    @property
    def busy_seconds(self) -> float:
        """The workers' seconds decoding, summed (a worker's rate is images over these), and those of
        the threads that decoded what no worker could."""
        return self.busy["workers_wall"] + sum(threads.busy_seconds for threads in self._thread_decoders)

    @property
    def rate(self) -> float:
        """Images one worker decodes a second while it decodes: every image decoded so far over
        `busy_seconds` (0 before the first)."""
        busy = self.busy_seconds
        return self.decoded / busy if busy else 0.0

    @property
    def ready_times(self) -> list[float]:
        """When each worker ready so far was heard saying so (time.perf_counter), in order."""
        return sorted(w.ready_at for w in self._workers if w.ready_at is not None)

    def start_seconds(self) -> dict[str, float]:
        """Where the ready workers' start went, medians over them in seconds: from being started to their
        `main` (the interpreter, numpy), importing the decoders (Pillow), making nvImageCodec's decoder
        (`pixels.warm`), and from saying so to being heard; {} before any is ready."""
        steps = [
            (
                w.said.began - w.spawned_at,
                w.said.imported - w.said.began,
                w.said.warmed - w.said.imported,
                w.ready_at - w.said.warmed,
            )
            for w in self._workers
            if w.said is not None and w.ready_at is not None
        ]
        if not steps:
            return {}
        medians = np.median(np.array(steps), axis=0)
        return {name: round(float(m), 4) for name, m in zip(("python", "imports", "codec", "heard"), medians)}

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait until every worker is ready (or dead); whether all of them are ready."""
        deadline = time.monotonic() + timeout
        while self._relay.starting() and time.monotonic() < deadline:
            self._poll(0.01)
        return all(w.ready for w in self._workers)

    def submit(self, batch: Encoded, shapes: np.ndarray, asks: Asks | None = None):
        """Put the images on the board and their tickets in the pipe, `tickets` per ready
        worker (`asks` as for `CpuDecoder.submit`); with none ready, wait for one. Once the pool was
        stopped, raises `WorkersStopped` (so does `collect`, for a job the stop left unanswered)."""
        asks = asks if asks is not None else Asks.whole(len(batch))
        n = len(asks)
        if not n:
            return None
        if not self._stop.alive:
            raise WorkersStopped(STOPPED)
        capacity = asks.nbytes(shapes)  # as asked: a region's pixels, or a DCT-reduced image's, not the whole
        at = np.cumsum(capacity) - capacity
        try:  # before waiting for a worker: a new segment is page-locked, which takes a while (0.15 s on an H200 host)
            segment = self._staging.take(max(1, int(capacity.sum())))
        except (RuntimeError, OSError) as e:  # no memory to share or page-lock
            self._say(f"no shared buffer for decoded JPEGs ({e})")
            return self._fallback().submit(batch, shapes, asks)
        try:
            live = self._live(wait=True)
        except BaseException:
            self._staging.give_back(segment, None)
            raise
        if not self._stop.alive:  # stopped while waiting: its staging was drained, and this goes with it
            segment.close()
            raise WorkersStopped(STOPPED)
        if not live:
            self._staging.give_back(segment, None)
            return self._fallback().submit(batch, shapes, asks)
        files: np.ndarray | int
        if batch.file_index is None:
            begins, ends = self._ranges(batch)
            files = -1
        else:  # read in place: the worker reads the file (file_begins: given with file_index)
            begins, files = batch.file_begins, batch.file_index  # type: ignore[assignment]
            ends = begins + (batch.ends - batch.begins)
        size = math.ceil(n / (self.tickets * len(live)))
        with self._lock:
            start = self._board.room(n, [(j.start, j.start + j.n) for j in self._jobs.values()])
            if start is None:
                self._staging.give_back(segment, None)
                self._say(f"no room on the decode workers' board for {n} images: decoded on threads")
                return self._fallback().submit(batch, shapes, asks)
            self._board.post(start, begins, ends, files, at, capacity, segment, asks)
            firsts = np.arange(start, start + n, size)
            tickets = np.empty(len(firsts), protocol.TICKET)
            share = next(self._shares) % (1 << 32)
            tickets["row"], tickets["count"], tickets["share"], tickets["spare"] = (
                firsts,
                np.minimum(size, start + n - firsts),
                share,
                0,
            )
            job = Job(
                start=start,
                share=share,
                segment=segment,
                batch=batch,
                asks=asks,
                sequence={},
                pending=dict(zip(firsts.tolist(), tickets["count"].tolist())),
            )
            self._jobs[start] = job
            self._tickets.update(dict.fromkeys(job.pending, job))
            first = self._relay.send(tickets)
            job.sequence = dict(zip(firsts.tolist(), range(first, first + len(firsts))))
        return job

    def collect(self, job, device: torch.device, pin: bool) -> Decoded:
        """The decoded images on `device` (one copy from the page-locked segment if `pin`)."""
        if job is None:
            return in_place([], {})
        if not isinstance(job, Job):
            threads = self._fallback()
            part = threads.collect(job, device, pin)
            self.decoded += len(job)
            return part
        while job.pending and not job.stopped:
            self._poll(0.1)
            if any(w.dead is not None for w in self._workers):
                self._recover()
        with self._lock:
            del self._jobs[job.start]
            for first in job.pending:
                self._tickets.pop(first, None)
        if job.stopped:
            raise WorkersStopped(STOPPED)
        got = self._board.results(job.start, job.n)
        end = int(got.offsets[-1] + got.sizes[-1].prod() * 3) if len(got.kept) else 0
        base, on_done = to_device(job.segment.tensor, end, device, self._staging, job.segment, pin)
        return Decoded(
            base,
            got.offsets,
            got.sizes,
            hwc_strides(got.sizes),
            [],
            got.failed,
            on_done=on_done,
            regions=got.regions,
            cut=got.cut,
            busy=job.busy,
            done_at=got.last_done,
        )

    def _ranges(self, batch: Encoded) -> tuple[np.ndarray, np.ndarray]:
        """Where `batch`'s images (views of the store's bytes) start and end in the store."""
        shift = batch.data.data_ptr() - self._base
        begins, ends = batch.begins + shift, batch.ends + shift
        if len(begins) and (begins.min() < 0 or ends.max() > self._nbytes or (ends < begins).any()):
            raise ValueError("decode workers can only decode byte ranges of the store they were started on")
        return begins, ends

    def _live(self, wait: bool) -> list[int]:
        """Indices of the ready, living workers; with `wait`, wait for one while any is starting."""
        while True:
            live = self._relay.live(self._answered, self._died)
            if live or not wait or not self._relay.starting() or not self._stop.alive:
                return live
            time.sleep(0.01)

    def _poll(self, timeout: float) -> None:
        """Read what the workers sent (waiting up to `timeout` for something); once they were
        stopped, every share still waiting for them is stopped."""
        if not self._relay.poll(timeout, self._answered, self._died):
            with self._lock:
                for job in self._jobs.values():
                    job.stopped = job.stopped or bool(job.pending)

    def _answered(self, records: np.ndarray) -> None:
        """Done records: their tickets are answered."""
        wall, cpu = float(records["wall"].sum()), float(records["cpu"].sum())
        self.busy.update(workers_wall=wall, workers_cpu=cpu)  # type: ignore[call-overload]  # (floats: as above)
        self.decoded += int(records["count"].sum())
        with self._lock:
            answers = zip(records["row"].tolist(), records["share"].tolist(), records["wall"].tolist())
            for first, share, wall in answers:
                job = self._tickets.get(first)
                if job is not None and job.share == share:  # else a late answer for rows now another share's
                    del self._tickets[first]
                    job.pending.pop(first, None)
                    job.busy += wall

    def _died(self, k: int, why: str) -> None:
        """Worker `k` is found gone (said once, unless the pool is stopping; `_recover` takes its tickets)."""
        worker = self._workers[k]
        if worker.dead is None and self._stop.alive:
            left = sum(w.dead is None for w in self._workers) - 1
            self._say(
                f"JPEG decode worker {worker.proc.pid} stopped ({why}); {left} of "
                f"{len(self._workers)} workers remain, its images are decoded on threads"
            )

    def _recover(self) -> None:
        """Decode on threads the tickets no living worker will answer (`Job.lost`)."""
        now, dead = time.monotonic(), [w.dead is not None for w in self._workers]
        unread = self._relay.unread()
        if unread is None:
            return
        with self._lock:
            read_upto = self._relay.written - unread  # the tickets before it were read
            for job in list(self._jobs.values()):
                for first, count in job.lost(self._board, dead, read_upto, now).items():
                    self._on_threads(job, first, count)
                    del job.pending[first]
                    self._tickets.pop(first, None)

    def _on_threads(self, job: Job, first: int, count: int) -> None:
        """Decode a lost ticket's rows on threads, into the segment, and complete the rows."""
        positions = list(range(first - job.start, first - job.start + count))
        threads = self._fallback()
        part = threads.collect(
            threads.submit(job.batch.take(positions), None, job.asks.take(positions)), torch.device("cpu"), False
        )
        job.busy += part.busy
        self.decoded += count
        self._board.answer(job.start, positions, part, job.asks, job.segment, part.done_at)

    def _fallback(self) -> CpuDecoder:
        """This thread's decoder on threads (a thread decoder serves one caller at a time)."""
        threads = getattr(self._local, "threads", None)
        if threads is None:
            threads = self._local.threads = CpuDecoder(max(1, self.size))
            with self._lock:
                self._thread_decoders.append(threads)
        if not any(w.dead is None for w in self._workers):
            self._say(f"no JPEG decode worker is left: the CPU decodes on {threads.threads} threads")
        return threads

    def _say(self, message: str) -> None:
        with self._lock:
            if message in self._said:
                return
            self._said.add(message)
        log.warning("gpufeed: %s", message)

    def close(self) -> None:
        """Stop the workers (also done when the pool is garbage-collected or the interpreter exits)."""
        self._stop()
        for threads in self._thread_decoders:
            threads.close()
        for segment in self._staging.drain():
            segment.close()
