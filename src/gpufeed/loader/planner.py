"""Plan the next epochs on a thread while the current one is consumed.

A plan is a few vectorised torch calls per epoch (a pure function of seed, epoch and rank), so a
thread is enough: it gives up the GIL inside each call. Earlier versions planned in a forked
process; a fork of a process with threads (CUDA's, the user's) is unsafe, and the child outlived a
killed parent.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from gpufeed.loader.plan import EpochOrder, EpochPlan, order_epoch, plan_epoch
from gpufeed.logs import logger

log = logger(__name__)


class _Ahead:
    """One epoch being planned on a daemon thread (it never holds up the interpreter's exit)."""

    def __init__(self, fn, epoch: int):
        self._done = threading.Event()
        self._settled = threading.Event()  # the plan made (or failed) and the steps waiting for it run
        self._plan: EpochPlan | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._then: list[Callable[[EpochPlan], None]] | None = []  # None: dropped, no step runs
        self._epoch = epoch
        threading.Thread(target=self._run, args=(fn, epoch), daemon=True, name="gpufeed-planner").start()

    def _run(self, fn, epoch: int) -> None:
        try:
            self._plan = fn(epoch)
        except BaseException as e:  # noqa: BLE001  raised where the plan is asked for
            self._error = e
        finally:
            with self._lock:
                self._done.set()
                then, self._then = self._then, ([] if self._then is not None else None)
            for call in then or []:
                if self._plan is not None and self._then is not None:  # (not dropped meanwhile)
                    _step(call, self._plan, self._epoch)
            self._settled.set()

    def then(self, call: Callable[[EpochPlan], None]) -> None:
        """`call(plan)` once the plan is made: now where it is, else on the planner thread when it is;
        never where making it failed (the error is raised where the plan is asked for) or the plan
        was dropped (`drop`)."""
        with self._lock:
            if self._then is None:
                return
            if not self._done.is_set():
                self._then.append(call)
                return
        if self._plan is not None:
            _step(call, self._plan, self._epoch)

    def drop(self) -> None:
        """No step waiting for the plan runs from now on, and those running have ended: a plan
        forgotten (a resume plans that epoch otherwise), or a planner closed (a step still inside
        torch on a daemon thread would abort the interpreter's exit)."""
        with self._lock:
            self._then = None
        self._settled.wait()

    def made(self) -> EpochPlan | None:
        """The plan if it is made already (never waits), else None."""
        return self._plan if self._done.is_set() else None

    def result(self) -> EpochPlan:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._plan  # type: ignore[return-value]  # made: no error


class Planner:
    """`get(epoch)` returns an epoch's plan and keeps the next `depth` epochs planning on threads."""

    def __init__(self, sampler, augment, seed: int, sizes, depth: int = 2, resolution=None, size_divisible=None):
        """`resolution`: epoch -> the output size (an int side or (h, w)) that epoch's augment chain
        makes (`augment.schedule`); None: the chain's own. `size_divisible`: batches padded to one
        shape each (`plan.plan_epoch`)."""
        self._args = (sampler, augment, seed, sizes)
        self._size_divisible = size_divisible
        self._current: tuple[int, EpochPlan] | None = None  # the last epoch `get` gave
        self._depth = depth
        self._ahead: dict[int, _Ahead] = {}
        self._orders: dict[int, EpochOrder] = {}  # `start`'s epoch: its order, drawn before its plan
        self._resolution = resolution
        self._at_size: dict[tuple[int, int], object] = {}
        self._lock = threading.Lock()  # planner threads make the chain of a new size too

    def augment(self, epoch: int):
        """The augment chain that plans `epoch` (at its scheduled size)."""
        augment = self._args[1]
        if self._resolution is None or augment is None:
            return augment
        hw = resolution_hw(self._resolution(epoch))
        with self._lock:
            if hw not in self._at_size:
                self._at_size[hw] = augment.at_size(hw)
            return self._at_size[hw]

    def start(self, epoch: int, order_first: bool = False) -> None:
        """Plan `epoch` on a thread from now, unless it is planned or being planned: a Loader's first
        pass, while the Loader starts. `order_first`: its order is drawn here and the rest on the
        thread, so that what needs only the order (`early`: a bucket's downloads) starts with the pass.
        In a fresh process on a 16-core GPU host the whole plan came 0.2-0.5 s after the pass began,
        drawn on a thread that shared the interpreter with the decoders' start; the order of 1.28M
        samples takes 0.15 s on 2 cores (docs/benchmarks.md, "Training from a bucket")."""
        if self.ready(epoch) is not None or epoch in self._ahead:
            return
        if order_first:
            order = self._orders[epoch] = order_epoch(self._args[0], epoch)
            self._ahead[epoch] = _Ahead(functools.partial(self.now, order=order), epoch)
        else:
            self._ahead[epoch] = _Ahead(self.now, epoch)

    def early(self, epoch: int) -> EpochOrder | None:
        """`epoch`'s order while its plan is still being drawn from it (`start`), else None."""
        return self._orders.get(epoch) if self.ready(epoch) is None else None

    def get(self, epoch: int) -> EpochPlan:
        plan = self.peek(epoch)
        self._current = (epoch, plan)
        for e in [e for e in self._ahead if e < epoch or e > epoch + self._depth]:
            self._ahead.pop(e).drop()  # planned and never asked for (`start`'s, then `set_epoch`): its thread ended
        self._ahead.pop(epoch, None)
        self._orders.clear()  # (only `start`'s epoch has one; planned ahead, the others are made whole)
        for e in range(epoch + 1, epoch + self._depth + 1):
            if e not in self._ahead:
                self._ahead[e] = _Ahead(self.now, e)
        return plan

    def peek(self, epoch: int) -> EpochPlan:
        """An epoch's plan, leaving it for `get` (the one `get` last gave, planned ahead, or made now)."""
        made = self.ready(epoch)
        if made is not None:
            return made
        ahead = self._ahead.get(epoch)  # being planned (or failed: its error raised here)
        return ahead.result() if ahead is not None else self.now(epoch)

    def ready(self, epoch: int) -> EpochPlan | None:
        """An epoch's plan if it is made already (as `peek`, but never waiting or planning), else None."""
        current = self._current
        if current is not None and current[0] == epoch:
            return current[1]
        ahead = self._ahead.get(epoch)
        return ahead.made() if ahead is not None else None

    def when_made(self, epoch: int, call: Callable[[EpochPlan], None]) -> None:
        """`call(plan)` once `epoch`'s plan is made (`_Ahead.then`): now where it is made already; not at
        all where it is not being planned (only `get`'s next `depth` epochs are) or is forgotten."""
        current, ahead = self._current, self._ahead.get(epoch)
        if ahead is not None:
            ahead.then(call)
        elif current is not None and current[0] == epoch:
            _step(call, current[1], epoch)

    def now(self, epoch: int, order: EpochOrder | None = None) -> EpochPlan:
        """`epoch`'s plan, made here (from its `order`, where it was drawn before)."""
        sampler, _, seed, sizes = self._args
        return plan_epoch(sampler, self.augment(epoch), seed, epoch, sizes, self._size_divisible, order)

    def forget(self, epoch: int) -> None:
        """Drop what was planned of `epoch` (its sampler now plans it otherwise: a resume)."""
        if self._current is not None and self._current[0] == epoch:
            self._current = None
        self._orders.pop(epoch, None)
        ahead = self._ahead.pop(epoch, None)
        if ahead is not None:
            ahead.drop()

    def close(self) -> None:
        for ahead in self._ahead.values():
            ahead.drop()  # a planner thread still inside torch would abort the interpreter's exit
        self._ahead.clear()


def _step(call: Callable[[EpochPlan], None], plan: EpochPlan, epoch: int) -> None:
    """`call(plan)`, a step that waited for `epoch`'s plan; an error is logged: a bug there must not end
    the planner thread unseen, nor the pass that asked for it."""
    try:
        call(plan)
    except Exception:
        log.warning("gpufeed: a step waiting for epoch %d's plan failed", epoch, exc_info=True)


def resolution_hw(size) -> tuple[int, int]:
    """A schedule's size as (h, w); ValueError naming what it returned otherwise."""
    hw = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
    if not (
        isinstance(hw, (tuple, list))
        and len(hw) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in hw)
    ):
        raise ValueError(f"a resolution schedule returned {size!r}: give a positive int side or (h, w)")
    return int(hw[0]), int(hw[1])
