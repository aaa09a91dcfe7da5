"""CPU JPEG decoding in worker processes, written straight into shared buffers the GPU reads.

Decode threads in the loader's process share its GIL with the pipelines' Python: a thread whose
libjpeg call returns waits for the GIL behind busy pipeline threads, so 9 threads decoded 3 % of
each batch (H100, benchmarks/jpeg_bench.py). Worker processes have interpreters of their own. Each
maps the store's encoded bytes itself, decodes (libjpeg-turbo, or Pillow with DCT reduction, as the
thread decoder does) and writes HWC pixels into a shared-memory segment that the loader's process
page-locked for the GPU; the resize kernel reads them in place. Per chunk of images one small
message goes each way: byte ranges out, decoded sizes back.

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
import time
from collections import Counter
from dataclasses import dataclass
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


def _serve(conn: Connection, path: str, offset: int, nbytes: int) -> None:
    """A worker: decode the chunks that come down `conn` until told to stop (None) or the loader is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle; it stops us
    # no GPU here: nvImageCodec, even for its CPU backend, would make a CUDA context (GPU memory) per worker
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,)).view(np.ndarray)
    segments: dict[str, np.memmap] = {}
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        ticket, segment, jobs = task
        if segment not in segments:
            segments[segment] = np.memmap(segment, dtype=np.uint8, mode="r+")
        wall, cpu = time.perf_counter(), time.process_time()
        results = _decode(data, segments[segment], jobs)
        conn.send((ticket, results, time.perf_counter() - wall, time.process_time() - cpu))


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


class DecodeWorkers:
    """`workers` decode processes over one store's encoded bytes, each with a pipe of its own; the
    loader's pipelines divide them (`share`), so no thread or queue sits between a pipeline and its
    workers. Raises RuntimeError when processes can't be used here (no forkserver, no /dev/shm)."""

    def __init__(self, data: np.memmap, workers: int):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if not isinstance(data, np.memmap) or data.filename is None:
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.workers = workers
        self.span = Span(data.ctypes.data, data.nbytes)
        ctx, self._procs, self.conns = process_context(), [], []
        for _ in range(workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, data.filename, data.offset, data.nbytes), daemon=True,
                               name="gpufeed-decode")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self.conns.append(mine)

    def share(self, k: int, of: int) -> list[Connection]:
        """The pipes of pipeline `k` of `of` (every `of`-th worker): a pipe serves one pipeline only."""
        if of > len(self.conns):
            raise ValueError(f"{of} pipelines need at least as many decode workers, there are {len(self.conns)}")
        return self.conns[k::of]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:  # that worker is gone already
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
        for conn in self.conns:
            conn.close()


@dataclass
class _Job:
    segment: Segment
    at: np.ndarray  # where each image goes in the segment
    total: int  # bytes of the segment the images may fill
    conns: list[Connection]  # the workers that have a chunk of it, in order
    ticket: int  # tags its chunks' replies: a pipe may carry replies of two jobs (a batch and its retries)
    batch: Encoded  # kept to decode again on threads if a worker died
    reduce_to: list
    regions: list


class ProcessDecoder:
    """One pipeline's share of the workers (`conns`, over the store bytes at `span` in this process):
    `submit`/`collect` like `CpuDecoder`, images in this pipeline's own shared buffers, reused once the
    kernels reading them have run. The pipeline may be in another process than the workers' owner."""

    name = "cpu"

    def __init__(self, span: Span, conns: list[Connection], device: torch.device):
        self.span, self.conns, self.device = span, conns, device
        self.threads = len(conns)
        self._last_done = 0.0
        self._staging = PinnedStaging(alloc=lambda nbytes: Segment(nbytes, device))
        self._threads: CpuDecoder | None = None  # once a worker died
        # seconds the workers spent on this pipeline's chunks: wall, and CPU (less than wall: starved of cores)
        self.busy: Counter = Counter()
        self._tickets = itertools.count()
        self._early: dict[tuple[int, int], tuple] = {}  # replies read while waiting for an earlier job's

    @property
    def last_done(self) -> float:
        """When the last image of the last `collect` finished decoding (a worker's perf_counter)."""
        return self._threads.last_done if self._threads is not None else self._last_done

    def submit(self, batch: Encoded, shapes: np.ndarray, reduce_to: list, regions: list | None = None):
        """Send each worker its chunk (byte ranges, where to write; `reduce_to`, `regions` as for
        `decode_one`); the pipes carry no pixels."""
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
            size = math.ceil(len(jobs) / len(self.conns)) or 1
            job = _Job(segment, at, int(capacity.sum()), [], next(self._tickets), batch, reduce_to, regions)
            try:
                for conn, k in zip(self.conns, range(0, len(jobs), size)):
                    conn.send((job.ticket, segment.path, jobs[k : k + size]))
                    job.conns.append(conn)
                return job
            except OSError as e:
                self._broken(e, job)
        return self._threads.submit(batch, shapes, reduce_to, regions)

    def collect(self, job, device: torch.device, pin: bool) -> Decoded:
        """The decoded images where `device` reads them: in place in the shared buffer if `pin`."""
        if not isinstance(job, _Job):
            return self._threads.collect(job, device, pin)
        try:
            replies = [self._reply(conn, job.ticket) for conn in job.conns]
        except (EOFError, OSError) as e:
            self._broken(e, job)
            return self._threads.collect(self._threads.submit(job.batch, None, job.reduce_to, job.regions), device, pin)
        results = [r for _, chunk, _, _ in replies for r in chunk]
        self.busy.update(workers_wall=sum(r[2] for r in replies), workers_cpu=sum(r[3] for r in replies))
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

    def _reply(self, conn: Connection, ticket: int) -> tuple:
        """The reply to `ticket` from `conn`, keeping replies to other jobs that come first."""
        reply = self._early.pop((id(conn), ticket), None)
        while reply is None:
            got = conn.recv()
            if got[0] == ticket:
                reply = got
            else:
                self._early[(id(conn), got[0])] = got
        return reply

    def _broken(self, error: BaseException, job: _Job) -> None:
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
