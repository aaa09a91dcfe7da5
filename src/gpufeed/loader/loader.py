"""`gpufeed.Loader`: batches from a raw store, augmented on the device, the training loop never waiting.

A producer thread runs ahead by `prefetch` batches: it gathers the batch (on the GPU for the
gpu/host tiers, with CPU threads into a pinned ring slot for the disk tier), issues the copy
on a side stream and records an event. The consumer makes its stream wait on that event,
then runs the augmentation on its own stream.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from gpufeed.augment.pipeline import Augment
from gpufeed.loader import tiers
from gpufeed.loader.plan import EpochPlan, plan_epoch
from gpufeed.loader.sampler import ShardedBatchSampler, resolve_rank
from gpufeed.loader.stats import Stats
from gpufeed.store.reader import Store
from gpufeed.transfer.gather import Gatherer
from gpufeed.transfer.ring import PinnedRing, hand_over

log = logging.getLogger(__name__)
_DONE = object()


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: gpufeed runs on 'cuda' or 'cpu'")
    return dev


class Loader:
    """Iterate `(images, labels)` batches of a raw store on `device`; see the README for every argument."""

    FUSED_GATHER = ("gpu",)  # tiers whose augment kernel reads store rows directly

    def __init__(self, store: Store | str | Path, batch_size: int = 256, device: str | torch.device = "cuda",
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, augment: Sequence | None = None,
                 dtype: torch.dtype = torch.float16, channels_last: bool = False, cache: str = "auto",
                 rank: int | None = None, world_size: int | None = None, prefetch: int = 3,
                 gather_threads: int | None = None):
        self.store = store if isinstance(store, Store) else Store(store)
        if self.store.mode != "raw":
            raise ValueError(f"{self.store.path}: Loader reads raw stores; this one is {self.store.mode!r}")
        self.device = _device(device)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.sampler = ShardedBatchSampler(len(self.store), batch_size, shuffle=shuffle, seed=seed, rank=self.rank,
                                           world_size=self.world_size, drop_last=drop_last)
        self.augment = Augment(augment) if augment is not None else None
        self.dtype = dtype if self.augment is not None else torch.uint8
        self.channels_last, self.seed, self.prefetch = channels_last, seed, max(1, prefetch)
        self.tier = tiers.materialize(self.store, self.device, cache)
        log.info("gpufeed.Loader: tier %s (%s)", self.tier.name, self.tier.reason)
        self._gather = Gatherer(gather_threads or min(8, os.cpu_count() or 1))
        self._ring: PinnedRing | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.epoch, self._batch = 0, 0
        self._stats = Stats(self.tier.name)
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-planner")
        self._next_plan: tuple[int, Future] | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch at the next iteration."""
        self.epoch, self._batch = epoch, 0

    def state_dict(self) -> dict:
        """Where the loader is: the next iteration resumes right after the last batch yielded."""
        return {"epoch": self.epoch, "batch": self._batch, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.sampler.batch_size, "samples": len(self.store)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "world_size", "batch_size", "samples"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict has {key}={state[key]}, this loader has {mine[key]}")
        self.epoch, self._batch = int(state["epoch"]), int(state["batch"])

    def stats(self) -> dict:
        """Per-stage times, bytes moved, tier and consumer stalls so far."""
        return self._stats.as_dict()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, start = self.epoch, self._batch
        if start >= len(self):
            epoch, start = epoch + 1, 0
        self.epoch, self._batch = epoch, start
        out: queue.Queue = queue.Queue(self.prefetch)
        stop = threading.Event()
        producer = threading.Thread(target=self._produce, args=(epoch, start, out, stop), daemon=True,
                                    name="gpufeed-producer")
        producer.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = out.get()
                self._stats.add("wait", time.perf_counter() - t0)
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                batch = self._finish(*item)
                self._batch += 1
                yield batch
        finally:
            stop.set()
            while producer.is_alive():
                try:
                    out.get_nowait()
                except queue.Empty:
                    producer.join(0.01)
        if self._batch >= len(self):
            self.epoch, self._batch = epoch + 1, 0

    def _finish(self, images, labels, params, event, index) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        made_on_side_stream = [labels, *(params.tensors() if params else ())]
        made_on_side_stream += [images] if index is None else [index]
        hand_over(event, *made_on_side_stream)
        if self.augment is not None:
            images = self.augment.apply(images, params, self.dtype, self.channels_last, index)
        else:
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            images = images.permute(0, 3, 1, 2).contiguous(memory_format=fmt)
        self._stats.add("augment", time.perf_counter() - t0)
        self._stats.count(len(labels))
        return images, labels

    def plan(self, epoch: int, number: int):
        """(sorted sample indices, augment Params or None) of batch `number` of `epoch` on this rank."""
        return self._plan(epoch).batch(number)

    def _plan(self, epoch: int) -> EpochPlan:
        shape = self.store.image_shape
        return plan_epoch(self.sampler, self.augment, self.seed, epoch, (shape[0], shape[1]))

    def _plan_ahead(self, epoch: int) -> EpochPlan:
        """The plan of `epoch` (ready if it was prepared ahead); starts preparing `epoch + 1`."""
        ready = self._next_plan
        plan = ready[1].result() if ready is not None and ready[0] == epoch else self._plan(epoch)
        self._next_plan = (epoch + 1, self._planner.submit(self._plan, epoch + 1))
        return plan

    def _produce(self, epoch: int, start: int, out: queue.Queue, stop: threading.Event) -> None:
        try:
            plan = on_device = self._plan_ahead(epoch)
            labels = ready = None
            if self._copy_stream is not None:  # one upload per epoch, on the copy stream
                with torch.cuda.stream(self._copy_stream):
                    on_device = plan.to(self.device)
                    if self.tier.gathers_on_device:
                        labels = self.tier.labels.index_select(0, on_device.indices)
                    ready = self._copy_stream.record_event()
            for number in range(start, len(plan)):
                if stop.is_set():
                    return
                idx, _ = plan.batch(number)
                device_idx, params = on_device.batch(number)
                if labels is not None:
                    a, b = plan.starts[number], plan.starts[number + 1]
                    item = self._on_device(device_idx, labels[a:b], params, ready)
                else:
                    item = self._load(idx, params)
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            out.put(_DONE)
        except BaseException as e:  # handed to the consumer, raised there
            out.put(e)

    def _on_device(self, idx: torch.Tensor, labels: torch.Tensor, params, ready: torch.cuda.Event):
        """gpu/host tiers: the GPU gathers. With augmentation (tiers in FUSED_GATHER), the augment
        kernel reads the store rows itself (no gathered copy); otherwise gather on the copy stream."""
        t0 = time.perf_counter()
        stream = self._copy_stream
        if self.augment is not None and self.tier.name in self.FUSED_GATHER:
            return self.tier.images, labels, params, ready, idx
        with torch.cuda.stream(stream):
            images = self.tier.images.index_select(0, idx)
            event = stream.record_event()
        self._stats.add("gather", time.perf_counter() - t0, images.numel())
        return images, labels, params, event, None

    def _load(self, idx: torch.Tensor, params):
        """disk tier (and CPU device): CPU threads gather into a pinned slot, then copy."""
        t0 = time.perf_counter()
        stream = self._copy_stream
        n, shape = len(idx), tuple(self.tier.images.shape[1:])
        if stream is None:  # CPU device: gather straight into the batch handed out
            images = self._gather(self.tier.images, idx, torch.empty((n, *shape), dtype=torch.uint8))
            self._stats.add("gather", time.perf_counter() - t0, images.numel())
            return images, self.tier.labels.index_select(0, idx), params, None, None
        if self._ring is None:
            self._ring = PinnedRing(self.prefetch + 2, shape, self.sampler.batch_size, pin=True)
            if not self._ring.pinned:
                self._stats.note("pinned memory unavailable: pageable copies")
        k = self._ring.acquire()
        images = self._gather(self.tier.images, idx, self._ring.images[k][:n])
        labels = torch.index_select(self.tier.labels, 0, idx, out=self._ring.labels[k][:n])
        self._stats.add("gather", time.perf_counter() - t0, images.numel())
        t1 = time.perf_counter()
        with torch.cuda.stream(stream):
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            event = stream.record_event()
        self._ring.release(k, event)
        self._stats.add("h2d_issue", time.perf_counter() - t1, images.numel())
        return images, labels, params, event, None
