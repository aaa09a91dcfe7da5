"""The decode worker processes of one interpreter, shared by its loaders.

A training Loader and the evaluation Loader made beside it every epoch, or a Loader made again
after one was dropped, use the same workers: starting 14 interpreters costs a pass 0.5-1 s (5e46ada;
docs/benchmarks.md, "Reading a folder in place": a next Loader's workers ready in 0.03-0.07 s), and two
sets at once would take twice the cores. One `WorkerPool` runs per worker count; `take` hands it to a
loader (`workers.DecodeWorkers`) and `release` gives it back. Its rows of the job board, tickets and
answers are the pool's; each loader names what its rows read (`protocol.Source`) and counts its own
seconds (`jobs.Tally`).

How long they live: while any loader holds them, then `IDLE_SECONDS` more (a timer thread waits
for a next loader), then they are stopped; a pool started ahead of its loader (`start_ahead`: a
folder's, while its index is read) waits the same way until it is taken; at once where a worker
died (a new loader gets a new pool). They also end with the interpreter, and within a quarter second
of its process going away, as before. A process forked from this one never uses its parent's pool.

A loader that goes while its shares are still with the workers leaves them to the pool: their rows,
segments and source stay taken until the workers answered them, so nothing of a new loader's is
written over by an answer meant for the old one.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

import numpy as np
import torch

from gpufeed.decode.asks import Asks
from gpufeed.decode.base import Encoded, WorkersStopped
from gpufeed.decode.codecs.cpu import CpuDecoder
from gpufeed.decode.pool import protocol, spawn
from gpufeed.decode.pool.board import Board, Results
from gpufeed.decode.pool.jobs import Job, Tally
from gpufeed.decode.pool.relay import Relay
from gpufeed.decode.pool.segment import Segment
from gpufeed.logs import logger

log = logger(__name__)

IDLE_SECONDS = 30.0  # how long workers no loader holds wait for the next one

_pools: dict[int, WorkerPool] = {}  # this process's pools in use or idle, by worker count
_registry = threading.RLock()  # (reentrant: a loader's finalizer may run in a collection under it)
_inherited: list[WorkerPool] = []  # a forked child's copies of its parent's pools: kept, never used


def _forked() -> None:
    """In a forked child: its parent's pools are not its own (a lock held by a parent's thread at the
    fork would never be let go here)."""
    global _registry
    _inherited.extend(_pools.values())
    _pools.clear()
    _registry = threading.RLock()


os.register_at_fork(after_in_child=_forked)


class WorkerPool:
    """`size` worker processes, their pipes, the job board and the shares on it, for any loader."""

    def __init__(self, size: int):
        self.size, self.pid = size, os.getpid()
        self.board = Board()
        setup = protocol.WorkerSetup(
            parent=self.pid, index=0, board_fd=self.board.fd, board_rows=self.board.size, tickets_fd=-1, done_fd=-1
        )
        self.relay = Relay(setup, size, [self.board])
        self.users = 0  # loaders holding it (`take`, `release`: under `_registry`)
        self.taken = 0  # loaders that took it so far
        self._idle: threading.Timer | None = None
        self._jobs: dict[int, Job] = {}  # by first row
        self._tickets: dict[int, Job] = {}  # every pending ticket's first row -> its job
        self._shares = itertools.count()
        self._lock = threading.RLock()  # the jobs, the workers' states, the ticket pipe
        self._local = threading.local()  # per thread: its thread decoder
        self._thread_decoders: list[tuple[threading.Thread, CpuDecoder]] = []
        self._said: set[str] = set()

    @property
    def workers(self) -> list[spawn.Worker]:
        return self.relay.workers

    @property
    def alive(self) -> bool:
        return self.relay.alive

    def healthy(self) -> bool:
        """Running with no worker gone: a new loader may take it (the registry holds this process's
        pools alone: `_forked`)."""
        return self.alive and all(w.dead is None and w.proc.poll() is None for w in self.workers)

    def starting(self) -> bool:
        return self.relay.starting()

    def living(self) -> int:
        """Workers ready or starting (not dead)."""
        return sum(w.dead is None for w in self.workers)

    def live(self) -> list[int]:
        """Indices of the ready, living workers."""
        return self.relay.live(self._answered, self._died)

    def post(
        self,
        source: Segment,
        batch: Encoded,
        asks: Asks,
        ranges: tuple[np.ndarray, np.ndarray, np.ndarray | int],
        room: tuple[np.ndarray, np.ndarray, Segment],
        per_ticket: int,
        tally: Tally,
    ) -> Job | None:
        """Put a share on the board and its tickets in the pipe: `ranges` (begins, ends, files) of
        `source`, `room` (where each image's pixels go, how much they may take, in which segment),
        `per_ticket` rows a ticket; None where the board has no room for it."""
        n = len(asks)
        begins, ends, files = ranges
        at, capacity, segment = room
        with self._lock:
            if tally.left:  # given back meanwhile (a producer still running as its loader closed)
                raise WorkersStopped("the loader gave its decode workers back")
            for gone in [j for j in self._jobs.values() if j.orphan and not j.pending]:
                self._forget(gone)
            start = self.board.room(n, [(j.start, j.start + j.n) for j in self._jobs.values()])
            if start is None:
                return None
            self.board.post(start, source, begins, ends, files, at, capacity, segment, asks)
            firsts = np.arange(start, start + n, per_ticket)
            tickets = np.empty(len(firsts), protocol.TICKET)
            share = next(self._shares) % (1 << 32)
            tickets["row"], tickets["count"], tickets["share"], tickets["spare"] = (
                firsts,
                np.minimum(per_ticket, start + n - firsts),
                share,
                0,
            )
            job = Job(
                start=start,
                share=share,
                segment=segment,
                batch=batch,
                asks=asks,
                sequence={},
                pending=dict(zip(firsts.tolist(), tickets["count"].tolist())),
                tally=tally,
                source=source,
            )
            self._jobs[start] = job
            self._tickets.update(dict.fromkeys(job.pending, job))
            first = self.relay.send(tickets)
            job.sequence = dict(zip(firsts.tolist(), range(first, first + len(firsts))))
        return job

    def wait(self, job: Job) -> None:
        """Until `job`'s tickets are answered (those no living worker will answer decoded on threads), or
        it was stopped."""
        while job.pending and not job.stopped:
            self.poll(0.1)
            if any(w.dead is not None for w in self.workers):
                self.recover()

    def finish(self, job: Job) -> Results | None:
        """A waited-for share's answers, and its rows given back; None if it was stopped (its rows kept
        until the workers answer them, if they still may)."""
        with self._lock:
            if job.stopped:
                if job.pending and self.alive:
                    job.orphan = True
                    return None
                self._forget(job)
                return None
            got = self.board.results(job.start, job.n)
            self._forget(job)
        return got

    def _forget(self, job: Job) -> None:
        self._jobs.pop(job.start, None)
        for first in job.pending:
            self._tickets.pop(first, None)

    def leave(self, tally: Tally) -> None:
        """The loader counting into `tally` is gone: no share of it is posted from now on, and its shares
        are stopped (a thread waiting for one wakes) and their rows given back once answered (by
        `_answered`, or the next `post`). Only marks them: a finalizer may run this in a collection
        inside this pool's own calls (under its lock, which is reentrant)."""
        with self._lock:
            tally.left = True
            for job in list(self._jobs.values()):
                if job.tally is tally:
                    job.orphan = job.stopped = True

    def holds(self, tally: Tally) -> bool:
        """Whether shares of the loader counting into `tally` are still on the board."""
        return any(job.tally is tally for job in list(self._jobs.values()))

    def poll(self, timeout: float) -> None:
        """Read what the workers sent (waiting up to `timeout` for something); once they were
        stopped, every share still waiting for them is stopped."""
        if not self.relay.poll(timeout, self._answered, self._died):
            with self._lock:
                for job in self._jobs.values():
                    job.stopped = job.stopped or bool(job.pending)

    def _answered(self, records: np.ndarray) -> None:
        """Done records: their tickets are answered, and counted to their loaders."""
        with self._lock:
            answers = zip(
                records["row"].tolist(),
                records["share"].tolist(),
                records["count"].tolist(),
                records["wall"].tolist(),
                records["cpu"].tolist(),
            )
            for first, share, count, wall, cpu in answers:
                job = self._tickets.get(first)
                if job is None or job.share != share:  # a late answer for rows now another share's
                    continue
                del self._tickets[first]
                job.pending.pop(first, None)
                job.busy += wall
                job.tally.busy.update(workers_wall=wall, workers_cpu=cpu)
                job.tally.decoded += count
                if job.orphan and not job.pending:
                    self._forget(job)

    def _died(self, k: int, why: str) -> None:
        """Worker `k` is found gone (said once, unless the pool is stopping; `recover` takes its tickets)."""
        worker = self.workers[k]
        if worker.dead is None and self.alive:
            left = self.living() - 1
            self.say(
                f"JPEG decode worker {worker.proc.pid} stopped ({why}); {left} of "
                f"{len(self.workers)} workers remain, its images are decoded on threads"
            )

    def recover(self) -> None:
        """Decode on threads the tickets no living worker will answer (`Job.lost`); a gone loader's are
        dropped."""
        now, dead = time.monotonic(), [w.dead is not None for w in self.workers]
        unread = self.relay.unread()
        if unread is None:
            return
        with self._lock:
            read_upto = self.relay.written - unread  # the tickets before it were read
            for job in list(self._jobs.values()):
                for first, count in job.lost(self.board, dead, read_upto, now).items():
                    if not job.orphan:
                        self._on_threads(job, first, count)
                    del job.pending[first]
                    self._tickets.pop(first, None)
                if job.orphan and not job.pending:
                    self._forget(job)

    def _on_threads(self, job: Job, first: int, count: int) -> None:
        """Decode a lost ticket's rows on threads, into the segment, and complete the rows."""
        positions = list(range(first - job.start, first - job.start + count))
        threads = self.fallback()
        part = threads.collect(
            threads.submit(job.batch.take(positions), None, job.asks.take(positions)), torch.device("cpu"), False
        )
        job.busy += part.busy
        # (seconds are floats, which a Counter adds too; typeshed's Counter counts ints)
        job.tally.busy.update(threads_wall=part.busy)  # type: ignore[call-overload]
        job.tally.decoded += count
        self.board.answer(job.start, positions, part, job.asks, job.segment, part.done_at)

    def fallback(self) -> CpuDecoder:
        """This thread's decoder on threads (a thread decoder serves one caller at a time)."""
        threads = getattr(self._local, "threads", None)
        if threads is None:
            threads = self._local.threads = CpuDecoder(max(1, self.size))
            with self._lock:  # those of threads gone (loaders' producers over the pool's life) are closed
                gone = [d for t, d in self._thread_decoders if not t.is_alive()]
                self._thread_decoders = [(t, d) for t, d in self._thread_decoders if t.is_alive()]
                self._thread_decoders.append((threading.current_thread(), threads))
            for decoder in gone:
                decoder.close()
        if not self.living():
            self.say(f"no JPEG decode worker is left: the CPU decodes on {threads.threads} threads")
        return threads

    def say(self, message: str) -> None:
        with self._lock:
            if message in self._said:
                return
            self._said.add(message)
        log.warning("gpufeed: %s", message)

    def stop(self) -> None:
        """Stop the workers (a share still waiting is stopped), and the thread decoders."""
        self.relay.stop()
        with self._lock:
            for job in self._jobs.values():
                job.stopped = True
            self._jobs.clear()
            self._tickets.clear()
        for _, threads in self._thread_decoders:
            threads.close()


def take(size: int) -> WorkerPool:
    """This process's pool of `size` workers, started now if none is running (or the one running lost
    a worker); the caller holds it until `release`."""
    retired = None
    with _registry:
        pool = _pools.get(size)
        if pool is None or not pool.healthy():
            if pool is not None and pool.users == 0:
                retired = pool
            pool = _pools[size] = WorkerPool(size)
        pool.users += 1
        pool.taken += 1
        _not_idle(pool)
    if retired is not None:  # (outside the registry's lock: stopping waits for the processes)
        retired.stop()
    return pool


def start_ahead(size: int) -> None:
    """Start the pool of `size` workers now where none is running, for a loader that takes it later in
    its constructor (after a folder's index: its workers' 0.2-0.5 s start then runs beside the index);
    no loader taking it, it is stopped `IDLE_SECONDS` later, as a pool its last loader gave back (an
    idle one running already waits that long again). Nothing where pools never idle (`IDLE_SECONDS`
    0: the loader starts its own)."""
    if IDLE_SECONDS <= 0:
        return
    retired: list[WorkerPool] = []
    with _registry:
        pool = _pools.get(size)
        if pool is not None and pool.healthy():
            if pool._idle is None:  # (held by a loader: nothing to do)
                return
            _not_idle(pool)  # (idle: waits its time again from now)
        else:
            if pool is not None and pool.users == 0:  # (a worker gone: stopped, as `take` does)
                _not_idle(pool)
                retired.append(pool)
            pool = _pools[size] = WorkerPool(size)
        if not _idle_later(pool):  # (the interpreter exiting)
            del _pools[size]
            retired.append(pool)
    for stopped in retired:  # (outside the registry's lock: stopping waits for the processes)
        stopped.stop()


def release(pool: WorkerPool, tally: Tally) -> None:
    """The loader counting into `tally` gives `pool` back: its shares are left to the pool; the last
    loader to go starts the idle timer (a pool no new loader may take is stopped at once)."""
    pool.leave(tally)
    with _registry:
        pool.users -= 1
        if pool.users > 0 or pool.pid != os.getpid():
            return
        stop = _pools.get(pool.size) is not pool or not pool.healthy() or not _idle_later(pool)
        if stop and _pools.get(pool.size) is pool:
            del _pools[pool.size]
    if stop:  # (outside the registry's lock: stopping waits for the processes)
        pool.stop()


def _idle_later(pool: WorkerPool) -> bool:
    """Start `pool`'s idle timer (under `_registry`): stopped `IDLE_SECONDS` from now unless a loader
    takes it; False where it can't wait (no idle time; the interpreter exiting)."""
    if IDLE_SECONDS <= 0:
        return False
    timer = threading.Timer(IDLE_SECONDS, _retire, args=(pool,))
    timer.daemon = True
    timer.name = "gpufeed-idle-workers"
    try:
        if sys.is_finalizing():
            raise RuntimeError("the interpreter is exiting")
        timer.start()  # (a loader's finalizer run at exit: no thread may start then, from Python 3.12)
    except RuntimeError:
        return False
    pool._idle = timer
    return True


def _not_idle(pool: WorkerPool) -> None:
    """Cancel `pool`'s idle timer, if it runs (under `_registry`)."""
    if pool._idle is not None:
        pool._idle.cancel()
        pool._idle = None


def _retire(pool: WorkerPool) -> None:
    """The idle timer ran out: stop `pool` unless a loader took it meanwhile."""
    with _registry:
        if pool.users or threading.current_thread() is not pool._idle:
            return
        pool._idle = None
        if _pools.get(pool.size) is pool:
            del _pools[pool.size]
    pool.stop()


def stop_idle() -> int:
    """Stop every pool no loader holds now, without waiting for its timer; how many were stopped."""
    with _registry:
        idle = [p for p in _pools.values() if p.users == 0]
        for pool in idle:
            del _pools[pool.size]
            _not_idle(pool)
    for pool in idle:
        pool.stop()
    return len(idle)
