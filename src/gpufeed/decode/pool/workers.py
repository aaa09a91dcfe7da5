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

Lifecycle: the workers are the process's (`shared`): a loader takes running ones where there are
(no start at all), else they start in the background; until one says `Ready`, `threads` is 0 and
the scheduler gives the CPU no share (the GPU decoders serve the first batches). A loader gives them
back at `close()` or when it is garbage-collected; they end `shared.IDLE_SECONDS` after the last
loader gave them back (or after they were started ahead of a loader that never took them:
`shared.start_ahead`), when the interpreter exits, or within a quarter second of their process
going away, SIGKILL included. A worker that dies is named in one warning; the tickets it held (or
that nobody can take any more) are decoded on threads, and the others go on.

Pixels: a batch's CPU share is decoded into a `segment.Segment` of the loader's process, page-locked
on a GPU, so its pixels reach the device in one DMA copy.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter

import numpy as np
import torch

from gpufeed.decode.asks import Asks
from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, WorkersStopped, hwc_strides, in_place, to_device
from gpufeed.decode.codecs.cpu import CpuDecoder
from gpufeed.decode.pool import board, protocol, shared, spawn
from gpufeed.decode.pool.jobs import Job, Tally
from gpufeed.decode.pool.segment import Segment, unavailable
from gpufeed.logs import logger

log = logger(__name__)

STOPPED = "the JPEG decode workers were stopped (the loader was closed, or the interpreter is exiting)"


class DecodeWorkers:
    """`workers` CPU decode processes (the process's, shared with its other loaders: `shared`) over one
    store's encoded bytes (`data`, a memory map of the store's file; None for a folder read in place,
    whose `files` the rows name by index), used as the CPU decoder (`submit`, `collect`) of every
    pipeline of a loader, from their threads at once. Raises RuntimeError where processes can't be
    used here."""

    name = "cpu"

    def __init__(
        self,
        data: np.memmap | None,
        workers: int,
        device: torch.device = torch.device("cpu"),
        files=None,
        tickets: int = 2,
    ):
        self.tickets = tickets  # per living worker in each share (`Tuning.tickets`): taken as they come free
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if data is not None and (not isinstance(data, np.memmap) or data.filename is None):
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.device, self.size = device, workers
        self._base, self._nbytes = (0, 0) if data is None else (data.ctypes.data, data.nbytes)
        described = (
            protocol.Source.of_files(files or [])
            if data is None
            else protocol.Source.of_store(str(data.filename), int(data.offset), self._nbytes)
        )
        self._source = board.source(described)
        self._staging = PinnedStaging(alloc=self._segment)  # the pixels' segments
        self.tally = Tally()
        self.made_at = time.perf_counter()
        self._pool = shared.take(workers)
        self.reused = self._pool.taken > 1  # its workers were started for an earlier loader
        self._stop = weakref.finalize(self, shared.release, self._pool, self.tally)
        self._said: set[str] = set()

    def _segment(self, nbytes: int) -> Segment:
        """A new shared segment for the pixels of CPU shares (page-locked on a GPU: counted, as it takes a while)."""
        t0 = time.perf_counter()
        made = Segment(nbytes, self.device)
        # (seconds are floats, which a Counter adds too; typeshed's Counter counts ints)
        self.busy.update(segments_made=1, segments_seconds=time.perf_counter() - t0)  # type: ignore[call-overload]
        return made

    @property
    def stopped(self) -> bool:
        """Closed, or the workers were stopped (the interpreter is exiting)."""
        return not self._stop.alive or not self._pool.alive

    @property
    def busy(self) -> Counter:
        """Seconds by kind: the workers' wall and CPU seconds (CPU below wall: starved of cores), the
        threads' seconds decoding for them, shared segments made and the seconds that took."""
        return self.tally.busy

    @property
    def decoded(self) -> int:
        """Images decoded (or failed) in `busy_seconds`: by the workers, and by threads for them."""
        return self.tally.decoded

    @property
    def _workers(self) -> list[spawn.Worker]:
        return self._pool.workers

    @property
    def _relay(self):
        return self._pool.relay

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def threads(self) -> int:
        """Workers ready to decode (0 while they start): the scheduler sizes the CPU's share by it."""
        return len(self._pool.live())

    @property
    def busy_seconds(self) -> float:
        """The workers' seconds decoding this loader's images, summed (a worker's rate is images over
        these), and those of the threads that decoded what no worker could."""
        return self.busy["workers_wall"] + self.busy["threads_wall"]

    @property
    def rate(self) -> float:
        """Images one worker decodes a second while it decodes: every image decoded so far over
        `busy_seconds` (0 before the first)."""
        busy = self.busy_seconds
        return self.decoded / busy if busy else 0.0

    @property
    def ready_times(self) -> list[float]:
        """When each worker ready so far was ready for this loader (time.perf_counter), in order: heard
        saying so, or this loader's making for workers it found running (`reused`)."""
        return sorted(max(w.ready_at, self.made_at) for w in self._workers if w.ready_at is not None)

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
        while self._pool.starting() and time.monotonic() < deadline:
            self._poll(0.01)
        return all(w.ready for w in self._workers)

    def submit(self, batch: Encoded, shapes: np.ndarray, asks: Asks | None = None):
        """Put the images on the board and their tickets in the pipe, `tickets` per living worker, ready
        or starting (`asks` as for `CpuDecoder.submit`): a worker takes them once it is up, whether or
        not the loader has heard it say so yet; with none living, on threads. Once the pool was
        stopped, raises `WorkersStopped` (so does `collect`, for a job the stop left unanswered)."""
        asks = asks if asks is not None else Asks.whole(len(batch))
        n = len(asks)
        if not n:
            return None
        if self.stopped:
            raise WorkersStopped(STOPPED)
        capacity = asks.nbytes(shapes)  # as asked: a region's pixels, or a DCT-reduced image's, not the whole
        at = np.cumsum(capacity) - capacity
        try:  # a new segment is page-locked, which takes a while (0.15 s on an H200 host)
            segment = self._staging.take(max(1, int(capacity.sum())))
        except (RuntimeError, OSError) as e:  # no memory to share or page-lock
            self._say(f"no shared buffer for decoded JPEGs ({e})")
            return self._fallback().submit(batch, shapes, asks)
        # workers still starting take the tickets as they come up (none is waited for: one that dies
        # first leaves its tickets to `shared.WorkerPool.recover`, which decodes them on threads)
        living = self._living()
        if self.stopped:  # stopped meanwhile: its staging was drained, and this goes with it
            segment.close()
            raise WorkersStopped(STOPPED)
        if not living:
            self._staging.give_back(segment, None)
            return self._fallback().submit(batch, shapes, asks)
        files: np.ndarray | int
        if batch.file_index is None:
            begins, ends = self._ranges(batch)
            files = -1
        else:  # read in place: the worker reads the file (file_begins: given with file_index)
            begins, files = batch.file_begins, batch.file_index  # type: ignore[assignment]
            ends = begins + (batch.ends - batch.begins)
        # while workers start, the share is cut for every living one: each takes a ticket as it comes up,
        # where one or two ready first took all of the first shares, and the others, ready a moment
        # later, had none (a first batch waited for two workers' halves: issue 65's start marks)
        size = math.ceil(n / (self.tickets * living))
        try:
            job = self._pool.post(
                self._source, batch, asks, (begins, ends, files), (at, capacity, segment), size, self.tally
            )
        except WorkersStopped:  # given back meanwhile
            self._staging.give_back(segment, None)
            raise
        if job is None:
            self._staging.give_back(segment, None)
            self._say(f"no room on the decode workers' board for {n} images: decoded on threads")
            return self._fallback().submit(batch, shapes, asks)
        return job

    def collect(self, job, device: torch.device, pin: bool) -> Decoded:
        """The decoded images on `device` (one copy from the page-locked segment if `pin`)."""
        if job is None:
            return in_place([], {})
        if not isinstance(job, Job):
            threads = self._fallback()
            part = threads.collect(job, device, pin)
            self.tally.decoded += len(job)
            self.busy.update(threads_wall=part.busy)  # type: ignore[call-overload]  # (floats: as above)
            return part
        self._pool.wait(job)
        got = self._pool.finish(job)
        if got is None:
            raise WorkersStopped(STOPPED)
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

    def _living(self) -> int:
        """Workers ready or starting (0 once this loader gave them back)."""
        return self._pool.living() if self._stop.alive else 0

    def _poll(self, timeout: float) -> None:
        """Read what the workers sent, waiting up to `timeout` (`shared.WorkerPool.poll`)."""
        self._pool.poll(timeout)

    def _answered(self, records: np.ndarray) -> None:
        self._pool._answered(records)

    def _fallback(self) -> CpuDecoder:
        """This thread's decoder on threads."""
        return self._pool.fallback()

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("gpufeed: %s", message)

    def close(self) -> None:
        """Give the workers back (also done when this is garbage-collected or the interpreter exits): a
        share still waiting is stopped."""
        self._stop()
        for segment in self._staging.drain():
            segment.close()
        if not self._pool.holds(self.tally):  # else the shares left to the pool keep it until answered
            self._source.close()
