"""CPU JPEG decoding in worker processes, written straight into shared buffers the GPU reads.

Decode threads in the loader's process share its GIL with the pipelines' Python: a thread whose
libjpeg call returns waits for the GIL behind busy pipeline threads, so 9 threads decoded 3 % of
each batch (H100, benchmarks/jpeg_bench.py). Worker processes have interpreters of their own. Each
maps the store's encoded bytes itself, decodes (libjpeg-turbo, or Pillow with DCT reduction, as the
thread decoder does) and writes CHW pixels into a shared-memory segment that the loader's process
page-locked for the GPU; the resize kernel reads them in place. Per chunk of images one small
message goes each way: byte ranges out, decoded sizes back.

Linux only (fork, /dev/shm). Where processes can't run, or a worker dies, the loader says so once
and decodes on threads instead.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

from gpufeed.decode.base import Decoded, PinnedStaging
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


_DATA: np.ndarray | None = None  # in a worker: the store's encoded bytes
_OPEN: dict[str, np.memmap] = {}  # in a worker: segments by path


def _start(path: str, offset: int, nbytes: int) -> None:
    global _DATA
    torch.set_num_threads(1)
    _DATA = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,)).view(np.ndarray)


def _ready(_: int) -> int:
    return os.getpid()


def _decode(segment: str, jobs: list[tuple]) -> list[tuple[int, int, float] | str]:
    """Decode (begin, end, at, capacity, reduce_to) jobs into `segment`: (height, width, finish time)
    per image, or why it failed."""
    out = _OPEN.get(segment)
    if out is None:
        out = _OPEN[segment] = np.memmap(segment, dtype=np.uint8, mode="r+")
    results: list = []
    for begin, end, at, capacity, reduce_to in jobs:
        try:
            pixels, done = decode_one(as_tensor(_DATA[begin:end]), reduce_to)
            if pixels.numel() > capacity:
                raise ValueError(f"decoded to {tuple(pixels.shape[1:])}, larger than the size the store records")
            out[at : at + pixels.numel()] = pixels.reshape(-1).numpy()
            results.append((pixels.shape[1], pixels.shape[2], done))
        except Exception as e:  # any decoder error marks this image, never the chunk
            results.append(f"{type(e).__name__}: {e}")
    return results


class DecodeWorkers:
    """`workers` decode processes over one store's encoded bytes, shared by a loader's pipelines.

    Forked at once, while the loader's process has no threads of its own running yet. Raises
    RuntimeError when processes can't be used here (no fork, no /dev/shm)."""

    def __init__(self, data: np.memmap, workers: int):
        if "fork" not in multiprocessing.get_all_start_methods() or not SHM.is_dir():
            raise RuntimeError("decode worker processes need fork and /dev/shm (Linux)")
        if not isinstance(data, np.memmap) or data.filename is None:
            raise RuntimeError("decode workers read the store from its file; these bytes have none")
        self.workers = workers
        self._base, self._nbytes = data.ctypes.data, data.nbytes
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                         initializer=_start, initargs=(data.filename, data.offset, data.nbytes))
        list(self._pool.map(_ready, range(workers)))

    def begin(self, data: torch.Tensor) -> int:
        """Where `data` (a view of the store's bytes) starts in the store."""
        begin = data.data_ptr() - self._base
        if not 0 <= begin <= self._nbytes - data.numel():
            raise ValueError("decode workers can only decode views of the store they were started on")
        return begin

    def submit(self, segment: str, jobs: list[tuple]) -> Future:
        return self._pool.submit(_decode, segment, jobs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class _Job:
    segment: Segment
    at: np.ndarray  # where each image goes in the segment
    total: int  # bytes of the segment the images may fill
    futures: list[Future]
    datas: list[torch.Tensor]  # kept to decode again on threads if the pool broke
    reduce_to: list


class ProcessDecoder:
    """One pipeline's view of the shared workers: `submit`/`collect` like `CpuDecoder`, images in
    this pipeline's own shared buffers (reused once the kernels reading them have run)."""

    name = "cpu"

    def __init__(self, workers: DecodeWorkers, device: torch.device):
        self.workers, self.device = workers, device
        self.threads = workers.workers
        self.last_done = 0.0
        self._staging = PinnedStaging(alloc=lambda nbytes: Segment(nbytes, device))
        self._threads: CpuDecoder | None = None  # once the pool broke

    def submit(self, datas: list[torch.Tensor], shapes: torch.Tensor, reduce_to: list):
        if self._threads is not None:
            return self._threads.submit(datas, shapes, reduce_to)
        capacity = (shapes[:, 0].long() * shapes[:, 1].long() * 3).numpy() if len(datas) else np.zeros(0, np.int64)
        at = np.cumsum(capacity) - capacity
        segment = self._staging.take(max(1, int(capacity.sum())))
        jobs = [(self.workers.begin(d), self.workers.begin(d) + d.numel(), int(a), int(c), r)
                for d, a, c, r in zip(datas, at, capacity, reduce_to)]
        size = math.ceil(len(jobs) / self.workers.workers) or 1
        futures = [self.workers.submit(segment.path, jobs[k : k + size]) for k in range(0, len(jobs), size)]
        return _Job(segment, at, int(capacity.sum()), futures, datas, reduce_to)

    def collect(self, job, device: torch.device, pin: bool) -> Decoded:
        """The decoded images where `device` reads them: in place in the shared buffer if `pin`."""
        if self._threads is not None and not isinstance(job, _Job):
            return self._threads.collect(job, device, pin)
        try:
            results = [r for f in job.futures for r in f.result()]
        except BrokenProcessPool as e:
            self._staging.give_back(job.segment, None)
            return self._broken(e, job, device, pin)
        kept = [k for k, r in enumerate(results) if not isinstance(r, str)]
        failed = {k: r for k, r in enumerate(results) if isinstance(r, str)}
        sizes = torch.tensor([results[k][:2] for k in kept], dtype=torch.int32).reshape(-1, 2)
        strides = torch.stack([sizes[:, 0] * sizes[:, 1], sizes[:, 1], torch.ones_like(sizes[:, 0])], 1).long()
        self.last_done = max((results[k][2] for k in kept), default=0.0)
        offsets = torch.from_numpy(job.at[kept]).long()
        if pin:
            return Decoded(job.segment.view, offsets, sizes, strides, [job.segment], failed,
                           on_done=lambda done: self._staging.give_back(job.segment, done))
        base = job.segment.tensor[: job.total].clone().to(device)
        self._staging.give_back(job.segment, None)
        return Decoded(base, offsets, sizes, strides, [], failed)

    def _broken(self, error: BaseException, job: _Job, device: torch.device, pin: bool) -> Decoded:
        log.warning("gpufeed: a JPEG decode worker process died (%s); this pipeline decodes on %d threads "
                    "from now on", error, self.threads)
        self._threads = CpuDecoder(self.threads)
        shapes = torch.zeros((len(job.datas), 2), dtype=torch.int32)
        decoded = self._threads.collect(self._threads.submit(job.datas, shapes, job.reduce_to), device, pin)
        self.last_done = self._threads.last_done
        return decoded

    def close(self) -> None:
        if self._threads is not None:
            self._threads.close()
        for segment in self._staging.drain():
            segment.close()
