"""The two ways a raw store's batches reach the consumer, one per kind of tier.

- `device_feed` (gpu and host tiers): the GPU gathers, so there is no CPU work per batch.
  Everything is an asynchronous launch from the consumer's thread: the epoch's plan is uploaded
  once on the side stream; gathers for the next `prefetch` batches are queued on it ahead of use;
  the consumer's stream waits on each batch's event. With augmentation on the gpu and host tiers
  (`fused`), the augment kernel reads store rows itself and nothing is gathered at all.
- `host_feed` (disk tier, and every tier on a CPU device): a producer thread (`producer.threaded`)
  gathers with CPU threads into a pinned ring slot and queues the copy on the side stream.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gpufeed.loader.batch import Batch
from gpufeed.loader.plan import EpochPlan
from gpufeed.loader.producer import Made, Production, threaded
from gpufeed.loader.stats import Stats, stage_range
from gpufeed.loader.tiers import Tier
from gpufeed.transfer.gather import Gatherer
from gpufeed.transfer.ring import PinnedRing, hand_over


def device_feed(
    plan: EpochPlan, start: int, tier: Tier, stream: torch.cuda.Stream, prefetch: int, counters: Stats, fused: bool
) -> Iterator[Batch]:
    """Batches of the gpu/host tiers, all device work queued asynchronously on `stream`."""
    with torch.cuda.stream(stream):
        on_device = plan.to(tier.images.device)
        labels = tier.labels.index_select(0, on_device.indices)
        uploaded = stream.record_event()
    # once per epoch: the consumer waits for the upload and owns the epoch tensors
    hand_over(uploaded, labels, on_device.indices, *(on_device.params.tensors() if on_device.params else ()))

    def issue(number: int) -> Made:
        idx, params = on_device.batch(number)
        a, b = plan.starts[number], plan.starts[number + 1]
        samples = plan.indices[a:b]
        if fused:
            return Made(Batch(tier.images, labels[a:b], params, idx, samples=samples), None)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            images = tier.images.index_select(0, idx)
            event = stream.record_event()
        counters.add("gather", time.perf_counter() - t0, images.numel())
        return Made(Batch(images, labels[a:b], params, samples=samples), event)

    pending: deque[Made] = deque(issue(n) for n in range(start, min(start + prefetch, len(plan))))
    for number in range(start, len(plan)):
        made = pending.popleft()
        if number + prefetch < len(plan):
            pending.append(issue(number + prefetch))
        if made.event is not None:
            hand_over(made.event, made.batch.images)
        yield made.batch


@dataclass(frozen=True)
class HostGather:
    """What the disk tier's producer gathers with: the tier, CPU threads (`gather`), and on a GPU the
    pinned ring and the stream the copies go on (None on a CPU device)."""

    tier: Tier
    gather: Gatherer
    ring: PinnedRing | None
    stream: torch.cuda.Stream | None
    device: torch.device


def host_feed(plan: EpochPlan, start: int, how: HostGather, production: Production) -> Iterator[Batch]:
    """Batches gathered by CPU threads, produced `prefetch` ahead on a background thread."""
    on_device = plan
    if how.stream is not None:
        with torch.cuda.stream(how.stream):
            on_device = plan.to(how.device)
            uploaded = how.stream.record_event()
        hand_over(uploaded, *(on_device.params.tensors() if on_device.params else ()))

    def make(number: int, worker: int) -> Made:
        with stage_range("gpufeed.gather+h2d", how.stream is not None):
            return gather_copy(how, plan.batch(number)[0], on_device.batch(number)[1], production.counters)

    return threaded(production, make, range(start, len(plan)), len(plan))


def gather_copy(how: HostGather, idx: torch.Tensor, params, counters: Stats) -> Made:
    """CPU threads gather batch `idx`; on a GPU into a pinned slot, then an async copy."""
    t0 = time.perf_counter()
    tier, n = how.tier, len(idx)
    shape = tuple(tier.images.shape[1:])
    if how.ring is None:  # CPU device: gather straight into the batch handed out
        images = how.gather(tier.images, idx, torch.empty((n, *shape), dtype=torch.uint8))
        counters.add("gather", time.perf_counter() - t0, images.numel())
        return Made(Batch(images, tier.labels.index_select(0, idx), params, samples=idx), None)
    ring = how.ring
    with ring.filling() as k:
        how.gather(tier.images, idx, ring.images[k][:n])
        torch.index_select(tier.labels, 0, idx, out=ring.labels[k][:n])
    counters.add("gather", time.perf_counter() - t0, ring.images[k][:n].numel())
    t1 = time.perf_counter()
    images, labels, event = ring.send(k, n, how.stream, how.device)  # type: ignore[arg-type]  # a GPU's: with the ring
    counters.add("h2d_issue", time.perf_counter() - t1, images.numel())
    return Made(Batch(images, labels, params, samples=idx), event)
