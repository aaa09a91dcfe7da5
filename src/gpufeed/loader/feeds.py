"""The two ways batches reach the consumer, one per kind of tier.

- `device_feed` (gpu and host tiers): the GPU gathers, so there is no CPU work per batch.
  Everything is an asynchronous launch from the consumer's thread: the epoch's plan is uploaded
  once on the side stream; gathers for the next `prefetch` batches are queued on it ahead of use;
  the consumer's stream waits on each batch's event. With augmentation on the gpu tier, the
  augment kernel reads store rows itself and nothing is gathered at all.
- `host_feed` (disk tier, and every tier on a CPU device): a producer thread gathers with CPU
  threads into a pinned ring slot and queues the copy on the side stream, `prefetch` ahead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from gpufeed.augment.params import Params
from gpufeed.loader.plan import EpochPlan
from gpufeed.loader.stats import stage_range
from gpufeed.transfer.ring import PinnedRing, hand_over

STOP_WAIT = 5.0  # seconds an iteration that ends waits for its producers to finish their batch
# seconds `close()` (and the interpreter's exit) waits for producers to finish the batch they make
# before it stops the decoders under them: a batch takes well under a second where nothing is wrong
CLOSE_WAIT = 60.0


@dataclass
class Batch:
    """What the consumer turns into (images, labels): pixels are `images`, or `images[index]`."""

    images: torch.Tensor
    labels: torch.Tensor
    params: Params | None
    index: torch.Tensor | None = None
    final: bool = False  # already augmented (jpeg stores)
    samples: torch.Tensor | np.ndarray | None = None  # host: the store index of each sample, for fields


def device_feed(loader, plan: EpochPlan, start: int) -> Iterator[Batch]:
    """Batches of the gpu/host tiers, all device work queued asynchronously."""
    stream, tier, stats = loader.copy_stream, loader.tier, loader.counters
    with torch.cuda.stream(stream):
        on_device = plan.to(loader.device)
        labels = tier.labels.index_select(0, on_device.indices)
        uploaded = stream.record_event()
    # once per epoch: the consumer waits for the upload and owns the epoch tensors
    hand_over(uploaded, labels, on_device.indices, *(on_device.params.tensors() if on_device.params else ()))
    fused = loader.augment is not None and tier.name in loader.FUSED_GATHER

    def issue(number: int) -> tuple[Batch, torch.cuda.Event | None]:
        idx, params = on_device.batch(number)
        a, b = plan.starts[number], plan.starts[number + 1]
        samples = plan.indices[a:b]
        if fused:
            return Batch(tier.images, labels[a:b], params, idx, samples=samples), None
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            images = tier.images.index_select(0, idx)
            event = stream.record_event()
        stats.add("gather", time.perf_counter() - t0, images.numel())
        return Batch(images, labels[a:b], params, samples=samples), event

    pending: deque = deque(issue(n) for n in range(start, min(start + loader.prefetch, len(plan))))
    for number in range(start, len(plan)):
        batch, event = pending.popleft()
        if number + loader.prefetch < len(plan):
            pending.append(issue(number + loader.prefetch))
        if event is not None:
            hand_over(event, batch.images)
        yield batch


def host_feed(loader, plan: EpochPlan, start: int) -> Iterator[Batch]:
    """Batches gathered by CPU threads, produced `prefetch` ahead on a background thread."""
    on_device = plan
    if loader.copy_stream is not None:
        with torch.cuda.stream(loader.copy_stream):
            on_device = plan.to(loader.device)
            uploaded = loader.copy_stream.record_event()
        hand_over(uploaded, *(on_device.params.tensors() if on_device.params else ()))
    ring = loader.ring() if loader.copy_stream is not None else None

    def make(number: int, worker: int) -> tuple[Batch, torch.cuda.Event | None]:
        return _gather(loader, ring, plan.batch(number)[0], on_device.batch(number)[1])

    return threaded(loader, make, range(start, len(plan)))


class Stopped(RuntimeError):
    """What a producer leaves for its consumer when it was stopped before its batches were made (the
    loader was closed): the consumer raises it instead of waiting for batches that never come."""


class Producers:
    """Every producer thread a loader started that may still run, with its stop flag.

    `close()` and the interpreter's exit (`Loader`'s atexit hook) stop them and wait until they have
    ended: a daemon thread still inside torch while the interpreter finalizes aborts the process
    ("terminate called without an active exception", exit 134), and one still using the decoders
    races their shutdown."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: list[tuple[threading.Event, threading.Thread]] = []

    def add(self, stop: threading.Event, thread: threading.Thread) -> None:
        with self._lock:
            self._live = [(s, t) for s, t in self._live if t.is_alive()] + [(stop, thread)]

    def stop(self) -> None:
        """Tell every producer to end after the batch it is making."""
        with self._lock:
            for stop, _ in self._live:
                stop.set()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for them to end; whether all have."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for _, t in self._live]
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads if t is not threading.current_thread())


@dataclass
class Carried:
    """The first batches of the epoch after, made while the end of an epoch was consumed (one
    producer thread): the next iteration that starts at (`epoch`, `start`) yields them first instead
    of waiting for a fresh producer's first batch. The thread ends once it made them."""

    epoch: int
    start: int
    count: int
    items: queue.Queue
    thread: threading.Thread
    stop: threading.Event


@dataclass
class NextEpoch:
    """The epoch after the one a feed makes, and how its batches are made (`make(number, worker)`)."""

    epoch: int
    make: Callable[[int, int], tuple[Batch, torch.cuda.Event | None]]


def threaded(loader, make: Callable[[int, int], tuple[Batch, torch.cuda.Event | None]], numbers: range,
             workers: int = 1, carry: NextEpoch | None = None, carried: Carried | None = None) -> Iterator[Batch]:
    """Run `make(number, worker)` for each batch number on `workers` producer threads (batch k on
    thread k % workers), `prefetch` ahead, yielding in order; errors raised there are raised here;
    breaking out stops the threads. `carried`: batches made ahead for the first of `numbers` (taken
    first, the producer waiting for their thread). `carry` (one worker): once this epoch's batches
    are made, its thread makes the first `prefetch` of the next one and ends; they go to
    `loader.carried` if this epoch is consumed to its end."""
    if carried is not None:
        numbers = numbers[carried.count :]
    queues = [queue.Queue(loader.prefetch) for _ in range(workers)]
    stop = threading.Event()
    after = None
    if carry is not None and workers == 1:
        count = min(loader.prefetch, len(loader))
        after = Carried(carry.epoch, 0, count, queue.Queue(count), None, stop)
    producers = [threading.Thread(target=_produce, daemon=True, name="gpufeed-producer",
                                  args=(make, w, numbers[w::workers], queues[w], stop, loader.counters,
                                        carried.thread if carried is not None else None,
                                        carry.make if after is not None else None, after)) for w in range(workers)]
    if after is not None:
        after.thread = producers[0]
    for p in producers:
        loader.producers.add(stop, p)
        p.start()
    complete = False
    consumer = Consumer()
    try:
        if carried is not None:
            yield from _taken(loader, carried.items, carried.count, consumer)
        for k in range(len(numbers)):
            yield from _taken(loader, queues[k % workers], 1, consumer)
        complete = True
    finally:
        if complete and after is not None:
            loader.carried = after
        else:
            _stopped(stop, queues, producers)


@dataclass
class Consumer:
    """When the consumer last took a batch of this iteration: the time until it asks for the next is
    its own (training on it), counted as stage "consumer". The jpeg path's steering sizes the CPU's
    share of a batch by it."""

    took: float | None = None


def _taken(loader, items: queue.Queue, count: int, consumer: Consumer) -> Iterator[Batch]:
    """`count` batches from `items`, each handed over to the consumer's stream."""
    for _ in range(count):
        t0 = time.perf_counter()
        if consumer.took is not None:
            loader.counters.add("consumer", t0 - consumer.took)
        item = items.get()
        t1 = time.perf_counter()
        loader.counters.add("wait", t1 - t0)
        if isinstance(item, Stopped):  # raised afresh: the same instance may be taken twice
            raise Stopped(*item.args)
        if isinstance(item, BaseException):
            raise item
        batch, event = item
        hand_over(event, batch.images, batch.labels)
        consumer.took = time.perf_counter()
        loader.counters.add("hand_over", consumer.took - t1)
        yield batch


def _stopped(stop: threading.Event, queues: list[queue.Queue], producers: list[threading.Thread]) -> None:
    """Stop producers, waiting up to STOP_WAIT for the batches they are making (a producer stuck in
    one is left: it is a daemon, and never blocks exit)."""
    stop.set()
    deadline = time.monotonic() + STOP_WAIT
    for q, p in zip(queues, producers):
        while p.is_alive() and time.monotonic() < deadline:
            try:
                q.get_nowait()
            except queue.Empty:
                p.join(0.01)


def drop_carried(loader) -> None:
    """Let go of the batches carried into an epoch nobody started where they belong."""
    carried, loader.carried = loader.carried, None
    if carried is not None:
        _stopped(carried.stop, [carried.items], [carried.thread])


def _produce(make, worker: int, numbers: range, out: queue.Queue, stop: threading.Event, counters,
             before: threading.Thread | None = None, make_next: Callable | None = None,
             after: Carried | None = None) -> None:
    """Make batches into `out`; the time spent waiting for room there (the consumer is the slower
    side) is the stage "queue_full". `before`: the thread that made the batches carried into this
    epoch, waited for first (the pipelines serve one producer at a time). `after`: then make the
    first batches of the next epoch (with `make_next`) into its queue, and end."""
    errors = out  # where an error goes: the queue of the batch that raised it
    try:
        if before is not None:
            before.join()
        for number in numbers:
            if stop.is_set():
                return _leave(out)
            item = make(number, worker)
            t0 = time.perf_counter()
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            counters.add("queue_full", time.perf_counter() - t0)
        if after is not None:
            errors = after.items
            for number in range(after.count):
                if stop.is_set():
                    return _leave(after.items)
                after.items.put(make_next(number, worker))  # room for all of them: never blocks
    except BaseException as e:  # handed to the consumer, raised there
        errors.put(e)


def _leave(out: queue.Queue) -> None:
    """A stopped producer's last word to a consumer that may still wait on `out` (another thread
    iterating a loader that was closed); a full queue has batches enough to wake it."""
    try:
        out.put_nowait(Stopped("this gpufeed.Loader was closed while it was iterated: its threads and decode "
                               "workers are stopped"))
    except queue.Full:
        pass


def _gather(loader, ring: PinnedRing | None, idx: torch.Tensor, params) -> tuple[Batch, torch.cuda.Event | None]:
    """CPU threads gather batch `idx`; on a GPU into a pinned slot, then an async copy."""
    with stage_range("gpufeed.gather+h2d", loader.copy_stream is not None):
        return _gather_copy(loader, ring, idx, params)


def _gather_copy(loader, ring: PinnedRing | None, idx: torch.Tensor, params) -> tuple[Batch, torch.cuda.Event | None]:
    t0 = time.perf_counter()
    tier, n = loader.tier, len(idx)
    shape = tuple(tier.images.shape[1:])
    if ring is None:  # CPU device: gather straight into the batch handed out
        images = loader.gather(tier.images, idx, torch.empty((n, *shape), dtype=torch.uint8))
        loader.counters.add("gather", time.perf_counter() - t0, images.numel())
        return Batch(images, tier.labels.index_select(0, idx), params, samples=idx), None
    k = ring.acquire()
    images = loader.gather(tier.images, idx, ring.images[k][:n])
    labels = torch.index_select(tier.labels, 0, idx, out=ring.labels[k][:n])
    loader.counters.add("gather", time.perf_counter() - t0, images.numel())
    t1 = time.perf_counter()
    stream = loader.copy_stream
    with torch.cuda.stream(stream):
        images = images.to(loader.device, non_blocking=True)
        labels = labels.to(loader.device, non_blocking=True)
        event = stream.record_event()
    ring.release(k, event)
    loader.counters.add("h2d_issue", time.perf_counter() - t1, images.numel())
    return Batch(images, labels, params, samples=idx), event
