"""CPU JPEG decoding in worker processes, written straight into shared buffers the GPU reads.

Decode threads in the loader's process share its GIL with the pipelines' Python: a thread whose
libjpeg call returns waits for the GIL behind busy pipeline threads, so 9 threads decoded 3 % of
each batch (H100, benchmarks/jpeg_bench.py). Worker processes have interpreters of their own. Each
maps the store's encoded bytes itself, decodes (libjpeg-turbo, or Pillow with DCT reduction, as the
thread decoder does) and writes HWC pixels into a shared-memory segment that the loader's process
page-locked for the GPU; the resize kernel reads them in place. The pipes carry byte ranges out and
decoded sizes back, never pixels.

The workers are one pool for all the loader's pipelines: a pipeline cuts its CPU share into small
chunks on one task queue, and any idle worker takes the next. A worker given to one pipeline sat
idle about a third of each batch, while its pipeline resized, handed the batch over and waited for
the next (H100, `decode.workers_wall` against the batch's time).

Linux only (forkserver, /dev/shm). Where processes can't run, or a worker dies, the loader says so once
and decodes on threads instead.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

from gpufeed.decode.base import Decoded, Encoded, PinnedStaging, hwc_strides
from gpufeed.decode.cpu import CpuDecoder, decode_one
from gpufeed.store.reader import as_tensor
from gpufeed.transfer.uva import Registration, device_view

log = logging.getLogger(__name__)
SHM = Path("/dev/shm")
WAIT_CHECK = 1.0  # seconds of waiting for a reply after which the workers are checked for life


class Segment:
    """A shared-memory buffer the workers open by path; page-locked and mapped for `device` if CUDA."""

    def __init__(self, nbytes: int, device: torch.device):
        free = os.statvfs(SHM)
        if nbytes > free.f_bavail * free.f_frsize:  # touching pages past the limit would be a SIGBUS
            raise RuntimeError(f"{SHM} has {free.f_bavail * free.f_frsize / 1e6:.0f} MB free, "
                               f"a decode buffer needs {nbytes / 1e6:.0f} MB")
        self._shm = SharedMemory(create=True, size=nbytes)
        self.path = str(SHM / self._shm.name.lstrip("/"))
        self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        self._registration = None
        self.view = self.tensor
        if device.type == "cuda":
            self._registration = Registration(self.tensor.data_ptr(), nbytes)
            self.view = device_view(self.tensor.data_ptr(), (nbytes,), device)

    def numel(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        self.view = self.tensor = self._registration = None
        self._shm.close()
        self._shm.unlink()


def _serve(tasks, replies: list, lifeline: Connection, path: str, offset: int, nbytes: int) -> None:
    """A worker: decode the chunks that come from the pool's `tasks` queue, each reply on its
    pipeline's channel of `replies`, until told to stop (None) or its `lifeline` closes: the loader's
    process is gone (the queue alone would never say so: every worker holds both of its ends)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle; it stops us
    threading.Thread(target=_exit_when_closed, args=(lifeline,), daemon=True).start()
    # no GPU here: nvImageCodec, even for its CPU backend, would make a CUDA context (GPU memory) per worker
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,)).view(np.ndarray)
    segments: dict[str, np.memmap] = {}
    while (task := tasks.get()) is not None:
        lane, ticket, first, segment, jobs = task
        if segment not in segments:
            segments[segment] = np.memmap(segment, dtype=np.uint8, mode="r+")
        wall, cpu = time.perf_counter(), time.process_time()
        results = _decode(data, segments[segment], jobs)
        replies[lane].send((ticket, first, results, time.perf_counter() - wall, time.process_time() - cpu))


def _exit_when_closed(lifeline: Connection) -> None:
    """End this process once the other end of `lifeline` (the loader's) closes."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)


def _decode(data: np.ndarray, out: np.ndarray, jobs: list[tuple]) -> list[tuple | str]:
    """Decode (begin, end, at, capacity, reduce_to, region) jobs into `out` (see `decode_one`): (height,
    width, finish time, region decoded) per image, or why it failed."""
    results: list = []
    for begin, end, at, capacity, reduce_to, region in jobs:
        try:
            pixels, region, done = decode_one(as_tensor(data[begin:end]), reduce_to, region)
            if pixels.numel() > capacity:
                raise ValueError(f"decoded to {tuple(pixels.shape[:2])}, larger than the size the store records")
            out[at : at + pixels.numel()] = pixels.reshape(-1).numpy()
            results.append((pixels.shape[0], pixels.shape[1], done, region))
        except Exception as e:  # any decoder error marks this image, never the chunk
            results.append(f"{type(e).__name__}: {e}")
    return results


def unavailable() -> str | None:
    """Why decode worker processes can't run here, or None if they can."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or not SHM.is_dir():
        return "decode worker processes need forkserver and /dev/shm (Linux)"
    return None


def process_context():
    """forkserver: workers forked from a clean single-threaded server (preloaded with the decoders),
    never from the loader's process, whose CUDA and decoder threads make fork unsafe."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


@dataclass
class Span:
    """Where a store's encoded bytes lie in this process's memory (the workers map them themselves)."""

    base: int
    nbytes: int

    def ranges(self, batch: Encoded) -> tuple[np.ndarray, np.ndarray]:
        """Where `batch`'s images (views of the store's bytes) start and end in the store."""
        shift = batch.data.data_ptr() - self.base
        begins, ends = batch.begins + shift, batch.ends + shift
        if len(begins) and (begins.min() < 0 or ends.max() > self.nbytes):
            raise ValueError("decode workers can only decode views of the store they were started on")
        return begins, ends


class _Channel:
    """One pipeline's replies: a pipe that every worker may write to (one at a time) and that pipeline
    reads alone."""

    def __init__(self, ctx):
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._lock = ctx.Lock()

    def send(self, message) -> None:
        with self._lock:
            self._writer.send(message)

    def poll(self, timeout: float) -> bool:
        return self._reader.poll(timeout)

    def recv(self):
        return self._reader.recv()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


@dataclass
class Lane:
    """Pipeline `k`'s way to the pool: the shared task queue, its own reply channel, the workers'
    process ids (to tell a dead worker from a slow one), and its fair share of them in `threads`."""

    k: int
    tasks: object
    replies: _Channel
    pids: list[int]
    workers: int
    threads: int

    def dead(self) -> int | None:
        """The pid of a worker that is gone, or None."""
        for pid in self.pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return pid
            except PermissionError:
                pass
        return None


class DecodeWorkers:
    """`workers` decode processes over one store's encoded bytes, a pool for `lanes` pipelines: each
    pipeline puts chunks on the one task queue and reads the replies on a channel of its own
    (`lane`). Raises RuntimeError when processes can't be used here (no forkserver, no /dev/shm)."""

    def __init__(self, data: np.memmap, workers: int, lanes: int = 1):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if not isinstance(data, np.memmap) or data.filename is None:
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.workers, self.lanes = workers, lanes
        self.span = Span(data.ctypes.data, data.nbytes)
        ctx = process_context()
        self._tasks, self._replies = ctx.SimpleQueue(), [_Channel(ctx) for _ in range(lanes)]
        self._procs, self._lifelines = [], []  # a worker ends when its lifeline closes
        for _ in range(workers):
            theirs, mine = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_serve, args=(self._tasks, self._replies, theirs, data.filename, data.offset,
                                                    data.nbytes), daemon=True, name="gpufeed-decode")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._lifelines.append(mine)

    def lane(self, k: int) -> Lane:
        """Pipeline `k`'s way to the pool (`k` below `lanes`)."""
        if not 0 <= k < self.lanes:
            raise ValueError(f"lane {k} of a pool for {self.lanes} pipelines")
        return Lane(k, self._tasks, self._replies[k], [p.pid for p in self._procs], self.workers,
                    max(1, self.workers // self.lanes))

    def close(self) -> None:
        """Stop the workers: a None each, as a process forked from the loader's since (its planner)
        holds their lifelines open too."""
        for _ in self._procs:
            self._tasks.put(None)
        for lifeline in self._lifelines:
            lifeline.close()
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self._tasks.close()
        for channel in self._replies:
            channel.close()


@dataclass
class _Job:
    segment: Segment
    at: np.ndarray  # where each image goes in the segment
    total: int  # bytes of the segment the images may fill
    chunks: int  # how many replies it has coming
    ticket: int  # tags its chunks' replies: the channel may carry replies of two jobs (a batch and its retries)
    batch: Encoded  # kept to decode again on threads if a worker died
    reduce_to: list
    regions: list
    replies: list = field(default_factory=list)


class ProcessDecoder:
    """One pipeline's use of the worker pool (`lane`, over the store bytes at `span` in this process):
    `submit`/`collect` like `CpuDecoder`, images in this pipeline's own shared buffers, reused once the
    kernels reading them have run. The pipeline may be in another process than the workers' owner."""

    name = "cpu"

    def __init__(self, span: Span, lane: Lane, device: torch.device):
        self.span, self.lane, self.device = span, lane, device
        self.threads = lane.threads
        self._last_done = 0.0
        self._staging = PinnedStaging(alloc=lambda nbytes: Segment(nbytes, device))
        self._threads: CpuDecoder | None = None  # once a worker died
        # seconds the workers spent on this pipeline's chunks: wall, and CPU (less than wall: starved of cores)
        self.busy: Counter = Counter()
        self._tickets = itertools.count()
        self._jobs: dict[int, _Job] = {}  # submitted, not collected: where replies read early go

    @property
    def last_done(self) -> float:
        """When the last image of the last `collect` finished decoding (a worker's perf_counter)."""
        return self._threads.last_done if self._threads is not None else self._last_done

    def submit(self, batch: Encoded, shapes: np.ndarray, reduce_to: list, regions: list | None = None):
        """Put the images on the pool's queue in chunks (byte ranges, where to write; `reduce_to`,
        `regions` as for `decode_one`): two per worker, so idle workers share a batch evenly."""
        regions = regions or [None] * len(reduce_to)
        if self._threads is None:
            capacity = shapes[:, 0].astype(np.int64) * shapes[:, 1] * 3
            at = np.cumsum(capacity) - capacity
            try:
                segment = self._staging.take(max(1, int(capacity.sum())))
            except (RuntimeError, OSError) as e:  # /dev/shm full (a container's default 64 MB), no pinning
                self._to_threads(f"no shared buffer for decoded JPEGs ({e})")
                return self._threads.submit(batch, shapes, reduce_to, regions)
            begins, ends = self.span.ranges(batch)
            jobs = list(zip(begins.tolist(), ends.tolist(), at.tolist(), capacity.tolist(), reduce_to, regions))
            size = math.ceil(len(jobs) / (2 * self.lane.workers)) or 1
            firsts = range(0, len(jobs), size)
            job = _Job(segment, at, int(capacity.sum()), len(firsts), next(self._tickets), batch, reduce_to, regions)
            self._jobs[job.ticket] = job
            try:
                for k in firsts:
                    self.lane.tasks.put((self.lane.k, job.ticket, k, segment.path, jobs[k : k + size]))
                return job
            except OSError as e:
                self._broken(e, job)
        return self._threads.submit(batch, shapes, reduce_to, regions)

    def collect(self, job, device: torch.device, pin: bool) -> Decoded:
        """The decoded images where `device` reads them: in place in the shared buffer if `pin`."""
        if not isinstance(job, _Job):
            return self._threads.collect(job, device, pin)
        try:
            self._wait(job)
        except (EOFError, OSError) as e:
            self._broken(e, job)
            return self._threads.collect(self._threads.submit(job.batch, None, job.reduce_to, job.regions), device, pin)
        replies = sorted(job.replies, key=lambda r: r[1])
        results = [r for _, _, chunk, _, _ in replies for r in chunk]
        self.busy.update(workers_wall=sum(r[3] for r in replies), workers_cpu=sum(r[4] for r in replies))
        kept = [k for k, r in enumerate(results) if not isinstance(r, str)]
        failed = {k: r for k, r in enumerate(results) if isinstance(r, str)}
        sizes = np.array([results[k][:2] for k in kept], np.int64).reshape(-1, 2)
        strides = hwc_strides(sizes)
        self._last_done = max((results[k][2] for k in kept), default=0.0)
        offsets, regions = job.at[kept], [results[k][3] for k in kept]
        if pin:
            return Decoded(job.segment.view, offsets, sizes, strides, [job.segment], failed,
                           on_done=lambda done: self._staging.give_back(job.segment, done), regions=regions)
        base = job.segment.tensor[: job.total].clone().to(device)
        self._staging.give_back(job.segment, None)
        return Decoded(base, offsets, sizes, strides, [], failed, regions=regions)

    def _wait(self, job: _Job) -> None:
        """Read this pipeline's replies until `job` has all of its own (others' go to their jobs);
        raises OSError if a worker died meanwhile: its chunk may never come."""
        channel = self.lane.replies
        while len(job.replies) < job.chunks:
            if not channel.poll(WAIT_CHECK):
                if (pid := self.lane.dead()) is not None:
                    raise OSError(f"worker {pid} is gone")
                continue
            reply = channel.recv()
            if reply[0] in self._jobs:
                self._jobs[reply[0]].replies.append(reply)
        del self._jobs[job.ticket]

    def _broken(self, error: BaseException, job: _Job) -> None:
        self._jobs.pop(job.ticket, None)
        self._staging.give_back(job.segment, None)
        self._to_threads(f"a JPEG decode worker process died ({type(error).__name__}: {error})")

    def _to_threads(self, why: str) -> None:
        """Decode on threads from now on (once: a batch and its retries may both find a worker dead)."""
        if self._threads is None:
            log.warning("gpufeed: %s; this pipeline decodes on %d threads from now on", why, self.threads)
            self._threads = CpuDecoder(self.threads)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.close()
        for segment in self._staging.drain():
            segment.close()
