"""Plan the next epoch in a child process while the current one is consumed.

A planning thread would share the GIL with the thread that launches the batches: each of the
planner's torch calls gives the GIL up and waits for it again behind a busy consumer, so in
practice planning ran only between epochs (measured on an H200, gpu tier, 5k samples per rank:
about 3 ms per epoch of the consumer waiting on the plan, for 19 batches that take 2.6 ms). A
forked process plans beside it; the plan is the same pure function of (seed, epoch, rank).
"""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from gpufeed.loader.plan import EpochPlan, plan_epoch

log = logging.getLogger(__name__)
_ARGS: tuple = ()


def _start(*args) -> None:
    global _ARGS
    _ARGS = args
    torch.set_num_threads(1)  # small ops: no intra-op pool in the child


def _plan_in_child(epoch: int) -> EpochPlan:
    sampler, augment, seed, sizes = _ARGS
    return plan_epoch(sampler, augment, seed, epoch, sizes)


class Planner:
    """`get(epoch)` returns an epoch's plan and keeps the next `depth` epochs planning in a child
    process; two ahead, so a plan has two epochs' time to arrive even when epochs are short."""

    def __init__(self, sampler, augment, seed: int, sizes, depth: int = 2):
        self._args = (sampler, augment, seed, sizes)
        self._pool: Executor | None = None
        self._fn = _plan_in_child
        self._depth = depth
        self._ahead: dict[int, Future] = {}

    def get(self, epoch: int) -> EpochPlan:
        plan = self.peek(epoch)
        self._ahead = {e: f for e, f in self._ahead.items() if epoch < e <= epoch + self._depth}
        for e in range(epoch + 1, epoch + self._depth + 1):
            if e not in self._ahead:
                self._ahead[e] = self.ahead(e)
        return plan

    def peek(self, epoch: int) -> EpochPlan:
        """An epoch's plan, leaving it for `get` (planned ahead or not)."""
        ready = self._ahead.get(epoch)
        return self._result(ready, epoch) if ready is not None else self.now(epoch)

    def _result(self, ready: Future, epoch: int) -> EpochPlan:
        """The planned epoch; if the planning process died (killed, out of memory), say so and
        plan on a thread from now on: the same plan, only slower."""
        try:
            return ready.result()
        except BrokenProcessPool as e:
            self._to_thread(e)
            return self.now(epoch)

    def _to_thread(self, error: BaseException) -> None:
        log.warning("gpufeed.Loader: the planning process died (%s); planning on a thread from now on", error)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ahead.clear()
        self._pool, self._fn = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-planner"), self.now

    def now(self, epoch: int) -> EpochPlan:
        sampler, augment, seed, sizes = self._args
        return plan_epoch(sampler, augment, seed, epoch, sizes)

    def ahead(self, epoch: int) -> Future:
        if self._pool is None:
            self._pool = self._start_pool()
        try:
            return self._pool.submit(self._fn, epoch)
        except BrokenProcessPool as e:
            self._to_thread(e)
            return self._pool.submit(self._fn, epoch)

    def _start_pool(self) -> Executor:
        if "fork" not in multiprocessing.get_all_start_methods():
            log.warning("gpufeed.Loader: no fork on this platform: epochs are planned on a thread, "
                        "which competes with the batches for the GIL")
            self._fn = self.now
            return ThreadPoolExecutor(1, thread_name_prefix="gpufeed-planner")
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_start,
                                   initargs=self._args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
