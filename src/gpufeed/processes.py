"""Process pools that are safe wherever gpufeed is called from.

A pool's workers are forked only from a process with one thread (a `gpufeed pack` command, most
scripts): they start at once, like torch's DataLoader's. A process with threads (CUDA's,
nvImageCodec's, a Loader's) is never forked: a lock or CUDA state another thread holds at fork
time breaks or crashes the child. Its workers are spawned instead, without importing the caller's
`__main__` (an unguarded script would run again in each). Every worker ends within a quarter
second of its parent, however the parent ended.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpufeed.stderr import steady

SRC = Path(__file__).resolve().parents[1]  # the folder gpufeed is imported from


def process_pool(workers: int, niceness: int = 0) -> ProcessPoolExecutor:
    """A pool of `workers` processes, forked or spawned as above, that die with this process;
    `niceness` > 0: they run at that much lower a CPU priority than this process (a loader's decode
    processes yield to the training loop's thread, which launches the GPU's work)."""
    context = _context()
    forks = context.get_start_method() == "fork"
    pool = _Pool(workers, not forks, mp_context=context, initializer=_worker, initargs=(os.getpid(), niceness))
    if forks:
        try:
            _fork_now(pool)
        except BaseException:  # (a Ctrl-C held back while they forked)
            stop_now(pool)  # (a worker left running: the exit waited on it for ever)
            # and the pool's manager thread joined here: left to end on its own, it closed its wake-up
            # pipe as the interpreter's exit wrote to it, "Exception ignored ... Bad file descriptor"
            # (a race in Python 3.11's concurrent.futures, seen once in a CI run)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return pool


_HELD = {signal.SIGINT, signal.SIGTERM}


class _Pool(ProcessPoolExecutor):
    """A ProcessPoolExecutor whose `submit` a Ctrl-C or SIGTERM does not cut in two (`_signals_deferred`).

    A spawning pool starts a worker inside `submit`, and registers it a few steps after it started: a
    KeyboardInterrupt raised between the two left a worker the pool did not know, so its shutdown did
    not end it and the interpreter's exit waited on it for ever (a pack hung after Ctrl-C, once in a
    CI run). Raised as the pool's manager thread started, it made shutdown fail ("cannot join thread
    before it is started") in place of the KeyboardInterrupt. A forking pool starts its workers at
    once in `_fork_now` and no submit starts one after; its workers would inherit the swapped handlers."""

    def __init__(self, workers: int, defer_signals: bool, **kwargs) -> None:
        super().__init__(workers, **kwargs)
        self.defer_signals = defer_signals

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if not self.defer_signals:
            return super().submit(fn, *args, **kwargs)
        with _signals_deferred():
            return super().submit(fn, *args, **kwargs)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are handled as they would have been, right after
    it. Blocking them (`_fork_now`) holds nothing in a process with threads (the kernel hands the
    signal to a thread that does not block it, and Python runs the handler in the main thread all the
    same), so here their handlers are swapped for one that notes the signal, and it is raised again
    once the handlers are back: SIGTERM first (a pack's SIGTERM then still ends it as `Terminated`
    when the Ctrl-C's KeyboardInterrupt unwinds it). Only in the main thread (the only one Python
    runs handlers in), and only handlers set from Python: SIG_IGN and SIG_DFL interrupt nothing half
    way (and a worker spawned meanwhile must inherit SIG_IGN), and one set by other code (None) could
    not be put back. `signal.signal` runs a signal's pending handler before it swaps: one that raises
    then (a Ctrl-C between two swaps) is raised after every handler is back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    swapped: dict[int, Any] = {}
    try:
        for held in _HELD:
            handler = signal.getsignal(held)
            if callable(handler):
                swapped[held] = handler
                signal.signal(held, lambda signum, frame: came.append(signum))
        yield
    finally:
        error: BaseException | None = None
        for number, handler in swapped.items():
            while True:
                try:
                    signal.signal(number, handler)
                    break
                except BaseException as e:  # noqa: BLE001 - a pending signal's handler, run first: swapped nothing yet
                    error = error or e
        if error is not None:
            raise error
        for signum in sorted(set(came), key=lambda n: n != signal.SIGTERM):
            signal.raise_signal(signum)


def stop_now(executor: Executor) -> None:
    """End a local pool's work in flight at once, for a pack that failed or was stopped (an error,
    Ctrl-C, SIGTERM), so that its shutdown waits on no worker: each worker process is terminated.
    Waiting instead can hang for ever: when a worker dies (SIGTERM sent to the whole process group)
    as the pool starts another, the pool's own cleanup misses the new one and then waits for it.
    ProcessPoolExecutor offers no public way before Python 3.14 (terminate_workers), hence its
    `_processes`; other executors are left to their shutdown."""
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.terminate()


def _fork_now(pool: ProcessPoolExecutor) -> None:
    """Fork the pool's workers now (a first task forks them all), with SIGINT and SIGTERM held back in
    this thread meanwhile. Right after a fork Python runs its fork callbacks in the parent (logging's
    lock release, for one), and a KeyboardInterrupt raised inside one is printed as "Exception
    ignored" and lost: a Ctrl-C as a pack's workers were forked let the pack run on and commit. Held,
    the signal arrives once every worker is forked and in the pool, whose shutdown ends them (one
    forked before a Ctrl-C that came between two forks was not, and the exit waited on it for ever)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        pool.submit(int)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _worker(parent: int, niceness: int) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # (forked with them held: `_fork_now`)
    watch_parent(parent)
    if niceness > 0:
        try:
            os.nice(niceness)  # (lowering one's own priority is allowed, short of a sandbox's rules)
        except OSError:
            pass  # (the workers then run as nice as their parent: slower training at worst, never wrong)


def run_each(fn: Callable[[Any], Any], jobs: list, here: bool) -> None:
    """`fn(job)` for each of `jobs`: in this process where `here` (a handful: starting processes would
    take longer), else on a pool of a process a core (at most one a job)."""
    if here:
        for job in jobs:
            fn(job)
        return
    with process_pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        list(pool.map(fn, jobs))


def _threads() -> int:
    """This process's threads as the OS counts them (native ones too: CUDA's, nvImageCodec's), or 1
    where that can't be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


_MAIN = threading.Lock()


class _SpawnWithoutMain(multiprocessing.get_context("spawn").Process):  # type: ignore[misc]  # (a run-time base)
    """A spawned worker that does not import the caller's `__main__` (spawn would: a script without a
    main guard would run again in every worker). The pools' workers need nothing from it."""

    def start(self) -> None:
        # two threads starting pools at once would restore each other's half-changed state; the child
        # inherits descriptor 2 as it is, so not while nvImageCodec loads with it sent aside (`steady`)
        with _MAIN, steady():
            self._start_without_main()

    def _start_without_main(self) -> None:
        main = sys.modules["__main__"]
        saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None  # spawn reads both to decide what to import in the child
        try:
            super().start()  # reads __main__ for the child's preparation data now, in this thread
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _SpawnWithoutMainContext(type(multiprocessing.get_context("spawn"))):  # type: ignore[misc]  # (as above)
    Process = _SpawnWithoutMain


def _context() -> multiprocessing.context.BaseContext:
    """fork where this process has a single thread (a `gpufeed pack` command, most scripts): workers
    start at once, like torch's DataLoader. A process with threads is not forked (a lock or CUDA
    state held by another thread at fork time breaks or crashes the child): its workers are spawned,
    without importing `__main__`."""
    if "fork" in multiprocessing.get_all_start_methods() and _threads() == 1:
        return multiprocessing.get_context("fork")
    return _SpawnWithoutMainContext()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child interpreter gpufeed starts itself (`python -m gpufeed....`: decode
    workers, index and download processes): this process's, `extra` set, and the folder gpufeed is
    imported from first on PYTHONPATH (it may run from a source tree, not installed)."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, **extra, PYTHONPATH=path)


def watch_parent(parent: int) -> None:
    """In a pool's worker (or any child gpufeed starts): end this process within a quarter second of its
    parent going away, however the parent ended (SIGKILL included); a worker waiting on the pool's
    queue would never notice."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="gpufeed-parent-watch").start()
