"""Batches from a jpeg store, made on threads of the training process with its one CUDA context.

The pipelines (one by default, `Tuning.pipelines`; one on a CPU device, where the workers do the
decoding) each make whole batches on a producer thread
(`jpeg_batch.JpegBatcher`), `prefetch` batches ahead of the training loop and no further, on a
stream of their own, sharing the CPU decode worker processes. docs/architecture.md draws the
processes, threads and streams.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from gpufeed.augment.params import Params
from gpufeed.decode.pool.workers import DecodeWorkers
from gpufeed.decode.scheduling.choice import DEFAULT, check_decoders
from gpufeed.decode.scheduling.scheduler import summed
from gpufeed.loader.bytes import ByteSource
from gpufeed.loader.cores import rank_cores
from gpufeed.loader.jpeg_batch import DecodeError, JpegBatcher, Upcoming
from gpufeed.loader.plan import EpochPlan
from gpufeed.loader.producer import Carried, Made, NextEpoch, Production, threaded
from gpufeed.loader.settings import Decoding, Output
from gpufeed.loader.stats import Stats
from gpufeed.logs import logger

__all__ = ["PREFETCH", "DecodeError", "JpegBatcher", "JpegPipelines", "jpeg_feed", "jpeg_pipelines"]

log = logger(__name__)


# the Loader's default `prefetch` for jpeg stores: where the workers only just keep up with a model,
# their slow spells last a few batches, and a deeper queue rides them out
# (docs/benchmarks.md, "Six batches ahead for jpeg stores")
PREFETCH = 6


class JpegPipelines:
    """The loader's JPEG pipelines and the CPU decode workers they share (None: threads)."""

    def __init__(self, pipelines: list[JpegBatcher], workers: DecodeWorkers | None):
        self.pipelines, self.workers = pipelines, workers

    @property
    def names(self) -> list[str]:
        """The decoders in use: the GPU decoders open so far, then the CPU."""
        return self.pipelines[0].scheduler.names

    def opened(self, timeout: float | None = None) -> bool:
        """Wait until every pipeline's GPU decoders are open (at most `timeout` seconds each): they open on a
        thread of their own while the CPU decodes the first batches (`Tuning.open_ahead`); whether they are."""
        return all(p.scheduler.opened(timeout) for p in self.pipelines)

    def started(self) -> dict[str, float | list[float] | None]:
        """When the GPU decoders were first taken into use by a pipeline (None: not yet, or none here)
        and when each CPU decode worker said it was ready (time.perf_counter), for `Stats.start`."""
        opened = [p.scheduler.opened_at for p in self.pipelines if p.scheduler.gpu and p.scheduler.opened_at]
        return {
            "gpu_decoders_in_use": min(opened) if opened else None,
            "workers_ready": self.workers.ready_times if self.workers is not None else None,
        }

    def stats(self) -> dict:
        """`loader.stats()`'s decoder entries: counts, rates and seconds summed over the pipelines, and
        the workers' busy seconds."""
        out = summed(self.names, [p.scheduler.snapshot() for p in self.pipelines])
        # per pipeline, the GPU decoders' cost checks: (batch, whether they were left idle after it)
        out["cost_checks"] = [
            list(p.scheduler.steering.cost.decided) for p in self.pipelines if p.scheduler.steering.cost
        ]
        if self.workers is not None:
            out["decode_seconds"] |= dict(self.workers.busy)
            out["workers_start_s"] = self.workers.start_seconds()
            out["workers_reused"] = self.workers.reused  # started for an earlier loader of this process
        return out

    def close(self) -> None:
        for p in self.pipelines:
            p.close()
        if self.workers is not None:
            self.workers.close()


def jpeg_feed(
    pipelines: list[JpegBatcher],
    production: Production,
    plan: EpochPlan,
    start: int,
    epoch: int = 0,
    next_plan: Callable[[], EpochPlan] | None = None,
    carried: Carried | None = None,
):
    """Batches `start`.. of a jpeg store's epoch `plan`, batch k made by pipeline k % pipelines on its
    own thread, `production.prefetch` ahead of the consumer; each pipeline is told its next two
    batches (it starts decoding the first early, and reads a folder's files of the second). With one
    pipeline, `next_plan` (the plan of epoch `epoch` + 1, when called) is where those come from at the
    end of the epoch, and its first `prefetch` batches are made as the epoch ends (`producer.Carried`;
    None: not carried); `carried`: such batches, made for this epoch."""
    step, length = len(pipelines), len(plan)
    plans: dict[int, EpochPlan] = {0: plan}

    def plan_of(which: int) -> EpochPlan:
        if which not in plans:
            plans[which] = next_plan()  # type: ignore[misc]  # the next epoch's: asked for only with next_plan
        return plans[which]

    def later(which: int, number: int) -> list[tuple[int, int]]:
        """(0 this epoch / 1 the next, batch number) of the pipeline's next two batches."""
        keys = [(which, number + k * step) for k in (1, 2)]
        if next_plan is None or step > 1:
            return [(w, n) for w, n in keys if w == which and n < length]
        return [(w + n // length, n % length) for w, n in keys if w + n // length <= 1]

    def batch(which: int, number: int) -> tuple[torch.Tensor, Params]:
        idx, params = plan_of(which).batch(number)
        return idx, params  # type: ignore[return-value]  # a jpeg store's Loader has augment ops: Params

    def make(which: int, number: int, k: int) -> Made:
        batcher = pipelines[k]
        idx, params = batch(which, number)
        ahead = tuple(Upcoming(*batch(w, n)) for w, n in later(which, number))
        if batcher.stream is None:
            return Made(batcher.make(idx, params, ahead), None)
        with torch.cuda.stream(batcher.stream):
            made = batcher.make(idx, params, ahead)
            event = batcher.stream.record_event()
        return Made(made, event)

    carry = NextEpoch(epoch + 1, functools.partial(make, 1)) if next_plan is not None and step == 1 else None
    return threaded(
        production, functools.partial(make, 0), range(start, length), length, workers=step, carry=carry, carried=carried
    )


def default_workers(device: torch.device) -> int:
    """CPU decode workers when the user names none: on a GPU all of this rank's cores but two, or an
    eighth of them if more (the training loop, the producer thread and, when the workers fall behind,
    the GPU decoders' host threads need those: the workers decode as much of each batch as they can,
    since beside a training loop they cost it far less than the GPU decoders), on a CPU every core of
    the rank. The rank's cores are counted once (`cores.rank_cores`: its affinity, divided among the
    local ranks only where they share it, within a cgroup CPU quota)."""
    usable = rank_cores().usable
    return max(1, usable - max(2, usable // 8)) if device.type == "cuda" else usable


def takes_workers(workers: int, decoders: tuple[str, ...] | None, cuda: bool) -> bool:
    """Whether a jpeg Loader of `workers` CPU decode processes and `decoders` starts them: where the
    CPU decodes (with the default decoders, on a GPU too)."""
    return bool(workers) and ("cpu" in (decoders or DEFAULT) or not cuda)


def jpeg_pipelines(images: ByteSource, output: Output, decoding: Decoding, counters: Stats) -> JpegPipelines:
    """A jpeg Loader's pipelines (`decoding.tuning.pipelines` on a GPU, one on a CPU), their decoders
    (`decoding.decoders`, None: `decode.scheduling.choice.DEFAULT`'s rule), and `decoding.workers` CPU decode
    processes they share (0: CPU decoding on threads of this process, which share its GIL)."""
    if decoding.decoders is not None:
        check_decoders(decoding.decoders)
    workers, tuning, device = decoding.workers, decoding.tuning, output.device
    pool = None
    if takes_workers(workers, decoding.decoders, output.cuda) and len(images):
        try:
            view = images.for_workers()
            pool = DecodeWorkers(view.data, workers, device, files=view.files, tickets=tuning.tickets)
        except (RuntimeError, OSError) as e:
            log.warning(
                "gpufeed.Loader: CPU JPEG decode in worker processes unavailable (%s); decoding on "
                "threads, which share the GIL with the training loop (slower)",
                e,
            )
    count = tuning.pipelines if output.cuda else 1
    threads = decoding.cpu_threads if output.cuda else max(1, workers)  # one pipeline on a CPU device
    turn = threading.Lock() if count > 1 and tuning.turns else None
    jpeg = JpegPipelines(
        [JpegBatcher(images, output, decoding, counters, threads, pool, turn) for _ in range(count)], pool
    )
    where = f"{pool.size} worker processes" if pool is not None else f"{threads} threads per pipeline"
    opening = " (the GPU decoders opening)" if jpeg.pipelines[0].scheduler.opening else ""
    log.info(
        "gpufeed.Loader: jpeg decoders %s%s, %d pipeline(s), CPU decode in %s",
        " + ".join(jpeg.names),
        opening,
        count,
        where,
    )
    return jpeg
