"""Inside a JPEG pipeline process (see `gpufeed.loader.procs`): the loader's pipelines rebuilt from a
`Spec`, one thread each, filling the output slots the loader shared as batches are asked for."""

from __future__ import annotations

import ctypes
import logging
import pickle
import queue
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from gpufeed.augment.pipeline import Augment, Params
from gpufeed.decode.workers import Lane, ProcessDecoder, Span
from gpufeed.loader import tiers
from gpufeed.loader.stats import Stats
from gpufeed.store.reader import Store


# Python's GIL switch interval in a pipeline process (its default: 5 ms). A pipeline's threads hand
# the GIL to each other many times a batch, and a thread back from a decoder call waits up to this
# long for it. This process is ours to tune, unlike the loader's. With 0.5 ms, `jpeg_bench.py --only
# defaults` gave medians of 35.0k img/s against 32.6k on one H100 and 35.6k against 35.5k on
# another (3 interleaved rounds each)
SWITCH_INTERVAL = 0.0005

CU_CTX_SCHED_BLOCKING_SYNC = 4  # the CUDA driver's flag: a thread waiting on the GPU sleeps


@dataclass
class Spec:
    """What a pipeline process needs to build the loader's JPEG pipelines."""

    store: str
    device: torch.device
    ops: list
    dtype: torch.dtype
    channels_last: bool
    cache: str
    on_error: str
    decoders: tuple[str, ...]
    pipelines: int
    cpu_threads: int


class _Host:
    """The part of a `Loader` that a `JpegBatcher` reads, rebuilt inside a pipeline process."""

    def __init__(self, spec: Spec):
        self.store, self.device = Store(spec.store), spec.device
        self.augment = Augment(spec.ops)
        self.dtype, self.channels_last = spec.dtype, spec.channels_last
        self.tier = tiers.materialize(self.store, self.device, spec.cache)
        self.counters = Stats(self.tier.name)


class _Forward(logging.Handler):
    """Sends a process's gpufeed warnings to the loader's process, which logs them."""

    def __init__(self, send):
        super().__init__(logging.WARNING)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        self._send(("log", record.levelno, (record.name, str(record.msg)), record.getMessage()))


def _sleeping_waits(device: torch.device) -> str | None:
    """Make this process's CUDA waits sleep, not spin (the primary context's blocking-sync flag; it
    must be set before the context exists). Its threads wait on the GPU most of a batch, each
    spinning on a core the CPU decode workers could use. `jpeg_bench.py --only defaults` on an H100,
    interleaved: 33.3k, 34.5k, 33.9k img/s against 30.7k, 31.4k, 29.8k spinning. Returns why it
    could not, or None."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver library ({e})"
    ordinal = ctypes.c_int()
    for call, args in ((cuda.cuInit, (0,)), (cuda.cuDeviceGet, (ctypes.byref(ordinal), device.index or 0)),
                       (cuda.cuDevicePrimaryCtxSetFlags, (ordinal, CU_CTX_SCHED_BLOCKING_SYNC))):
        if (status := call(*args)) != 0:
            return f"{call.__name__} returned CUDA error {status}"
    return None


def serve(conn: Connection, spec: Spec, slots: bytes, workers: list[Lane] | None) -> None:
    """A pipeline process: build the pipelines (each with its lane to the CPU decode `workers`' pool,
    else CPU threads), then fill `slots` (the loader's shared output tensors, pickled, opened here once CUDA is
    set up) as batches are asked for, until told to stop (None) or the loader is gone."""
    from gpufeed.loader.jpeg import JpegBatcher

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle; it stops us
    sys.setswitchinterval(SWITCH_INTERVAL)
    spinning = _sleeping_waits(spec.device) if spec.device.type == "cuda" else None
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    logger = logging.getLogger("gpufeed")
    logger.addHandler(_Forward(send))
    logger.setLevel(logging.WARNING)
    if spinning:
        logger.warning("gpufeed: JPEG pipeline processes wait for the GPU spinning (%s): they use more CPU", spinning)
    try:
        slots = pickle.loads(slots)
        if spec.device.type == "cuda":
            torch.cuda.set_device(spec.device)
        host = _Host(spec)
        span = Span(host.tier.images.data_ptr(), host.tier.images.numel())
        cpus = [None] * spec.pipelines if workers is None else [ProcessDecoder(span, c, spec.device) for c in workers]
        batchers = [JpegBatcher(host, spec.on_error, spec.cpu_threads, spec.decoders, cpu) for cpu in cpus]
    except Exception as e:
        send(("failed", f"{type(e).__name__}: {e}"))
        return
    send(("ready", batchers[0].scheduler.names, host.tier.name))
    tasks: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_pipeline, args=(k, b, host, slots, tasks, send), daemon=True)
               for k, b in enumerate(batchers)]
    for t in threads:
        t.start()
    try:
        while (task := conn.recv()) is not None:
            tasks.put(task)
    except (EOFError, OSError):
        pass
    for _ in threads:
        tasks.put(None)
    for t in threads:
        t.join()
    for b in batchers:
        b.close()


def _pipeline(k: int, batcher, host: _Host, slots, tasks: queue.Queue, send) -> None:
    """One pipeline thread of a process: batches into slots, a reply after each. Its stages in the
    loader's stats: "idle" waiting for a batch to make, "handoff" filling the slot until it is complete."""
    stream = batcher.stream
    t0 = time.perf_counter()
    while (task := tasks.get()) is not None:
        host.counters.add("idle", time.perf_counter() - t0)
        generation, key, slot, idx, boxes, flip, jitter, out_hw, any_flip = task
        params = Params(torch.from_numpy(boxes), torch.from_numpy(flip), out_hw, False,
                        None if jitter is None else torch.from_numpy(jitter), any_flip)
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                images, labels = batcher.make(torch.from_numpy(idx), params)
                t1 = time.perf_counter()
                slots[slot][0][: len(labels)].copy_(images)
                slots[slot][1][: len(labels)].copy_(labels)
            if stream is not None:
                stream.synchronize()  # the slot is complete before the loader reads it
        except Exception as e:
            send(("error", generation, key, slot, _portable(e)))
        else:
            host.counters.add("handoff", time.perf_counter() - t1)
            send(("batch", generation, key, slot, len(labels), k, batcher.scheduler.snapshot(),
                  host.counters.as_dict()))
        t0 = time.perf_counter()


def _portable(error: Exception) -> Exception:
    """`error` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
