"""Where packing work runs: in this process, a local process pool, or Ray tasks on a cluster.

Each engine is a `concurrent.futures.Executor`, so the packer has one code path. With Ray the
workers may sit on other machines: they send their results (encoded bytes, or raw pixels)
back through Ray's object store and this process writes the store, so no shared filesystem
is needed and the output is byte-identical to a local pack of the same source list.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
ENGINES = ("local", "ray")


class _Inline(Executor):
    """Runs tasks in this process (workers=1): same code path, easy to debug."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        f.set_result(fn(*args, **kwargs))
        return f


def _threads() -> int:
    """This process's threads as the OS counts them (native ones too: CUDA's, nvImageCodec's), or 1
    where that can't be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class _SpawnWithoutMain(multiprocessing.get_context("spawn").Process):  # type: ignore[misc]  # (a run-time base)
    """A spawned worker that does not import the caller's `__main__` (spawn would: a script without a
    main guard would run again in every worker). The packing workers need nothing from it."""

    def start(self) -> None:
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


def _watch_parent(parent: int) -> None:
    """In a pack worker: end this process within a quarter second of its parent going away, however
    the parent ended (SIGKILL included); a worker waiting on the pool's queue would never notice."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="gpufeed-parent-watch").start()


def _call(fn, *args):
    return fn(*args)


class RayExecutor(Executor):
    """Submits each task to Ray; a task whose worker dies or raises is retried `retries` times.

    Joins the cluster at `address` (None: the one in RAY_ADDRESS or an already initialised one,
    else a local cluster is started and shut down again on `shutdown`).
    """

    def __init__(self, address: str | None = None, retries: int = 3):
        try:
            import ray
        except ImportError:
            raise ImportError("engine='ray' needs Ray: pip install 'gpufeed[ray]'") from None
        self._ray = ray
        self._owner = not ray.is_initialized()
        if self._owner:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote = ray.remote(max_retries=retries, retry_exceptions=True)(_call)
        log.info("packing on Ray: %d CPUs in the cluster", self.workers)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if kwargs:
            raise TypeError("RayExecutor.submit takes positional arguments only")
        return self._remote.remote(fn, *args).future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._owner and self._ray.is_initialized():
            self._ray.shutdown()


def stop_now(executor: Executor) -> None:
    """End a local pool's work in flight at once, for a pack that failed or was stopped (an error,
    Ctrl-C, SIGTERM), so that its shutdown waits on no worker: each worker process is terminated.
    Waiting instead can hang for ever: when a worker dies (SIGTERM sent to the whole process group)
    as the pool starts another, the pool's own cleanup misses the new one and then waits for it.
    ProcessPoolExecutor offers no public way before Python 3.14 (terminate_workers), hence its
    `_processes`; other executors are left to their shutdown."""
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.terminate()


@dataclass
class Engine:
    """An executor, how many tasks it runs at once, and whether its workers share our disk."""

    executor: Executor
    workers: int
    local_disk: bool


def start(engine: str, workers: int, address: str | None = None) -> Engine:
    """The executor for `engine` ("local" or "ray") with `workers` processes (local only)."""
    if engine == "ray":
        ex = RayExecutor(address)
        return Engine(ex, ex.workers, local_disk=False)
    if engine != "local":
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if workers == 1:
        return Engine(_Inline(), 1, local_disk=True)
    pool = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_watch_parent, initargs=(os.getpid(),))
    return Engine(pool, workers, local_disk=True)
