"""JPEG pipelines in processes of their own, handing finished batches over in shared device memory.

Why: a pipeline's Python (byte ranges, decoder calls, kernel launches) is short, but in the
loader's process every pipeline thread shares one GIL, and each torch or decoder call lets go of
it and must win it back. With the issue's JPEG workload (`benchmarks/jpeg_bench.py --only
"defaults,in-process"`), 3 processes of 2 pipelines gave a median of 30.9k img/s against 22.8k for
3 pipelines in the loader's process (one H200, 5 interleaved rounds); on an H100, 31.4k against
28.1k (2 rounds).

How: the loader's process plans every batch, as it does without processes (same plan, same resume),
and sends a batch's indices and augment parameters to the process with the most free output slots,
with a slot to fill: a tensor it allocated and shared once (CUDA IPC on a GPU, shared memory on a
CPU). The process (`pipeline_process.serve`) runs `JpegBatcher`s on `pipelines` threads, with its
own decoders, streams and tier of the encoded bytes. It writes the batch into the slot, waits for
its stream and replies with its counters. The loader copies the slot into a fresh tensor on the
consumer's stream and reuses the slot once that copy has run. Warnings in a process come back and
are logged here, once per kind.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter, deque
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterator

import numpy as np
import torch

from gpufeed.augment.pipeline import Augment
from gpufeed.decode.scheduler import summed
from gpufeed.decode.workers import Lane, process_context, unavailable
from gpufeed.loader.feeds import Batch
from gpufeed.loader.pipeline_process import Spec, serve
from gpufeed.loader.plan import EpochPlan
from gpufeed.store.reader import Store

log = logging.getLogger(__name__)
START_TIMEOUT = 300.0  # seconds for a process to import, make its CUDA context and decoders


class PipelineProcesses:
    """`processes` processes of `pipelines` JPEG pipelines each, for one loader. Raises RuntimeError
    when they can't start (no forkserver, a process failed to build its pipelines)."""

    def __init__(self, loader, spec: Spec, processes: int, batch_size: int, out_hw: tuple[int, int],
                 workers: list[Lane] | None = None):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.device, self.processes = loader.device, processes
        fmt = torch.channels_last if spec.channels_last else torch.contiguous_format
        per_process = spec.pipelines + 2  # one per pipeline, one being copied out, one reply waiting
        self.slots = [[(torch.empty((batch_size, 3, *out_hw), dtype=spec.dtype, device=self.device,
                                    memory_format=fmt).share_memory_(),
                        torch.empty(batch_size, dtype=torch.int64, device=self.device).share_memory_())
                       for _ in range(per_process)] for _ in range(processes)]
        self._free = [list(range(per_process)) for _ in range(processes)]
        self._copying: list[deque] = [deque() for _ in range(processes)]  # (event, slot) until copied out
        self._done: dict[tuple[int, int], tuple[int, tuple]] = {}  # (epoch, batch) -> (process, its reply)
        self._generation = 0  # tags the batches asked for since the consumer last jumped elsewhere
        self._ahead = _Cursor(-1, 0, None)
        self._said: set[tuple[str, str]] = set()
        self._counters: dict[tuple[int, int], dict] = {}
        self._stages: dict[int, dict] = {}  # per process: its Stats.as_dict()
        ctx, self._procs, self._conns = process_context(), [], []
        self._stop = weakref.finalize(self, _stop, self._procs, self._conns)
        try:
            for p in range(processes):
                mine, theirs = ctx.Pipe()
                slots = bytes(ForkingPickler.dumps(self.slots[p]))  # opened by `serve` once its CUDA waits sleep
                proc = ctx.Process(target=serve, args=(theirs, spec, slots, _mine(workers, p, spec.pipelines)),
                                   daemon=True, name="gpufeed-pipelines")
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(mine)
            ready = [self._receive(p, START_TIMEOUT) for p in range(processes)]
        except BaseException:
            self.close()
            raise
        self.names, self.tier = ready[0][1], ready[0][2]

    def feed(self, loader, plan, start: int, epoch: int, upcoming: Callable[[], EpochPlan]) -> Iterator[Batch]:
        """Batches `start`.. of `plan` (epoch `epoch`), in order, copied out of the slots on the
        consumer's stream. Once this epoch's batches are all asked for, free slots go to the first
        batches of the next epoch (`upcoming()`, its plan): a short epoch then does not drain the
        pipelines at its end (with 39 batches an epoch, each pipeline idled ~6 ms a batch, H100). The
        next iteration keeps them if it starts there, as it does after a finished epoch."""
        if self._ahead.next() != (epoch, start):  # not where the last iteration left off: drop its batches
            self._generation += 1
            for p, message in self._done.values():
                self._free[p].append(message[3])
            self._done.clear()
            self._ahead = _Cursor(epoch, start, plan)
        if self._ahead.epoch == epoch:  # not already asking for the next epoch's batches
            self._ahead.upcoming = (epoch + 1, upcoming)
        generation = self._generation
        for number in range(start, len(plan)):
            key, t0 = (epoch, number), time.perf_counter()
            while self._issue(generation, block=self._ahead.peek() == key):  # block: `key` not asked for yet
                pass
            while key not in self._done:
                self._receive_any()
            loader.counters.add("wait", time.perf_counter() - t0)
            self._ahead.consumed(key)
            p, message = self._done.pop(key)
            slot = message[3]
            if message[0] == "error":
                self._free[p].append(slot)
                raise message[4]
            n = message[4]
            images, labels = self.slots[p][slot][0][:n].clone(), self.slots[p][slot][1][:n].clone()
            if self.device.type == "cuda":
                self._copying[p].append((torch.cuda.current_stream(self.device).record_event(), slot))
            else:
                self._free[p].append(slot)
            yield Batch(images, labels, None, final=True)

    def _issue(self, generation: int, block: bool) -> bool:
        """Send the next batch to ask for to the process with the most free slots, if there is one and a
        process has a free slot (waiting for one if `block`): a process that is behind gets less, so no
        process waits on another's batches."""
        if self._ahead.peek() is None:
            return False
        p = self._pick(block)
        if p is None:
            return False
        key, (idx, params) = self._ahead.take()
        slot = self._free[p].pop()
        jitter = None if params.jitter is None else params.jitter.numpy()
        try:
            self._conns[p].send((generation, key, slot, idx.numpy(), params.boxes.numpy(), params.flip.numpy(),
                                 jitter, params.out_hw, params.any_flip))
        except OSError:
            self._procs[p].join(timeout=1)
            raise self._gone(p) from None
        return True

    def _pick(self, block: bool) -> int | None:
        while True:
            for copying, free in zip(self._copying, self._free):
                while copying and copying[0][0].query():
                    free.append(copying.popleft()[1])
            most = max(range(self.processes), key=lambda p: len(self._free[p]))
            if self._free[most]:
                return most
            if not block:
                return None
            oldest = [c[0][0] for c in self._copying if c]
            if oldest:
                oldest[0].synchronize()
            else:  # every slot is with the processes: wait for a reply (maybe of an abandoned epoch)
                self._receive_any()

    def _receive_any(self) -> None:
        """Handle the messages of whichever processes have sent some (waiting for one)."""
        ready = wait(self._conns, timeout=1.0)
        for p, conn in enumerate(self._conns):
            if conn in ready or not self._procs[p].is_alive():
                self._receive(p)

    def _receive(self, p: int, timeout: float | None = None):
        """Handle one message from process `p`; raise if it died or could not start (a batch's error is
        kept with its reply, raised by `feed` when that batch is due)."""
        conn, proc = self._conns[p], self._procs[p]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not proc.is_alive() or (timeout is not None and waited >= timeout):
                raise self._gone(p, timeout)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            proc.join(timeout=1)
            raise self._gone(p) from None
        kind = message[0]
        if kind == "failed":
            raise RuntimeError(f"gpufeed: JPEG pipeline process {p} could not start: {message[1]}")
        if kind == "log":  # once per kind of warning (logger and format), whichever pipeline sent it
            if message[2] not in self._said:
                self._said.add(message[2])
                log.log(message[1], "%s", message[3])
            return message
        if kind in ("batch", "error"):
            generation, key, slot = message[1:4]
            if generation != self._generation:  # asked for by an iteration the consumer left: drop it
                self._free[p].append(slot)
                return message
            if kind == "batch":
                self._counters[(p, message[5])] = message[6]
                self._stages[p] = message[7]
            self._done[key] = (p, message)  # an error is raised when its batch is due
        return message

    def _gone(self, p: int, timeout: float | None = None) -> RuntimeError:
        proc = self._procs[p]
        why = f"did not start in {timeout:.0f} s" if proc.is_alive() else f"exited with code {proc.exitcode}"
        return RuntimeError(f"gpufeed: JPEG pipeline process {p} (pid {proc.pid}) {why}")

    def stats(self) -> dict:
        """The processes' counters, summed: stage seconds and bytes, notes, and the decoders' counts, rates and seconds."""
        seconds, nbytes, notes = Counter(), Counter(), []
        for stages in self._stages.values():
            seconds.update(stages["seconds"])
            nbytes.update(stages["bytes"])
            notes += [n for n in stages["notes"] if n not in notes]
        return {"stage_seconds": dict(seconds), "stage_bytes": dict(nbytes), "notes": notes} | summed(
            self.names, list(self._counters.values()))

    def close(self) -> None:
        self._stop()


class _Cursor:
    """The batches asked for, in the order they will be consumed: the next to ask for (`peek`,
    `take`), running on into the `upcoming` epoch once, and those asked for but not consumed yet."""

    def __init__(self, epoch: int, number: int, plan: EpochPlan | None):
        self.epoch, self.number, self.plan = epoch, number, plan
        self.upcoming: tuple[int, Callable[[], EpochPlan]] | None = None
        self.pending: deque[tuple[int, int]] = deque()

    def next(self) -> tuple[int, int]:
        """The first batch not consumed yet."""
        return self.pending[0] if self.pending else (self.epoch, self.number)

    def peek(self) -> tuple[int, int] | None:
        """The next batch to ask for, or None when there is none (yet)."""
        if self.plan is not None and self.number >= len(self.plan) and self.upcoming is not None:
            (self.epoch, plan), self.upcoming = self.upcoming, None
            self.number, self.plan = 0, plan()
        if self.plan is None or self.number >= len(self.plan):
            return None
        return self.epoch, self.number

    def take(self):
        """The next batch's key and (indices, params); it is pending from now on."""
        key = self.peek()
        self.pending.append(key)
        self.number += 1
        return key, self.plan.batch(key[1])

    def consumed(self, key: tuple[int, int]) -> None:
        if self.pending and self.pending[0] == key:
            self.pending.popleft()


def _stop(procs: list, conns: list[Connection]) -> None:
    """Ask the processes to stop, wait a little, terminate what still runs (also when the loader is
    garbage-collected without close)."""
    for conn in conns:
        try:
            conn.send(None)
        except OSError:  # that process is gone already
            pass
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()


def _mine(workers: list | None, p: int, pipelines: int) -> list | None:
    """Process `p`'s pipelines' lanes to the CPU decode workers' pool, or None."""
    return None if workers is None else workers[p * pipelines : (p + 1) * pipelines]


def slot_shape(augment: Augment, store: Store) -> tuple[int, int]:
    """The output (height, width) of `augment` on `store`'s images (the same for every sample)."""
    shapes = np.asarray(store.shapes[:1]).astype(np.int64)
    params = augment.sample(1, torch.from_numpy(shapes[:, 0]), torch.from_numpy(shapes[:, 1]), torch.Generator())
    return params.out_hw
