"""The decode worker processes and the pipes between them and the loader (`protocol`): tickets out
on the pipe they share, done records back on another, and each worker's stdout, where it says
`Ready` once and which closes when it ends. No thread of its own: whoever waits for a share reads
(`poll`), one thread at a time."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import termios
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from gpufeed.decode.pool import protocol, spawn


class Relay:
    """`count` workers started on `setup` (its pipe fields are filled in here), and their pipes."""

    def __init__(self, setup: protocol.WorkerSetup, count: int, keep: list):
        """`keep`: what the workers use and must outlive them (closed when they are stopped)."""
        self._tickets_r, self._tickets_w = os.pipe()
        self._done_r, done_w = os.pipe()
        setup.tickets_fd, setup.done_fd = self._tickets_r, done_w
        try:
            self.workers: list[spawn.Worker] = spawn.start(setup, count)
        except BaseException:  # those started read the ticket pipe's end: they exit
            for fd in (self._tickets_w, self._tickets_r, self._done_r):
                os.close(fd)
            raise
        finally:
            os.close(done_w)  # the workers hold it now
        self.stop = weakref.finalize(self, _stop, self.workers, self._tickets_w, [self._tickets_r, self._done_r], keep)
        # each worker's stdout until it ends, by file descriptor (asked for once: `_poll` runs per done record)
        self._outs = {w.proc.stdout.fileno(): k for k, w in enumerate(self.workers)}  # type: ignore[union-attr]  # PIPE
        self.written = 0  # tickets written so far
        self._unread = b""
        self._done_ended = False  # every worker's end of the done pipe closed (read to its end)
        self._lock = threading.Lock()  # one thread polls at a time

    @property
    def alive(self) -> bool:
        return self.stop.alive

    def starting(self) -> bool:
        return any(not w.ready and w.dead is None for w in self.workers)

    def live(self, done: Callable[[np.ndarray], None], died: Callable[[int, str], None]) -> list[int]:
        """The ready, living workers (while any starts, what came is read first, as `poll` does, unless
        another thread polls)."""
        if self.starting() and self._lock.acquire(blocking=False):
            try:
                self._poll(0.0, done, died)
            finally:
                self._lock.release()
        return [k for k, w in enumerate(self.workers) if w.ready and w.dead is None]

    def send(self, tickets: np.ndarray) -> int:
        """Write `tickets` (call it under one lock with `written`), in writes the pipe never splits;
        their place in the pipe's order. Nothing is written once the workers were stopped."""
        first, self.written = self.written, self.written + len(tickets)
        step = protocol.MAX_TICKETS_PER_WRITE
        try:
            for k in range(0, len(tickets), step):
                os.write(self._tickets_w, tickets[k : k + step].tobytes())
        except OSError:  # closed: the workers were stopped meanwhile; the share's collect says so
            pass
        return first

    def unread(self) -> int | None:
        """Tickets still in the pipe (None once it is closed)."""
        count = np.zeros(1, np.int32)
        try:
            # (numpy's stubs give an ndarray the buffer protocol from Python 3.12 on)
            fcntl.ioctl(self._tickets_r, termios.FIONREAD, count)  # type: ignore[call-overload, unused-ignore]
        except OSError:
            return None
        return int(count[0]) // protocol.TICKET.itemsize

    def poll(self, timeout: float, done: Callable[[np.ndarray], None], died: Callable[[int, str], None]) -> bool:
        """Wait up to `timeout` for done records (handed to `done`, many at once), `Ready`s and ends of
        workers (`died(k, why)`); False once the workers were stopped."""
        with self._lock:
            return self._poll(timeout, done, died)

    def _poll(self, timeout: float, done, died) -> bool:
        if not self.alive:
            return False
        try:
            # (the done pipe at its end, every worker gone, stays readable: it is left out then, so a
            # wait for their stdout's ends does not spin)
            watched = [*self._outs] if self._done_ended else [self._done_r, *self._outs]
            readable, _, _ = select.select(watched, [], [], timeout)
            if self._done_r in readable:
                chunk = os.read(self._done_r, 1 << 16)
                self._done_ended = not chunk
                data, size = self._unread + chunk, protocol.DONE.itemsize
                whole = len(data) // size * size
                self._unread = data[whole:]
                done(np.frombuffer(data[:whole], protocol.DONE))
            for fd in readable:
                if fd in self._outs:
                    self._heard(self._outs[fd], fd, died)
        except (OSError, ValueError):  # a pipe closed under us: the workers were stopped
            if self.alive:
                raise
            return False
        return True

    def _heard(self, k: int, fd: int, died) -> None:
        """Worker `k`'s stdout is readable: its `Ready`, or its end."""
        try:
            message = protocol.read(fd)
        except EOFError:
            del self._outs[fd]
            worker = self.workers[k]
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # its stdout closed, yet it runs: it is no worker of ours now
                worker.proc.kill()
                worker.proc.wait()
            died(k, f"exit code {worker.proc.returncode}")
            worker.dead = worker.dead or f"exit code {worker.proc.returncode}"
            return
        if isinstance(message, protocol.Ready):
            worker = self.workers[k]
            worker.ready, worker.ready_at, worker.said = True, time.perf_counter(), message


def _stop(workers: list[spawn.Worker], tickets_w: int, fds: list[int], keep: list) -> None:
    """The workers stopped, then the loader's ends of the pipes and what the workers used."""
    spawn.stop(workers, tickets_w)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for thing in keep:
        if thing is not None:
            thing.close()
