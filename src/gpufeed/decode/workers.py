"""CPU JPEG decoding in worker processes, written straight into shared buffers.

Why processes: decode threads in the training process would share its GIL with the training loop.
Why not multiprocessing: a forked worker inherits the loader's threads and locks; a spawned or
forkserver one imports the user's `__main__` (re-running an unguarded script) and leaves a server
process behind. Each worker here is a fresh interpreter started with exec (`spawn`,
`python -m gpufeed.decode.worker`).

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

import fcntl
import logging
import math
import os
import select
import termios
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from gpufeed.decode import protocol, segment as shared, spawn
from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, WorkersStopped, hwc_strides, in_place, to_device
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.decode.segment import Segment, unavailable

log = logging.getLogger(__name__)

STOPPED = "the JPEG decode workers were stopped (the loader was closed, or the interpreter is exiting)"
BOARD_ROWS = 1 << 16  # images on the board at once (a few batches' CPU shares); the memfd's pages cost only once used
TICKETS_PER_WORKER = 2  # per share: the workers take them as they come free, so they end together
UNCLAIMED_GRACE = 0.05  # seconds a ticket may be read yet untaken before its reader counts as dead


@dataclass
class _Job:
    """One batch's CPU share on its way through the workers: board rows [start, start + n)."""

    start: int
    segment: Segment
    batch: Encoded  # kept to decode on threads if a worker dies
    reduce_to: list
    regions: list
    sequence: dict[int, int]  # each ticket's first row -> its place in the ticket pipe (all tickets ever written)
    pending: dict[int, int] = field(default_factory=dict)  # first row -> rows, of the tickets not answered
    unclaimed: dict[int, float] = field(default_factory=dict)  # read but not taken, when first seen so
    stopped: bool = False  # tickets left unanswered because the pool was stopped

    @property
    def n(self) -> int:
        return len(self.reduce_to)


class DecodeWorkers:
    """`workers` CPU decode processes over one store's encoded bytes (`data`, a memory map of the
    store's file; None for a folder read in place, whose `files` the rows name by index), used as
    the CPU decoder (`submit`, `collect`) of every pipeline of a loader, from their threads at once.
    Raises RuntimeError where processes can't be used here."""

    name = "cpu"

    def __init__(self, data: np.memmap | None, workers: int, device: torch.device = torch.device("cpu"),
                 files=None):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if data is not None and (not isinstance(data, np.memmap) or data.filename is None):
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.device, self.size = device, workers
        self._board = shared.Segment(BOARD_ROWS * protocol.BOARD.itemsize, torch.device("cpu"))
        self._rows = protocol.board(self._board.tensor.numpy(), BOARD_ROWS)
        self._files = None
        if files is not None:
            table = protocol.FileTable.pack(files)
            self._files = shared.Segment(len(table), torch.device("cpu"))
            self._files.tensor.numpy()[:] = np.frombuffer(table, np.uint8)
        self._tickets_r, self._tickets_w = os.pipe()
        self._done_r, done_w = os.pipe()
        self._base, self._nbytes = (0, 0) if data is None else (data.ctypes.data, data.nbytes)
        store = ("", 0) if data is None else (str(data.filename), int(data.offset))
        setup = protocol.WorkerSetup(*store, self._nbytes, os.getpid(), 0, self._board.fd, BOARD_ROWS,
                                     self._tickets_r, done_w, -1 if files is None else self._files.fd,
                                     0 if files is None else self._files.nbytes)
        try:
            self._workers: list[spawn.Worker] = spawn.start(setup, workers)
        finally:
            os.close(done_w)  # the workers hold it now
        self._stop = weakref.finalize(self, _stop, self._workers, self._tickets_w,
                                      [self._tickets_r, self._done_r], [self._board, self._files])
        self._staging = PinnedStaging(alloc=self._segment)  # the pixels' segments
        self._written = 0  # tickets written so far
        self._jobs: dict[int, _Job] = {}  # by first row
        self._tickets: dict[int, _Job] = {}  # every pending ticket's first row -> its job
        self._lock = threading.RLock()  # the jobs, the workers' states, the ticket pipe
        self._pump_lock = threading.Lock()  # one thread reads the done pipe and the workers' stdout at a time
        self._unread = b""
        self._local = threading.local()  # per pipeline thread: its thread decoder, its last finish time
        self._thread_decoders: list[CpuDecoder] = []
        self._said: set[str] = set()
        self.busy: Counter = Counter()  # the workers' seconds: wall, and CPU (below wall: starved of cores)

    def _segment(self, nbytes: int) -> Segment:
        """A new shared segment for the pixels of CPU shares (page-locked on a GPU: counted, as it takes a while)."""
        t0 = time.perf_counter()
        made = Segment(nbytes, self.device)
        self.busy.update(segments_made=1, segments_seconds=time.perf_counter() - t0)
        return made

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def threads(self) -> int:
        """Workers ready to decode (0 while they start): the scheduler sizes the CPU's share by it."""
        if self._starting() and self._pump_lock.acquire(blocking=False):
            try:
                self._pump(0.0)  # reads the `Ready`s that came
            finally:
                self._pump_lock.release()
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
            with self._pump_lock:
                self._pump(0.01)
        return all(w.ready for w in self._workers)

    def submit(self, batch: Encoded, shapes: np.ndarray, reduce_to: list, regions: list | None = None):
        """Put the images on the board and their tickets in the pipe, `TICKETS_PER_WORKER` per ready
        worker (`reduce_to`, `regions` as for `decode_one`); with none ready, wait for one. Once the
        pool was stopped, raises `WorkersStopped` (so does `collect`, for a job the stop left unanswered)."""
        regions = regions or [None] * len(reduce_to)
        n = len(reduce_to)
        if not n:
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
        if batch.file_index is None:
            begins, ends = self._ranges(batch)
            files = -1
        else:  # read in place: the worker reads the file
            begins, ends, files = batch.file_begins, batch.file_begins + (batch.ends - batch.begins), batch.file_index
        size = math.ceil(n / (TICKETS_PER_WORKER * len(live)))
        with self._lock:
            start = self._room(n)
            if start is None:
                self._staging.give_back(segment, None)
                self._say(f"no room on the decode workers' board for {n} images: decoded on threads")
                return self._fallback().submit(batch, shapes, reduce_to, regions)
            rows = self._rows[start : start + n]
            rows["begin"], rows["end"], rows["file"], rows["at"], rows["capacity"] = begins, ends, files, at, capacity
            rows["segment_fd"], rows["segment_id"], rows["segment_size"] = segment.fd, segment.id, segment.nbytes
            rows["reduce_to"] = [r or (0, 0) for r in reduce_to]
            rows["region"] = [r or (-1, -1, -1, -1) for r in regions]
            rows["worker"], rows["status"] = -1, protocol.PENDING
            firsts = np.arange(start, start + n, size)
            tickets = np.empty(len(firsts), protocol.TICKET)
            tickets["row"], tickets["count"] = firsts, np.minimum(size, start + n - firsts)
            job = _Job(start, segment, batch, reduce_to, regions,
                       dict(zip(firsts.tolist(), range(self._written, self._written + len(firsts)))),
                       dict(zip(firsts.tolist(), tickets["count"].tolist())))
            self._jobs[start] = job
            self._tickets.update(dict.fromkeys(job.pending, job))
            self._written += len(firsts)
            self._send(tickets)
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
        while job.pending and not job.stopped:
            with self._pump_lock:
                if job.pending and not job.stopped:
                    self._pump(0.1)
            if any(w.dead is not None for w in self._workers):
                self._recover()
        with self._lock:
            del self._jobs[job.start]
            for first in job.pending:
                self._tickets.pop(first, None)
        if job.stopped:
            raise WorkersStopped(STOPPED)
        rows = self._rows[job.start : job.start + job.n].copy()
        ok = rows["status"] == protocol.DECODED
        kept = np.flatnonzero(ok)
        failed = {int(k): rows["error"][k].decode(errors="replace") or "not decoded" for k in np.flatnonzero(~ok)}
        sizes = np.stack([rows["height"][kept], rows["width"][kept]], 1).astype(np.int64)
        self._local.last_done = float(rows["done"][kept].max()) if len(kept) else 0.0
        regions = [None if r[0] < 0 else tuple(r) for r in rows["decoded_region"][kept].tolist()]
        offsets = rows["at"][kept]
        end = int(offsets[-1] + sizes[-1].prod() * 3) if len(kept) else 0
        base, on_done = to_device(job.segment.tensor, end, device, self._staging, job.segment, pin)
        return Decoded(base, offsets, sizes, hwc_strides(sizes), [], failed, on_done=on_done, regions=regions)

    def _room(self, n: int) -> int | None:
        """The first row of `n` free board rows (under the lock), or None."""
        taken = sorted((j.start, j.start + j.n) for j in self._jobs.values())
        start = 0
        for a, b in taken:
            if start + n <= a:
                break
            start = max(start, b)
        return start if start + n <= BOARD_ROWS else None

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
            self.threads  # noqa: B018 (reads the `Ready`s that came)
            live = [k for k, w in enumerate(self._workers) if w.ready and w.dead is None]
            if live or not wait or not self._starting():
                return live
            time.sleep(0.01)

    def _send(self, tickets: np.ndarray) -> None:
        """Write `tickets` to the ticket pipe (under the lock), in writes the pipe never splits."""
        step = protocol.MAX_TICKETS_PER_WRITE
        try:
            for k in range(0, len(tickets), step):
                os.write(self._tickets_w, tickets[k : k + step].tobytes())
        except OSError:  # closed: the pool was stopped meanwhile; `collect` raises WorkersStopped
            pass

    def _pump(self, timeout: float) -> None:
        """Read the done records and the workers' `Ready`s that came (waiting up to `timeout` for
        something); note deaths. Called under the pump lock."""
        if not self._stop.alive:
            self._unanswered()
            return
        try:
            open_ = {w.proc.stdout.fileno(): k for k, w in enumerate(self._workers) if w.dead is None}
            readable, _, _ = select.select([self._done_r, *open_], [], [], timeout)
            if self._done_r in readable:
                self._answered(os.read(self._done_r, 1 << 16))
            for fd in readable:
                if fd in open_:
                    self._heard(open_[fd], fd)
        except (OSError, ValueError):  # a pipe closed under us: the pool was stopped
            if self._stop.alive:
                raise
            self._unanswered()

    def _answered(self, data: bytes) -> None:
        """Done records (whole ones; a part is kept for the next read): their tickets are answered."""
        data, size = self._unread + data, protocol.DONE.itemsize
        whole = len(data) // size * size
        self._unread = data[whole:]
        records = np.frombuffer(data[:whole], protocol.DONE)
        self.busy.update(workers_wall=float(records["wall"].sum()), workers_cpu=float(records["cpu"].sum()))
        with self._lock:
            for first in records["row"].tolist():
                job = self._tickets.pop(first, None)
                if job is not None:
                    job.pending.pop(first, None)

    def _heard(self, k: int, fd: int) -> None:
        """Worker `k`'s stdout is readable: its `Ready`, or its end."""
        try:
            message = protocol.read(fd)
        except EOFError:
            self._workers[k].proc.wait(timeout=5)
            with self._lock:
                self._died(k, f"exit code {self._workers[k].proc.returncode}")
            return
        if isinstance(message, protocol.Ready):
            self._workers[k].ready = True

    def _died(self, k: int, why: str) -> None:
        """Worker `k` is gone (called under the lock; said once, unless the pool is stopping)."""
        worker = self._workers[k]
        if worker.dead is None and self._stop.alive:
            left = sum(w.dead is None for w in self._workers) - 1
            self._say(f"JPEG decode worker {worker.proc.pid} stopped ({why}); {left} of "
                      f"{len(self._workers)} workers remain, its images are decoded on threads")
        worker.dead = worker.dead or why

    def _recover(self) -> None:
        """Decode on threads the tickets no living worker will answer: taken by a dead one, read but
        never taken (its reader died at once), or, with no worker left, any still in the pipe."""
        now, live = time.monotonic(), any(w.dead is None for w in self._workers)
        unread = np.zeros(1, np.int32)
        try:
            fcntl.ioctl(self._tickets_r, termios.FIONREAD, unread)
        except OSError:
            return
        with self._lock:
            read_upto = self._written - int(unread[0]) // protocol.TICKET.itemsize  # tickets before it were read
            for job in list(self._jobs.values()):
                for first, count in list(job.pending.items()):
                    owner = int(self._rows["worker"][first])
                    if live and job.sequence[first] >= read_upto:
                        continue  # still in the pipe: a living worker takes it
                    if live and owner >= 0 and self._workers[owner].dead is None:
                        continue  # being decoded
                    if live and owner < 0 and now - job.unclaimed.setdefault(first, now) < UNCLAIMED_GRACE:
                        continue
                    self._on_threads(job, first, count)
                    del job.pending[first]
                    self._tickets.pop(first, None)

    def _on_threads(self, job: _Job, first: int, count: int) -> None:
        """Decode a lost ticket's rows on threads, into the segment, and complete the rows."""
        positions = list(range(first - job.start, first - job.start + count))
        threads = self._fallback()
        part = threads.collect(threads.submit(job.batch.take(positions), None, [job.reduce_to[p] for p in positions],
                                              [job.regions[p] for p in positions]), torch.device("cpu"), False)
        images = iter(zip(part.offsets.tolist(), part.sizes.tolist(), part.regions or [None] * len(part.sizes)))
        for k, p in enumerate(positions):
            row = self._rows[job.start + p : job.start + p + 1]
            if k in part.failed:
                row["error"], row["status"] = protocol.error_text(part.failed[k]), protocol.FAILED
                continue
            offset, (h, w), region = next(images)
            if h * w * 3 > row["capacity"][0]:
                row["error"] = protocol.error_text("decoded to a size larger than the store records")
                row["status"] = protocol.FAILED
                continue
            at = int(row["at"][0])
            job.segment.tensor[at : at + h * w * 3] = part.base[offset : offset + h * w * 3]
            row["height"], row["width"], row["done"] = h, w, threads.last_done
            row["decoded_region"] = region if region is not None else (-1, -1, -1, -1)
            row["status"] = protocol.DECODED

    def _unanswered(self) -> None:
        """The pool was stopped: every job waiting for a ticket is stopped; its `collect` raises
        `WorkersStopped`."""
        with self._lock:
            for job in self._jobs.values():
                if job.pending:
                    job.stopped = True

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


def _stop(workers: list[spawn.Worker], tickets_w: int, fds: list[int], segments: list) -> None:
    """The pool's finalizer: the workers stopped, then the loader's ends of the pipes and the board."""
    spawn.stop(workers, tickets_w)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for segment in segments:
        if segment is not None:
            segment.close()
