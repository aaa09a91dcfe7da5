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
The GPU decoders split theirs by their own rates (images/s, exponential averages). The first batches
are split so that the CPU and the GPU decoders finish together, so they come fast while the workers
start. The CPU's rate is per thread or worker, and every CPU share holds an image per ready one at
least, so a rate measured low (workers starting, a stall) is measured again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from gpufeed.decode.scheduling.choice import START_RATES
from gpufeed.decode.scheduling.shares import GpuShares
from gpufeed.decode.tuning import Tuning

CPU_START_RATE = 300.0  # images/s per thread or worker, until one was measured


@dataclass
class Pace:
    """The training loop's seconds waiting for batches since the producer's last one, the seconds
    between the producer's two batches, and the loop's own seconds per batch since then (from taking
    one to asking for the next: what it spends training; None: it took none)."""

    starved: float
    interval: float
    step: float | None = None


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


class Steering:
    """The shares of a batch for GPU decoders named `gpu` (in order) and the CPU; `cpu_share` False:
    the CPU decodes only what the GPU decoders reject."""

    def __init__(self, gpu: list[str], cpu_share: bool, tuning: Tuning = Tuning()):
        self.cpu_share, self.tuning = cpu_share, tuning
        self.rates = {"cpu": CPU_START_RATE}
        self._spent: dict[str, tuple[float, float]] = {}  # per decoder: averaged images and seconds
        self.use_gpu(gpu)
        self.cpu_wait = self.gpu_wait = 0.0  # the producer's waits for the CPU's and GPU's shares since `steer`
        self.step: float | None = None  # the training loop's own seconds per batch (`Pace.step`), once known
        self._steps: deque[float] = deque(maxlen=tuning.steer_steps)

    def use_gpu(self, gpu: list[str]) -> None:
        """Steer for GPU decoders named `gpu` from the next batch on (they open after the first
        batches: `Scheduler`), split at first so that they and the CPU finish together."""
        self.rates = {name: START_RATES[name] for name in gpu} | {"cpu": self.rates["cpu"]}
        # the GPU decoders together: images per second of a batch until the last of them is done.
        # Below the sum of their own rates (starting them, handing results back); the CPU's share is
        # set against it, so the CPU finishes with the GPU rather than with the GPU decoders' calls
        self.gpu_rate = sum(self.rates[name] for name in gpu)
        # the GPU decoders' part of each batch; None until a batch was made with them, when the shares
        # are set so that the CPU and the GPU decoders finish together
        self.gpu_part: float | None = None
        self.gpu = gpu  # last: what `shares` reads first

    def shares(self, n: int, threads: int) -> list[int]:
        """Images per decoder (GPU decoders in order, then the CPU) for a batch of `n`: the GPU decoders
        `gpu_part` of it (none under `Tuning.gpu_min`; before it is known, what makes the CPU's
        `threads` and the GPU decoders finish together), split by their own rates; the CPU the rest,
        and at least one image per thread, so its rate is always measured anew."""
        if not self.gpu:
            return [n]
        cpu = 0
        if self.cpu_share:
            if self.gpu_part is None:
                gpu = round(n * self.together(threads))
            else:
                gpu = round(n * self.gpu_part)
                gpu = 0 if gpu < self.tuning.gpu_min * n else gpu
            cpu = min(n, max(n - gpu, threads))
        own = np.cumsum([self.rates[name] for name in self.gpu])
        bounds = np.rint((n - cpu) * own / own[-1]).astype(np.int64)
        return np.diff(bounds, prepend=0).tolist() + [cpu]

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
            if self.gpu_part is None:
                self.gpu_part = self.together(threads)
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

    def gpu_done(self, images: int, seconds: float) -> None:
        """The GPU decoders made `images` of a batch in `seconds`, from their start until the last was done."""
        self.gpu_rate = 0.7 * self.gpu_rate + 0.3 * images / max(seconds, 1e-6)
