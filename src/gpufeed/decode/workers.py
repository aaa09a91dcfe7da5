"""CPU JPEG decoding in worker processes, written straight into shared buffers.

Why processes: decode threads in the training process would share its GIL with the training loop.
Why not multiprocessing: a forked worker inherits the loader's threads and locks; a spawned or
forkserver one imports the user's `__main__` (re-running an unguarded script) and leaves a server
process behind. Each worker here is a fresh interpreter started with exec (`spawn`,
`python -m gpufeed.decode.worker`), talking over its own stdin and stdout (`protocol`).

Lifecycle: workers start in the background; until one says `Ready`, `threads` is 0 and the
scheduler gives the CPU no share (the GPU decoders serve the first batches). A worker ends when its
stdin closes (at `close()`, when the pool is garbage-collected or the interpreter exits, or when the
loader's process dies) and within a quarter second of its parent going away, SIGKILL included. A
worker that dies is named in one warning; its images are decoded on threads, and the others go on.

Pixels: a batch's CPU share is decoded into a `segment.Segment` of the loader's process, page-locked
on a GPU, so its pixels reach the device in one DMA copy.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import select
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from gpufeed.decode import protocol, spawn
from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, WorkersStopped, hwc_strides, in_place, to_device
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.decode.segment import Segment, unavailable

log = logging.getLogger(__name__)

STOPPED = "the JPEG decode workers were stopped (the loader was closed, or the interpreter is exiting)"


@dataclass
class _Job:
    """One batch's CPU share on its way through the workers."""

    ticket: int
    segment: Segment
    at: np.ndarray  # where each image goes in the segment
    capacity: np.ndarray  # how many bytes each may take there
    batch: Encoded  # kept to decode on threads if a worker dies
    reduce_to: list
    regions: list
    chunks: dict[int, tuple[int, int]] = field(default_factory=dict)  # first -> (worker, stop) until answered
    done: list = field(default_factory=list)  # ChunkDone
    finished: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False  # chunks left unanswered because the pool was stopped


class DecodeWorkers:
    """`workers` CPU decode processes over one store's encoded bytes (`data`, a memory map of the
    store's file), used as the CPU decoder (`submit`, `collect`) of every pipeline of a loader, from
    their threads at once. Raises RuntimeError where processes can't be used here.

    Threads: the pipelines' (submit writes chunks to a worker's stdin under a lock; collect waits on
    its job's event) and one reader, `gpufeed-decode-replies`, that reads every worker's stdout and
    routes each reply to its job (it holds the pool only weakly: dropping the pool stops it)."""

    name = "cpu"

    def __init__(self, data: np.memmap | None, workers: int, device: torch.device = torch.device("cpu")):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if data is not None and (not isinstance(data, np.memmap) or data.filename is None):
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.device, self.size = device, workers
        if data is None:  # a folder read in place: each job names its file
            self._base, self._nbytes = 0, 0
            setup = protocol.WorkerSetup("", 0, 0, os.getpid())
        else:
            self._base, self._nbytes = data.ctypes.data, data.nbytes
            setup = protocol.WorkerSetup(str(data.filename), int(data.offset), int(data.nbytes), os.getpid())
        self._workers: list[spawn.Worker] = spawn.start(setup, workers)
        self._stop = weakref.finalize(self, spawn.stop, self._workers)
        self._staging = PinnedStaging(alloc=lambda nbytes: Segment(nbytes, device))
        self._tickets = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.RLock()  # the jobs, the workers' states, their stdin
        self._local = threading.local()  # per pipeline thread: its thread decoder, its last finish time
        self._thread_decoders: list[CpuDecoder] = []
        self._said: set[str] = set()
        self._next = 0  # round-robin start
        self.busy: Counter = Counter()  # the workers' seconds: wall, and CPU (below wall: starved of cores)
        threading.Thread(target=_read, args=(weakref.ref(self),), daemon=True, name="gpufeed-decode-replies").start()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def threads(self) -> int:
        """Workers ready to decode (0 while they start): the scheduler sizes the CPU's share by it."""
        return sum(w.ready and w.dead is None for w in self._workers)

    @property
    def last_done(self) -> float:
        """When the last image of this thread's last `collect` finished decoding (a perf_counter)."""
        return getattr(self._local, "last_done", 0.0)

    def _starting(self) -> bool:
        return any(not w.ready and w.dead is None for w in self._workers)

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait until every worker is ready (or dead); whether all of them are ready."""
        deadline = time.monotonic() + timeout
        while self._starting() and time.monotonic() < deadline:
            time.sleep(0.01)
        return all(w.ready for w in self._workers)

    def submit(self, batch: Encoded, shapes: np.ndarray, reduce_to: list, regions: list | None = None):
        """Put the images on the ready workers in chunks, two per worker (byte ranges and where to write;
        `reduce_to`, `regions` as for `decode_one`); with none ready, wait for one. Once the pool was
        stopped, raises `WorkersStopped` (so does `collect`, for a job the stop left unanswered)."""
        regions = regions or [None] * len(reduce_to)
        if not len(reduce_to):
            return None
        if not self._stop.alive:
            raise WorkersStopped(STOPPED)
        live = self._live(wait=True)
        if not live:
            return self._fallback().submit(batch, shapes, reduce_to, regions)
        capacity = shapes[:, 0].astype(np.int64) * shapes[:, 1] * 3
        at = np.cumsum(capacity) - capacity
        try:
            segment = self._staging.take(max(1, int(capacity.sum())))
        except (RuntimeError, OSError) as e:  # no memory to share or page-lock
            self._say(f"no shared buffer for decoded JPEGs ({e})")
            return self._fallback().submit(batch, shapes, reduce_to, regions)
        if batch.files is None:
            begins, ends = self._ranges(batch)
            paths = [None] * len(begins)
        else:  # read in place: the worker reads the file
            begins = batch.file_begins
            ends, paths = begins + (batch.ends - batch.begins), list(batch.files)
        jobs = [protocol.Job(*job) for job in zip(begins.tolist(), ends.tolist(), at.tolist(), capacity.tolist(),
                                                  reduce_to, regions, paths)]
        job = _Job(next(self._tickets), segment, at, capacity, batch, reduce_to, regions)
        size = math.ceil(len(jobs) / (2 * len(live)))
        with self._lock:
            self._jobs[job.ticket] = job
            for n, first in enumerate(range(0, len(jobs), size)):
                k = live[(self._next + n) % len(live)]
                job.chunks[first] = (k, min(first + size, len(jobs)))
            self._next += 1
            for first, (k, stop) in list(job.chunks.items()):
                self._send(k, protocol.Chunk(job.ticket, first, segment.fd, segment.id, segment.nbytes,
                                             jobs[first:stop]))
        return job

    def collect(self, job, device: torch.device, pin: bool) -> Decoded:
        """The decoded images on `device` (one copy from the page-locked segment if `pin`)."""
        if job is None:
            return in_place([], {})
        if not isinstance(job, _Job):
            threads = self._fallback()
            part = threads.collect(job, device, pin)
            self._local.last_done = threads.last_done
            return part
        job.finished.wait()
        with self._lock:
            del self._jobs[job.ticket]
            self.busy.update(workers_wall=sum(d.wall for d in job.done), workers_cpu=sum(d.cpu for d in job.done))
        if job.stopped:
            raise WorkersStopped(STOPPED)
        results: list = []
        for done in sorted(job.done, key=lambda d: d.first):
            results += done.results
        kept = [k for k, r in enumerate(results) if not isinstance(r, str)]
        failed = {k: r for k, r in enumerate(results) if isinstance(r, str)}
        sizes = np.array([(results[k].height, results[k].width) for k in kept], np.int64).reshape(-1, 2)
        self._local.last_done = max((results[k].done for k in kept), default=0.0)
        regions = [results[k].region for k in kept]
        offsets = job.at[kept]
        end = int(offsets[-1] + sizes[-1].prod() * 3) if kept else 0
        base, on_done = to_device(job.segment.tensor, end, device, self._staging, job.segment, pin)
        return Decoded(base, offsets, sizes, hwc_strides(sizes), [], failed, on_done=on_done, regions=regions)

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
            live = [k for k, w in enumerate(self._workers) if w.ready and w.dead is None]
            if live or not wait or not self._starting():
                return live
            time.sleep(0.01)

    def _send(self, k: int, chunk: protocol.Chunk) -> None:
        """Write `chunk` to worker `k` (under the lock)."""
        try:
            protocol.write(self._workers[k].proc.stdin.fileno(), chunk)
        except (OSError, ValueError) as e:  # ValueError: its pipe was closed here
            self._died(k, f"{type(e).__name__}: {e}")

    def _poll(self, timeout: float) -> None:
        """Read whatever the workers have sent (waiting up to `timeout` for something); note deaths.
        Only the reader thread calls this."""
        open_ = {w.proc.stdout.fileno(): k for k, w in enumerate(self._workers) if w.dead is None}
        if not open_:
            time.sleep(timeout)
            return
        readable, _, _ = select.select(list(open_), [], [], timeout)
        for fd in readable:
            k = open_[fd]
            try:
                message = protocol.read(fd)
            except EOFError:
                self._workers[k].proc.wait(timeout=5)
                with self._lock:
                    self._died(k, f"exit code {self._workers[k].proc.returncode}")
                continue
            if isinstance(message, protocol.Ready):
                self._workers[k].ready = True
                continue
            with self._lock:
                job = self._jobs.get(message.ticket) if isinstance(message, protocol.ChunkDone) else None
                if job is not None and job.chunks.pop(message.first, None) is not None:
                    job.done.append(message)
                    if not job.chunks:
                        job.finished.set()

    def _died(self, k: int, why: str) -> None:
        """Worker `k` is gone (called under the lock, said once): its unanswered chunks are decoded on
        threads. Again for a worker already known dead: a job may have been given it meanwhile."""
        worker = self._workers[k]
        if not self._stop.alive:  # the pool is stopping (close(), the interpreter's exit): no death to tell of
            worker.dead = worker.dead or why
            self._unanswered(k)
            return
        if worker.dead is None:
            worker.dead = why
            left = sum(w.dead is None for w in self._workers)
            self._say(f"JPEG decode worker {worker.proc.pid} stopped ({why}); {left} of "
                      f"{len(self._workers)} workers remain, its images are decoded on threads")
        for job in list(self._jobs.values()):
            for first, (owner, stop) in list(job.chunks.items()):
                if owner == k:
                    del job.chunks[first]
                    job.done.append(self._on_threads(job, first, stop))
            if not job.chunks:
                job.finished.set()

    def _on_threads(self, job: _Job, first: int, stop: int) -> protocol.ChunkDone:
        """Decode a lost chunk (positions `first` to `stop`) on threads, into the segment."""
        positions = list(range(first, stop))
        threads = self._fallback()
        part = threads.collect(threads.submit(job.batch.take(positions), None, [job.reduce_to[p] for p in positions],
                                              [job.regions[p] for p in positions]), torch.device("cpu"), False)
        results: list = []
        images = iter(zip(part.offsets.tolist(), part.sizes.tolist(), part.regions or [None] * len(part.sizes)))
        for k, p in enumerate(positions):
            if k in part.failed:
                results.append(part.failed[k])
                continue
            offset, (h, w), region = next(images)
            n = h * w * 3
            if n > job.capacity[p]:
                results.append("decoded to a size larger than the store records")
                continue
            job.segment.tensor[job.at[p] : job.at[p] + n] = part.base[offset : offset + n]
            results.append(protocol.Image(h, w, threads.last_done, region))
        return protocol.ChunkDone(job.ticket, first, results, 0.0, 0.0)

    def _unanswered(self, owner: int | None = None) -> None:
        """The pool was stopped: wake every job waiting for a chunk (of worker `owner`, or of any), its
        `collect` raises `WorkersStopped` (called under the lock)."""
        for job in self._jobs.values():
            for first, (k, _) in list(job.chunks.items()):
                if owner is None or k == owner:
                    del job.chunks[first]
                    job.stopped = True
            if job.stopped and not job.chunks:
                job.finished.set()

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


def _read(pool_ref: weakref.ref) -> None:
    """The reader thread: route the workers' replies until the pool is closed or dropped."""
    while (pool := pool_ref()) is not None and pool._stop.alive:
        try:
            pool._poll(0.2)
        except Exception as e:  # a pipe closed under us (the pool is closing), or a garbled reply
            if pool._stop.alive:  # nobody routes replies now: what the workers had is decoded on threads
                with pool._lock:
                    for k in range(len(pool._workers)):
                        pool._died(k, f"the reply reader failed ({type(e).__name__}: {e})")
                return
        del pool
    if pool is not None:  # closed (close(), or the interpreter's exit): wake whoever waits for a reply
        with pool._lock:
            pool._unanswered()

