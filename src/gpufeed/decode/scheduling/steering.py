"""How much of each batch each decoder gets: the rule `Scheduler` follows, apart from the decoding.

The GPU decoders take a part of each batch that is steered after every batch (`Tuning.gpu_step`): up while
the training loop starves and the producer waits on the CPU, down otherwise; a GPU share under
`Tuning.gpu_min` of the batch goes to the CPU too. The part never falls below what the CPU, at its
measured rate, cannot decode in the time the loop spends on each batch (`Steering.beyond_cpu`): the
loop's waits alone are a late signal, since the loader's queue of batches ahead hides a CPU that
falls behind until it runs dry, and steered by them alone the part stayed far below that where the
CPU had few cores (docs/benchmarks.md, "Steering"). Beside a training loop the CPU's workers, in
processes of their own, cost the model next to nothing, and the GPU decoders cost it more than a loop
that waits a little (docs/benchmarks.md, "The workers decode all they can"): so the CPU decodes all
it can and the GPU decoders what it can't; alone, the part settles where the two finish together.
Whether the GPU decoders decode at all is checked against what they cost the loop beside them
(`CostCheck`): they stay only while a loop fed with them runs faster than one fed by the CPU alone,
measured while it runs. The GPU decoders split theirs by their own rates (images/s, exponential
averages). The first batches are split so that the CPU and the GPU decoders finish together, so they
come fast while the workers start. The CPU's rate is per thread or worker, and every CPU share holds an
image per ready one at least, so a rate measured low (workers starting, a stall) is measured again.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gpufeed.decode.scheduling.choice import START_RATES
from gpufeed.decode.scheduling.shares import GpuShares
from gpufeed.decode.tuning import Tuning

CPU_START_RATE = 300.0  # images/s per thread or worker, until one was measured

# what the pipelines of this process that closed measured (`Steering.learn`): per decoder the images
# and seconds `Steering.measured` averages, and per set of GPU decoders their rate together. The next
# pipeline starts from them (an evaluation pass each epoch): from the start rates alone a next Loader's
# engines took 64-82 % of its images where the two sides finish together at 58 %, and its pass was
# 1.3-1.6x its steady one (docs/benchmarks.md, "Reading a folder in place")
_learned: dict[str, tuple[float, float]] = {}
_learned_together: dict[tuple[str, ...], float] = {}
_learning = threading.Lock()


def forget() -> None:
    """Start the next pipelines from the start rates, as a process's first does (a benchmark's rows of
    first Loaders; tests)."""
    with _learning:
        _learned.clear()
        _learned_together.clear()


@dataclass
class Pace:
    """The training loop's seconds waiting for batches since the producer's last one, the seconds
    between the producer's two batches, the loop's own seconds per batch since then (from taking one
    to asking for the next: what it spends training; None: it took none), and the producer's seconds
    waiting for room in its queue since then (the loop was the slower side)."""

    starved: float
    interval: float
    step: float | None = None
    full: float = 0.0

    @property
    def cycle(self) -> float:
        """The producer's own seconds for its last batch: the time between its two batches less its wait
        for room, what the loader takes per batch whatever the queue of batches ahead holds."""
        return max(0.0, self.interval - self.full)


@dataclass(frozen=True)
class Measured:
    """What finishing one batch measured (`Scheduler.finish`): what the steering and the counters learn."""

    gpu: GpuShares  # the GPU decoders' shares, each with its own seconds, and the seconds until the last was done
    gpu_images: int  # images the GPU decoders were given
    gpu_wait: float  # the producer's wait for them
    retried: int  # of them, rejected by a GPU decoder and decoded by the CPU instead
    cpu_images: int  # the CPU's share
    cpu_failed: int
    cpu_wait: float  # the producer's wait for it
    cpu_busy: float  # the seconds the CPU decoder spent on its share's images (its own, not the pool's)
    cpu_done: float  # when its last image finished (a perf_counter)
    submitted: float  # when the share was handed to it
    failed: int  # images no decoder could decode
    cpu_seconds: float  # the producer's seconds from the GPU shares' arrival to the end


@dataclass
class _Window:
    """The last `size` batches made with the GPU decoders at work, or idle: the loop's own seconds per
    batch and the producer's cycle (`Pace.cycle`)."""

    size: int
    steps: deque = field(init=False)
    cycles: deque = field(init=False)

    def __post_init__(self):
        self.steps, self.cycles = deque(maxlen=self.size), deque(maxlen=self.size)

    def add(self, pace: Pace) -> None:
        self.steps.append(pace.step)
        self.cycles.append(pace.cycle)

    def clear(self) -> None:
        self.steps.clear()
        self.cycles.clear()

    @property
    def full(self) -> bool:
        return len(self.steps) == self.size

    def period(self) -> float:
        """Seconds per batch of a loop fed this way: the slower of the loop (its own time, slowed by the
        GPU decoders' work beside it) and the loader (its cycle), medians."""
        return max(float(np.median(self.steps)), float(np.median(self.cycles)))

    def model_bound(self) -> bool:
        """Whether the loop's own time per batch is at least half the loader's: only then can the GPU
        decoders' cost to the loop decide the pace (with no model beside it, it never does)."""
        return float(np.median(self.steps)) >= 0.5 * float(np.median(self.cycles))


class CostCheck:
    """Whether the GPU decoders decode at all, decided by what they cost the training loop beside them.

    Their work in the training process slows the loop's own steps (its thread's host time: the GIL,
    the driver's lock, the cores their host threads take): beside ResNet-18 on two H200s, the engines
    taking 10-25 % of the images slowed each step by 2-3 ms, and training fell from 75.4 % of the
    ceiling with the workers alone to 68-70 % (docs/benchmarks.md, "Several GPUs (torchrun)"). So the
    GPU decoders are used only while a loop
    fed with them runs faster than one fed by the CPU alone, measured while it runs: every so often
    (`Tuning.cost_probe` batches at first, twice as long each time the answer stays, up to 16 times)
    the batches of one window are made the other way, and each way's period (`_Window.period`: the
    slower of the loop's own time per batch and the producer's cycle, neither hidden by the queue of
    batches ahead) is compared; the GPU decoders stay only where theirs is shorter by
    `Tuning.cost_margin`. A window is measured only where it can matter: the CPU alone is tried while
    the loop's own time is at least half the loader's (with no model, or a model far faster than the
    loader, the GPU decoders' full rate is used), the GPU decoders again only while the loader is the
    slower side. A pace is counted for the way the batch decoded during it was made (the decoders'
    work beside the loop is what slows it), and the first two after a switch not at all."""

    SETTLE = 2  # paces after a switch that are not counted (the batch decoded meanwhile was made the old way)
    LONGEST = 16  # the longest wait between windows, in `Tuning.cost_probe`s

    def __init__(self, tuning: Tuning):
        self.tuning = tuning
        self.benched = False  # the GPU decoders decode nothing (they cost the loop more than they save)
        self._windows = {True: _Window(tuning.steer_steps), False: _Window(tuning.steer_steps)}
        self._every = tuning.cost_probe
        self._next = tuning.cost_probe  # batches steered until the next window is measured
        self._probing = 0  # batches left in the window measured the other way
        self._settle = 0
        self._made = 0
        self.last_gpu = False  # whether the batch started last had a GPU share
        self._recent: deque[bool] = deque(maxlen=tuning.steer_steps)  # the same, for the last batches
        self.decided: deque[tuple[int, bool]] = deque(maxlen=64)  # (batch, benched) at each decision: stats

    def record(self, pace: Pace | None) -> None:
        """Count the loop's pace since the last batch for the way the batch then decoding was made, and
        start or end a window of the other way."""
        self._made += 1
        self._recent.append(self.last_gpu)
        if pace is not None and pace.step is not None:
            if self._settle:
                self._settle -= 1
            else:
                self._windows[self.last_gpu].add(pace)
        if self._probing:
            self._probing -= 1
            if not self._probing:
                self._decide()
        elif self._made >= self._next:
            if self._worth_trying():
                self._switch()
                self._probing = self.tuning.steer_steps + self.SETTLE
            else:  # asked again a period later, not every batch
                self._next = self._made + self._every

    def _worth_trying(self) -> bool:
        """Whether a window of the other way could change the answer (see the class's docstring)."""
        if self.benched:  # the CPU alone: the GPU decoders can only help where the loader is the slower side
            now = self._windows[False]
            return now.full and float(np.median(now.cycles)) > float(np.median(now.steps))
        now = self._windows[True]  # at work lately, beside a loop their cost may slow
        return any(self._recent) and now.full and now.model_bound()

    def _switch(self) -> None:
        """Make the next batches the other way, counted afresh after `SETTLE` paces."""
        self.benched = not self.benched
        self._windows[not self.benched].clear()
        self._settle = self.SETTLE

    def _decide(self) -> None:
        """After a window of the other way: keep whichever way feeds the loop faster, and wait twice as
        long before the next window where the answer did not change."""
        tried = self.benched  # the window's way; the way before it was the other
        gpu, cpu = self._windows[True], self._windows[False]
        if gpu.full and cpu.full:
            self.benched = not gpu.period() < (1 - self.tuning.cost_margin) * cpu.period()
        else:  # too few paces counted (a pass ended meanwhile): back to the way before
            self.benched = not tried
        if self.benched != tried:
            self._settle = self.SETTLE
        kept = self.benched != tried
        self._every = min(2 * self._every, self.LONGEST * self.tuning.cost_probe) if kept else self.tuning.cost_probe
        self._next = self._made + self._every
        self.decided.append((self._made, self.benched))


class Steering:
    """The shares of a batch for GPU decoders named `gpu` (in order) and the CPU; `cpu_share` False:
    the CPU decodes only what the GPU decoders reject."""

    def __init__(self, gpu: list[str], cpu_share: bool, tuning: Tuning = Tuning()):
        self.cpu_share, self.tuning = cpu_share, tuning
        with _learning:  # per decoder: averaged images and seconds, from an earlier pipeline's where one closed
            self._spent: dict[str, tuple[float, float]] = dict(_learned)
            self._together = dict(_learned_together)
        self.rates = {"cpu": self._rate("cpu", CPU_START_RATE)}
        self._gpu_measured = False  # whether `gpu_rate` was measured here (`learn`)
        self._measured: set[str] = set()  # the decoders whose rates were measured here (`learn`)
        self.use_gpu(gpu)
        self.cpu_wait = self.gpu_wait = 0.0  # the producer's waits for the CPU's and GPU's shares since `steer`
        self.step: float | None = None  # the training loop's own seconds per batch (`Pace.step`), once known
        self._steps: deque[float] = deque(maxlen=tuning.steer_steps)
        self.cost = CostCheck(tuning) if tuning.cost_check else None  # whether the GPU decoders pay for themselves

    def use_gpu(self, gpu: list[str]) -> None:
        """Steer for GPU decoders named `gpu` from the next batch on (they open after the first
        batches: `Scheduler`), split at first so that they and the CPU finish together."""
        self.rates = {name: self._rate(name, START_RATES[name]) for name in gpu} | {"cpu": self.rates["cpu"]}
        # the GPU decoders together: images per second of a batch until the last of them is done.
        # Below the sum of their own rates (starting them, handing results back); the CPU's share is
        # set against it, so the CPU finishes with the GPU rather than with the GPU decoders' calls
        self.gpu_rate = self._together.get(tuple(gpu), sum(self.rates[name] for name in gpu))
        # the GPU decoders' part of each batch; None until a batch was made with them, when the shares
        # are set so that the CPU and the GPU decoders finish together
        self.gpu_part: float | None = None
        self.gpu = gpu  # last: what `shares` reads first

    def _rate(self, name: str, start: float) -> float:
        """`name`'s rate as measured so far (here, or by an earlier pipeline: `learn`), else `start`."""
        spent = self._spent.get(name)
        return start if spent is None else spent[0] / spent[1]

    def learn(self) -> None:
        """Leave what this steering measured to the process's next pipelines (`_learned`; a rate it only
        carried from an earlier one is not written back over a later one's): called as its pipeline
        closes."""
        with _learning:
            _learned.update({name: self._spent[name] for name in list(self._measured)})
            if self._gpu_measured and self.gpu:
                _learned_together[tuple(self.gpu)] = self.gpu_rate

    def shares(self, n: int, threads: int) -> list[int]:
        """Images per decoder (GPU decoders in order, then the CPU) for a batch of `n`: the GPU decoders
        `gpu_part` of it (none under `Tuning.gpu_min`; before it is known, what makes the CPU's
        `threads` and the GPU decoders finish together), split by their own rates; the CPU the rest,
        and at least one image per thread, so its rate is always measured anew."""
        if not self.gpu:
            return [n]
        cpu = n - self.gpu_count(n, threads)
        if self.cpu_share and self.cost is not None:
            self.cost.last_gpu = cpu < n
        own = np.cumsum([self.rates[name] for name in self.gpu])
        bounds = np.rint((n - cpu) * own / own[-1]).astype(np.int64)
        return np.diff(bounds, prepend=0).tolist() + [cpu]

    def gpu_count(self, n: int, threads: int) -> int:
        """How many images of a batch of `n` the GPU decoders take together (`shares`, which also keeps
        count of what it split; this only says)."""
        if not self.gpu:
            return 0
        if not self.cpu_share:
            return n
        if self.gpu_part is None:
            gpu = round(n * self.together(threads))
        else:
            gpu = round(n * self.gpu_part)
            gpu = 0 if gpu < self.tuning.gpu_min * n or (self.cost is not None and self.cost.benched) else gpu
        return n - min(n, max(n - gpu, threads))

    def together(self, threads: int) -> float:
        """The GPU decoders' part of a batch for which they and the CPU's `threads` finish together."""
        return self.gpu_rate / (self.rates["cpu"] * threads + self.gpu_rate)

    def steer(self, pace: Pace | None, threads: int, n: int) -> None:
        """Move `gpu_part` by `Tuning.gpu_step` after the producer's last batch (see `Tuning.gpu_step`), to no less
        than `beyond_cpu` for the next batch of `n`; `pace` None: nothing known yet."""
        if pace is not None and pace.step is not None:
            self._steps.append(pace.step)
            self.step = float(np.median(self._steps))
        if pace is not None and self.cpu_share and self.gpu:
            if self.cost is not None:
                self.cost.record(pace)
            if self.gpu_part is None:
                self.gpu_part = self.together(threads)
            elif self.cost is not None and self.cost.benched:
                pass  # the GPU decoders idle: their part is kept for the next window with them
            elif pace.starved > self.tuning.starved * pace.interval and self.cpu_wait > self.gpu_wait:
                self.gpu_part = min(1.0, self.gpu_part + self.tuning.gpu_step)
            else:
                self.gpu_part = max(0.0, self.gpu_part - self.tuning.gpu_step)
            if self.step is not None:
                self.gpu_part = max(self.gpu_part, self.beyond_cpu(threads, n))
        self.cpu_wait, self.gpu_wait = 0.0, 0.0

    def beyond_cpu(self, threads: int, n: int) -> float:
        """The part of a batch of `n` the CPU's `threads` cannot decode, at their measured rate, in the
        training loop's own time per batch (`step`): none under `Tuning.gpu_min`, and no more than the
        part for which the CPU and the GPU decoders finish together."""
        # (`step` is known: `observe` asks only then)
        need = 1.0 - self.tuning.cpu_load * self.rates["cpu"] * threads * self.step / n  # type: ignore[operator]
        return 0.0 if need < self.tuning.gpu_min else min(need, self.together(threads))

    def observe(self, m: Measured) -> None:
        """Learn from a finished batch: each decoder's rate, the GPU decoders' rate together, and the
        producer's waits for each side (which `steer` weighs, then clears)."""
        for share in m.gpu.shares:
            self.measured(share.decoder.name, len(share.positions) - len(share.part.failed), share.seconds)
        if m.gpu.shares:
            self.gpu_done(m.gpu_images - m.retried, m.gpu.seconds)
        if m.cpu_images:  # the rate of a thread or worker while it decodes: the share's images over its own seconds
            self.measured("cpu", m.cpu_images, m.cpu_busy)
        self.gpu_wait += m.gpu_wait
        self.cpu_wait += m.cpu_wait

    def measured(self, name: str, images: float, seconds: float) -> None:
        """Fold one measurement into `rates[name]`: images and seconds are averaged apart (exponentially)
        and divided, so one short interval does not inflate the rate as an average of ratios would."""
        if images and seconds > 0:
            spent = self._spent.get(name)
            spent = (
                (images, seconds) if spent is None else (0.7 * spent[0] + 0.3 * images, 0.7 * spent[1] + 0.3 * seconds)
            )
            self._spent[name] = spent
            self.rates[name] = spent[0] / spent[1]
            self._measured.add(name)

    def gpu_done(self, images: int, seconds: float) -> None:
        """The GPU decoders made `images` of a batch in `seconds`, from their start until the last was done."""
        self.gpu_rate = 0.7 * self.gpu_rate + 0.3 * images / max(seconds, 1e-6)
        self._gpu_measured = True
