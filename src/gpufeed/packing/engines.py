"""Where packing work runs: in this process, a local process pool, or Ray tasks on a cluster.

Each engine is a `concurrent.futures.Executor`, so the packer has one code path. With Ray the
workers may sit on other machines: they send their results (encoded bytes, or raw pixels)
back through Ray's object store and this process writes the store, so no shared filesystem
is needed and the output is byte-identical to a local pack of the same source list.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import dataclass

from gpufeed.logs import logger
from gpufeed.processes import process_pool

log = logger(__name__)
ENGINES = ("local", "ray")


class _Inline(Executor):
    """Runs tasks in this process (workers=1): same code path, easy to debug."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        f.set_result(fn(*args, **kwargs))
        return f


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
    return Engine(process_pool(workers), workers, local_disk=True)
