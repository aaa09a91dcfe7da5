"""Counters the loader keeps as it runs: seconds and bytes per stage, images, stalls."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from gpufeed.decode.scheduling.steering import Pace


@contextmanager
def stage_range(name: str, cuda: bool):
    """A named range for profilers: torch.profiler's record_function while it records, and NVTX on a
    GPU (Nsight). Without a profiler running, record_function would cost two op calls per batch for
    nothing (each lets go of the GIL and must win it back)."""
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        if torch.autograd._profiler_enabled():
            with record_function(name):
                yield
        else:
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


@dataclass
class Reading:
    """The counters `Stats.since` compares: when it read them, the consumer's seconds waiting for
    batches, its own seconds between them, how many of those it counted, and the producer's seconds
    waiting for room."""

    at: float
    waited: float
    own: float
    taken: int
    full: float = 0.0  # the producer's seconds waiting for room in the queue ("queue_full")


class Stats:
    """Thread-safe accumulators; `as_dict` is what `Loader.stats()` returns."""

    def __init__(self, tier: str, origin: float | None = None):
        """`origin`: when the loader's constructor was called (time.perf_counter), what `start` counts
        from (default: now)."""
        self.tier = tier
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._images = 0
        self._stalls = 0
        self._notes: list[str] = []
        self._started = time.perf_counter()
        self._origin = self._started if origin is None else origin
        self._marks: dict[str, float] = {}  # each event's first time (`mark`)

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self._seconds[stage] += seconds
            self._bytes[stage] += nbytes
            self._calls[stage] += 1
            if stage == "wait" and seconds > 1e-3:
                self._stalls += 1

    def since(self, last: Reading | None) -> tuple[Pace | None, Reading]:
        """The consumer's pace since `last` (None: nothing known yet) and the reading to pass next time:
        its waits for batches ("wait"), the seconds between the two calls, its own seconds per batch
        ("consumer"; its seconds and count read together, so they always cover the same batches), and the
        producer's waits for room in the queue ("queue_full": the consumer was the slower side)."""
        with self._lock:
            now = Reading(
                time.perf_counter(),
                self._seconds.get("wait", 0.0),
                self._seconds.get("consumer", 0.0),
                self._calls.get("consumer", 0),
                self._seconds.get("queue_full", 0.0),
            )
        if last is None:
            return None, now
        taken = now.taken - last.taken
        step = (now.own - last.own) / taken if taken else None
        pace = Pace(starved=now.waited - last.waited, interval=now.at - last.at, step=step, full=now.full - last.full)
        return pace, now

    def mark(self, event: str, at: float | None = None) -> None:
        """Keep the first time `event` happens (e.g. "first_batch"; `at`: when it did, time.perf_counter,
        for one before these counters were made), for `start`."""
        if event not in self._marks:  # (read without the lock: a later one would only be dropped under it)
            with self._lock:
                self._marks.setdefault(event, time.perf_counter() if at is None else at)

    def start(self, more: dict[str, float | list[float] | None] | None = None) -> dict:
        """How the loader started, in seconds since its constructor was called: the events `mark`ed
        (`store_opened` when the constructor had the store open, `decoding_made` when it had made a jpeg
        store's pipelines and started its decode workers, `constructor` when it returned, `first_pass`
        when the first pass began, `first_plan` when it had its epoch's plan, `first_read` when a jpeg
        store's first batch's bytes were in hand, `first_decoded` when its decoders were done with it,
        `first_batch` when the first batch was handed over) and `more` (times from time.perf_counter, or
        lists of them, None for what has not happened)."""

        def since(at):
            if at is None:
                return None
            return [round(a - self._origin, 4) for a in at] if isinstance(at, list) else round(at - self._origin, 4)

        with self._lock:
            marks = dict(self._marks)
        return {f"{name}_s": since(at) for name, at in (marks | (more or {})).items()}

    def count(self, images: int) -> None:
        with self._lock:
            self._images += images

    def note(self, text: str) -> None:
        with self._lock:
            if text not in self._notes:
                self._notes.append(text)

    def as_dict(self) -> dict:
        with self._lock:
            elapsed = time.perf_counter() - self._started
            return {
                "tier": self.tier,
                "images": self._images,
                "elapsed_s": elapsed,
                "seconds": dict(self._seconds),
                "bytes": dict(self._bytes),
                "stalls": self._stalls,
                "notes": list(self._notes),
            }
