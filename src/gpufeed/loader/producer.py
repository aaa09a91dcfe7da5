"""Batches made on producer threads, `prefetch` ahead of the training loop, handed over in order.

What runs where: each iteration starts `workers` producer threads (`gpufeed-producer`; batch k on
thread k % workers), each with a bounded queue of `prefetch` items; the consumer (the training
loop's thread) takes them in order. A queue carries typed items only: `Made` (a batch and the CUDA
event behind it), `Failed` (an error raised while making one, raised in the consumer), `Left` (the
producer was stopped: the loader closed under a consumer still waiting). An epoch consumed to its
end leaves its threads making the next epoch's first batches (`Carried`, batch k on thread
k % workers as before), which the iteration that starts that epoch takes first.

`Producers` keeps every live producer thread of a loader, so `close()` and the interpreter's exit
can stop them and wait for them: a daemon thread still inside torch while the interpreter
finalizes aborts the process.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from gpufeed.loader.batch import Batch
from gpufeed.loader.stats import Stats
from gpufeed.transfer.ring import hand_over

STOP_WAIT = 5.0  # seconds an iteration that ends waits for its producers to finish their batch
# seconds `close()` (and the interpreter's exit) waits for producers to finish the batch they make
# before it stops the decoders under them: a batch takes well under a second where nothing is wrong
CLOSE_WAIT = 60.0


class Stopped(RuntimeError):
    """Raised in a consumer whose producer was stopped before its batches were made (the loader was
    closed): instead of waiting for batches that never come."""


@dataclass(frozen=True)
class Made:
    """A batch, and the CUDA event recorded behind the work that made it (None on a CPU)."""

    batch: Batch
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class Failed:
    """An error raised while a batch was made: raised in the consumer."""

    error: BaseException


@dataclass(frozen=True)
class Left:
    """The producer was stopped (the loader was closed) before it made the batches still awaited."""


Item = Made | Failed | Left
Make = Callable[[int, int], Made]  # make(batch number, producer number)


class Producers:
    """Every producer thread a loader started that may still run, with its stop flag."""

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
            threads = [t for _, t in self._live if t is not threading.current_thread()]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


@dataclass
class Carried:
    """The first `count` batches of the epoch after, made while the end of an epoch was consumed:
    the next iteration that starts at (`epoch`, `start`) yields them first instead of waiting for
    fresh producers' first batches. Batch k was made on producer thread k % len(threads) into its
    queue in `items`; each thread ends once it made its share."""

    epoch: int
    start: int
    count: int
    items: list[queue.Queue]
    threads: list[threading.Thread]
    stop: threading.Event
    context: object = None  # `NextEpoch.context`

    def join(self) -> None:
        """Wait until every carried batch is made (or its thread stopped)."""
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()


@dataclass
class Production:
    """What the producers of one loader share: how far ahead they make batches, the counters they add
    their stages to, the live threads, and the batches an epoch's end made for the next (`carried`)."""

    prefetch: int
    counters: Stats
    producers: Producers = field(default_factory=Producers)
    carried: Carried | None = None

    def take_carried(self, epoch: int, start: int) -> Carried | None:
        """The carried batches if they are for (`epoch`, `start`); any others are dropped."""
        carried, self.carried = self.carried, None
        if carried is not None and (carried.epoch, carried.start) == (epoch, start):
            return carried
        if carried is not None:
            _stopped(carried.stop, carried.items, carried.threads)
        return None

    def drop_carried(self) -> None:
        self.take_carried(-1, -1)


@dataclass
class NextEpoch:
    """The epoch after the one a feed makes, how its batches are made, and what the feed needs to go
    on with them (`Carried.context`: the video feed's plan on the device)."""

    epoch: int
    make: Make
    context: object = None


@dataclass
class _Task:
    """One producer thread's work: `numbers` made with `make` into `out`, after waiting for `before`
    (the threads that made this epoch's carried batches: the jpeg pipelines serve one producer at a
    time); then, with `after`, its share of the next epoch's first batches with `make_next`."""

    make: Make
    worker: int
    numbers: range
    out: queue.Queue
    stop: threading.Event
    counters: Stats
    before: Carried | None = None
    make_next: Make | None = None
    after: Carried | None = None


def threaded(
    production: Production,
    make: Make,
    numbers: range,
    epoch_length: int,
    workers: int = 1,
    carry: NextEpoch | None = None,
    carried: Carried | None = None,
) -> Iterator[Batch]:
    """Run `make(number, worker)` for each batch number on `workers` producer threads (batch k on
    thread k % workers), `prefetch` ahead, yielding in order; errors raised there are raised here;
    breaking out stops the threads. `carried`: batches made ahead for the first of `numbers` (taken
    first, the producers waiting for their threads). `carry`: once this epoch's batches are made, the
    threads make the first `prefetch` x `workers` of the next one (of `epoch_length` batches) and
    end; they go to `production.carried` if this epoch is consumed to its end."""
    if carried is not None:
        numbers = numbers[carried.count :]
    prefetch = production.prefetch
    queues: list[queue.Queue] = [queue.Queue(prefetch) for _ in range(workers)]
    stop = threading.Event()
    after: Carried | None = None
    make_next: Make | None = None
    if carry is not None:
        count = min(prefetch * workers, epoch_length)
        # room for each thread's whole share: its puts never block
        shares: list[queue.Queue] = [queue.Queue(max(1, len(range(w, count, workers)))) for w in range(workers)]
        after = Carried(carry.epoch, 0, count, shares, [], stop, carry.context)
        make_next = carry.make
    tasks = [
        _Task(
            make,
            w,
            numbers[w::workers],
            queues[w],
            stop,
            production.counters,
            before=carried,
            make_next=make_next,
            after=after,
        )
        for w in range(workers)
    ]
    threads = [threading.Thread(target=_produce, args=(task,), daemon=True, name="gpufeed-producer") for task in tasks]
    if after is not None:
        after.threads = threads
    for t in threads:
        production.producers.add(stop, t)
        t.start()
    complete = False
    consumer = _Consumer(production.counters)
    try:
        if carried is not None:
            for k in range(carried.count):
                yield from consumer.take(carried.items[k % len(carried.items)], 1)
        for k in range(len(numbers)):
            yield from consumer.take(queues[k % workers], 1)
        complete = True
    finally:
        if carried is not None and not complete:  # (the new producers wait for these: stopped first)
            _stopped(carried.stop, carried.items, carried.threads)
        if complete and after is not None:
            production.carried = after
        else:
            _stopped(stop, queues, threads)


class _Consumer:
    """Takes batches off the queues on the consumer's thread. When it last took one of this
    iteration, the time until it asks for the next is its own (training on it): the stage
    "consumer", by which the jpeg path's steering sizes the CPU's share of a batch."""

    def __init__(self, counters: Stats):
        self.counters = counters
        self.took: float | None = None

    def take(self, items: queue.Queue, count: int) -> Iterator[Batch]:
        """`count` batches from `items`, each handed over to the consumer's stream."""
        for _ in range(count):
            t0 = time.perf_counter()
            if self.took is not None:
                self.counters.add("consumer", t0 - self.took)
            item = items.get()
            t1 = time.perf_counter()
            self.counters.add("wait", t1 - t0)
            if isinstance(item, Left):
                raise Stopped(
                    "this gpufeed.Loader was closed while it was iterated: its threads and decode workers are stopped"
                )
            if isinstance(item, Failed):
                raise item.error
            hand_over(item.event, item.batch.images, item.batch.labels)
            self.took = time.perf_counter()
            self.counters.add("hand_over", self.took - t1)
            yield item.batch


def _stopped(stop: threading.Event, queues: list[queue.Queue], threads: list[threading.Thread]) -> None:
    """Stop producers, waiting up to STOP_WAIT for the batches they are making (a producer stuck in
    one is left: `Producers` still knows it, and `close()` waits for it)."""
    stop.set()
    deadline = time.monotonic() + STOP_WAIT
    for q, t in zip(queues, threads):
        while t.is_alive() and time.monotonic() < deadline:
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(0.01)


def _produce(task: _Task) -> None:
    """Make batches into `task.out`; the time spent waiting for room there (the consumer is the slower
    side) is the stage "queue_full"."""
    out = task.out  # where an error goes: the queue of the batch that raised it
    try:
        if task.before is not None:
            task.before.join()
        for number in task.numbers:
            if task.stop.is_set():
                return _leave(out)
            item = task.make(number, task.worker)
            t0 = time.perf_counter()
            _put(out, item, task.stop)
            task.counters.add("queue_full", time.perf_counter() - t0)
        if task.after is not None:
            workers = len(task.after.items)
            out = task.after.items[task.worker]
            for number in range(task.worker, task.after.count, workers):
                if task.stop.is_set():
                    return _leave(out)
                # room for all of them: never blocks (make_next: set with `after`)
                out.put(task.make_next(number, task.worker))  # type: ignore[misc]
    except BaseException as e:  # noqa: BLE001  handed to the consumer, raised there
        if not _put(out, Failed(e), task.stop):  # stopped: a consumer still waiting learns it was
            _leave(out)


def _put(out: queue.Queue, item: Item, stop: threading.Event) -> bool:
    """Put `item` once there is room, unless the producer is stopped meanwhile (nobody takes it then:
    False)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _leave(out: queue.Queue) -> None:
    """A stopped producer's last word to a consumer that may still wait on `out` (another thread
    iterating a loader that was closed); a full queue has batches enough to wake it."""
    try:
        out.put_nowait(Left())
    except queue.Full:
        pass
