"""Plan the next epochs on a thread while the current one is consumed.

A plan is a few vectorised torch calls per epoch (a pure function of seed, epoch and rank), so a
thread is enough: it gives up the GIL inside each call. Earlier versions planned in a forked
process; a fork of a process with threads (CUDA's, the user's) is unsafe, and the child outlived a
killed parent.
"""

from __future__ import annotations

import threading

from gpufeed.loader.plan import EpochPlan, plan_epoch


class _Ahead:
    """One epoch being planned on a daemon thread (it never holds up the interpreter's exit)."""

    def __init__(self, fn, epoch: int):
        self._done = threading.Event()
        self._plan: EpochPlan | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn, epoch), daemon=True, name="gpufeed-planner").start()

    def _run(self, fn, epoch: int) -> None:
        try:
            self._plan = fn(epoch)
        except BaseException as e:  # noqa: BLE001  raised where the plan is asked for
            self._error = e
        finally:
            self._done.set()

    def result_or_none(self) -> EpochPlan | None:
        """The plan once it is made, or None if making it failed."""
        self._done.wait()
        return self._plan

    def result(self) -> EpochPlan:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._plan  # type: ignore[return-value]  # made: no error


class Planner:
    """`get(epoch)` returns an epoch's plan and keeps the next `depth` epochs planning on threads."""

    def __init__(self, sampler, augment, seed: int, sizes, depth: int = 2):
        self._args = (sampler, augment, seed, sizes)
        self._depth = depth
        self._ahead: dict[int, _Ahead] = {}

    def get(self, epoch: int) -> EpochPlan:
        plan = self.peek(epoch)
        self._ahead = {e: f for e, f in self._ahead.items() if epoch < e <= epoch + self._depth}
        for e in range(epoch + 1, epoch + self._depth + 1):
            if e not in self._ahead:
                self._ahead[e] = _Ahead(self.now, e)
        return plan

    def peek(self, epoch: int) -> EpochPlan:
        """An epoch's plan, leaving it for `get` (planned ahead or not)."""
        ready = self._ahead.get(epoch)
        return ready.result() if ready is not None else self.now(epoch)

    def now(self, epoch: int) -> EpochPlan:
        sampler, augment, seed, sizes = self._args
        return plan_epoch(sampler, augment, seed, epoch, sizes)

    def forget(self, epoch: int) -> None:
        """Drop what was planned of `epoch` (its sampler now plans it otherwise: a resume)."""
        ahead = self._ahead.pop(epoch, None)
        if ahead is not None:
            ahead.result_or_none()

    def close(self) -> None:
        for ahead in self._ahead.values():
            ahead.result_or_none()  # a planner thread still inside torch would abort the interpreter's exit
        self._ahead.clear()
