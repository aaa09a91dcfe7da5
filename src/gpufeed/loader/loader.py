"""`gpufeed.Loader`: batches from a raw or jpeg store, augmented on the device, the training loop
never waiting.

The loader owns the state (epoch, position, seed), the tier and the streams; the planner draws each
epoch's indices and augment parameters ahead. `feeds` moves raw batches (asynchronous launches for
the gpu/host tiers, a producer thread with a pinned ring for the disk tier); `loader.jpeg` decodes
jpeg batches on a producer thread (GPU decoder + CPU worker processes) and resizes them in the
fused kernel. Either way the consumer's stream waits on each batch's event.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from gpufeed.augment.pipeline import Augment
from gpufeed.decode.tuning import Tuning
from gpufeed.loader import tiers
from gpufeed.loader.folder import FolderStore, is_folder_source
from gpufeed.loader.batch import Batch
from gpufeed.loader.bytes import PackedBytes
from gpufeed.loader.feeds import HostGather, device_feed, host_feed
from gpufeed.loader.fields import FieldRequest, batch_dict
from gpufeed.loader.jpeg import PREFETCH, JpegPipelines, default_workers, jpeg_feed, jpeg_pipelines
from gpufeed.loader.producer import CLOSE_WAIT, Carried, Production
from gpufeed.loader.settings import Decoding, Output, resolve_device
from gpufeed.loader.planner import Planner
from gpufeed.loader.sampler import ShardedBatchSampler, resolve_rank
from gpufeed.loader.stats import Stats, stage_range
from gpufeed.store.reader import Store
from gpufeed.transfer.gather import Gatherer
from gpufeed.transfer.ring import PinnedRing

log = logging.getLogger(__name__)


# every Loader of this process that may have threads running: closed at the interpreter's exit, before
# it finalizes (see `producer.Producers`). Registered after torch's own exit hooks, so it runs before them
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for loader in list(_LIVE):
        if loader._pid == os.getpid():  # a forked child's copies are its parent's to stop
            loader.close()


def _workers(num_workers: int | None, device: torch.device) -> int:
    """The CPU decode worker processes asked for (None: `jpeg.default_workers`), checked."""
    workers = default_workers(device) if num_workers is None else num_workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"num_workers must be an int, 0 or more, got {workers!r}")
    return workers


def _check_augment(augment: Augment, path: object, sizes: tuple[int, int] | torch.Tensor) -> None:
    """Refuse an op list that can't yield one batch shape from this store, when the Loader is built
    rather than at the first batch: drawn once on the store's extreme image sizes (smallest and largest
    side, widest and tallest)."""
    if isinstance(sizes, torch.Tensor):
        if not len(sizes):
            return
        h, w = sizes[:, 0].double(), sizes[:, 1].double()
        picks = torch.stack([h.argmin(), h.argmax(), w.argmin(), w.argmax(), (w / h).argmin(), (w / h).argmax()])
        height, width = sizes[picks, 0].long(), sizes[picks, 1].long()
    else:
        height, width = sizes
    try:
        augment.sample(6, height, width, torch.Generator().manual_seed(0))
    except ValueError as e:
        raise ValueError(f"{path}: augment ops {augment.ops!r}: {e}") from None


class Loader:
    """Iterate `(images, labels)` batches of a gpufeed store on `device`, as a DataLoader would.

    Args:
        store: a `Store` or the path of one (raw or jpeg); or, to read JPEGs in place without packing
            (an inference or evaluation pass), a folder (ImageFolder or flat), a CSV/JSONL list or
            uncompressed tar shards (see `loader.folder`).
        batch_size: samples per batch on this rank.
        device: where batches are made and returned ("cuda", "cuda:1", "cpu").
        shuffle: a seeded permutation per epoch (else store order); each batch's samples come in a
            seeded random order either way, as part of the plan.
        seed: seeds the permutation and every augment parameter; with (epoch, rank) it fixes a batch.
        drop_last: drop the uneven tail of the epoch; else shards are padded by wrapping and the last
            batch may be short.
        augment: `gpufeed.augment` ops (geometric, then ColorJitter, then Normalize); None yields
            uint8. A jpeg store needs ops that end in a fixed size. Checked here, not at iteration.
        dtype: output dtype when `augment` is given (uint8 otherwise).
        channels_last: return NHWC-strided batches.
        cache: raw stores: "gpu", "host", "disk" or "auto" (the first that fits in half of the free
            memory); jpeg stores keep their bytes in host memory ("gpu" is served as "host").
        rank, world_size: the shard to read; default from torch.distributed, else RANK/WORLD_SIZE.
        prefetch: batches made ahead of the consumer, at most (default 3; jpeg: 6, and also the next
            epoch's first ones, made as an epoch ends and dropped if another epoch is iterated).
        gather_threads: disk tier: CPU threads gathering rows (default min(8, cores)).
        on_error: jpeg: "skip" replaces an undecodable sample (warned once, counted), "raise" raises
            `DecodeError` naming it. Any store: a damaged text or JSON field value is None under
            "skip" (warned once) and raises `StoreError` under "raise".
        num_workers: jpeg: CPU decode worker processes (default with a GPU: this rank's cores but two,
            or but an eighth of them if more; on CPU all of them; 0 decodes on threads of this
            process). With a GPU they decode all they can, the GPU decoders what they can't.
        decoders: jpeg: names among "hw", "nvjpeg", "cuda", "cpu"; default one GPU decoder (the
            engines if nvImageCodec is installed, else nvJPEG) plus "cpu".
        pad: with `drop_last=False`, shards are padded by wrapping so every rank has as many batches
            (DistributedSampler's way); `pad=False` gives every sample exactly once over all ranks
            (distributed evaluation), and ranks may differ by one batch.
        restart: an `iter()` after a pass left early begins the same epoch again from its first batch
            (the same samples and augment draws: evaluation loaders that frameworks iterate partly,
            e.g. a sanity check). False: it begins the next epoch, as a DataLoader's new iterator is a
            new pass. Either way `load_state_dict` resumes the next `iter()` where the state says.
        fields: yield a dict per batch instead of `(images, labels)`: "image" and each field named
            here: "label" (or MixUp/CutMix targets), "source" (file paths, a list), or any field of
            the store (`store.fields`): ints, floats and arrays as tensors on `device`, strings,
            bytes and JSON values as lists. They follow the samples through shuffling, sharding,
            resume and the replacement of undecodable samples. "boxes" (a store's boxes field) go
            through the same crops, flips and warps as the images: a zero-padded (N, M, 4) tensor,
            and "boxes_count" (N,).
        tuning: jpeg: the JPEG path's measured settings (`gpufeed.decode.tuning.Tuning`), for
            benchmarks that compare others; the default is what measurements chose.

    Raises:
        ValueError: bad arguments, an op list that can't give one batch shape, CUDA missing.
        StoreError: the store is missing, damaged or of a newer format.
    """

    # tiers whose augment kernel reads store rows itself: on the host tier it reads only the crop
    # regions over PCIe, which moves fewer bytes than gathering whole rows first
    FUSED_GATHER = ("gpu", "host")

    def __init__(self, store: Store | str | Path, batch_size: int = 256, device: str | torch.device = "cuda",
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, augment: Sequence | None = None,
                 dtype: torch.dtype = torch.float16, channels_last: bool = False, cache: str = "auto",
                 rank: int | None = None, world_size: int | None = None, prefetch: int | None = None,
                 gather_threads: int | None = None, on_error: str = "skip", num_workers: int | None = None,
                 decoders: tuple[str, ...] | None = None, restart: bool = False, pad: bool = True,
                 fields: Sequence[str] | None = None, tuning: Tuning | None = None):
        if isinstance(store, (Store, FolderStore)):
            self.store = store
        else:
            self.store = FolderStore(store) if is_folder_source(store) else Store(store)
        self.fields = tuple(fields) if fields is not None else None
        for name in self.fields or ():
            if name not in ("label", "source", "image"):
                try:
                    self.store.column(name)
                except KeyError as e:
                    raise ValueError(e.args[0]) from None
        if self.store.mode == "jpeg" and not augment:
            raise ValueError(f"{self.store.path}: a jpeg store holds images of different sizes; give augment ops "
                             "that end in a fixed size, e.g. [RandomResizedCrop(224), Normalize()]")
        self.device = resolve_device(device)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_sampler = ShardedBatchSampler(len(self.store), batch_size, shuffle=shuffle, seed=seed, rank=self.rank,
                                           world_size=self.world_size, drop_last=drop_last, pad=pad)
        self.augment = Augment(augment) if augment is not None else None
        shape = self.store.image_shape
        sizes = torch.from_numpy(np.array(self.store.shapes)) if shape is None else (shape[0], shape[1])
        if self.augment is not None:
            _check_augment(self.augment, self.store.path, sizes)
            mixer = self.augment.batch_op
            labels = self.store.labels
            if mixer is not None and len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= mixer.num_classes):
                raise ValueError(f"{self.store.path}: {type(mixer).__name__}(num_classes={mixer.num_classes}) needs "
                                 f"labels in 0..{mixer.num_classes - 1}; the store's are "
                                 f"{int(labels.min())}..{int(labels.max())} (-1: unlabelled)")
        self.output = Output(self.device, self.augment, dtype if self.augment is not None else torch.uint8,
                             channels_last)
        prefetch = prefetch if prefetch is not None else PREFETCH if self.store.mode == "jpeg" else 3
        self.seed = seed
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        self.on_error = on_error
        self.tuning = tuning or Tuning()
        folder = isinstance(self.store, FolderStore)
        self.tier = tiers.in_place(self.store.labels) if folder else tiers.materialize(self.store, self.device, cache)
        log.info("gpufeed.Loader: tier %s (%s)", self.tier.name, self.tier.reason)
        self.counters = Stats(self.tier.name)
        self._production = Production(max(1, prefetch), self.counters)
        self.jpeg: JpegPipelines | None = None
        if self.store.mode == "jpeg":
            images = self.store if folder else PackedBytes(self.store, self.tier.images)
            decoding = Decoding(decoders, _workers(num_workers, self.device), on_error, batch_size, self.tuning)
            self.jpeg = jpeg_pipelines(images, self.output, decoding, self.counters)
        self._pid = os.getpid()
        self._closed = False
        _LIVE.add(self)
        self.gather = Gatherer(gather_threads or min(8, os.cpu_count() or 1))
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.epoch, self._batch = 0, 0
        self.restart, self._resuming = restart, False
        self._host: HostGather | None = None  # the disk tier's gather, its pinned ring made at the first pass
        self._planner = Planner(self.batch_sampler, self.augment, seed, sizes)
        self._fields = None if self.fields is None else FieldRequest(self.fields, self.store, self.device, on_error)

    @property
    def dtype(self) -> torch.dtype:
        return self.output.dtype

    @property
    def channels_last(self) -> bool:
        return self.output.channels_last

    @property
    def prefetch(self) -> int:
        return self._production.prefetch

    @property
    def carried(self) -> Carried | None:
        """The next epoch's first batches, made as the last one ended (or None)."""
        return self._production.carried

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.batch_sampler)

    def close(self) -> None:
        """Stop the loader's threads and decode worker processes now, and return once they have ended; it
        can't iterate after. Optional: they also stop when the loader is garbage-collected or the program
        ends, however it ends (at exit this runs for every loader not closed)."""
        if self._closed or self._pid != os.getpid():
            self._closed = True
            return
        self._closed = True
        # the producers first, each after the batch it makes: nothing uses the decoders they stop next
        producers = self._production.producers
        producers.stop()
        self._production.drop_carried()
        finished = producers.join(CLOSE_WAIT)
        if self.jpeg is not None:
            self.jpeg.close()
        if not finished and not producers.join(CLOSE_WAIT):
            log.warning("gpufeed.Loader.close: a producer thread did not end within %.0f s", 2 * CLOSE_WAIT)
        self.gather.close()
        if isinstance(self.store, FolderStore):
            self.store.close()
        self._planner.close()
        _LIVE.discard(self)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch at the next iteration."""
        self.epoch, self._batch = epoch, 0

    def state_dict(self) -> dict:
        """Where the loader is: the next iteration resumes right after the last batch yielded."""
        return {"epoch": self.epoch, "batch": self._batch, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.batch_sampler.batch_size, "samples": len(self.store)}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` (from `state_dict()`) was: the next `iter()` yields the batch after
        the last one yielded then. Raises ValueError if the seed, world size, batch size or store
        size differ (the batches would not be the same)."""
        mine = self.state_dict()
        if not isinstance(state, dict) or any(key not in state for key in mine):
            raise ValueError(f"not a gpufeed.Loader state_dict (it needs the keys {sorted(mine)})")
        for key in ("seed", "world_size", "batch_size", "samples"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict has {key}={state[key]}, this loader has {mine[key]}")
        if state.get("rank", self.rank) != self.rank:
            raise ValueError(f"state_dict is rank {state['rank']}'s, this loader is rank {self.rank}'s: load each "
                             "rank's own state")
        epoch, batch = state.get("epoch"), state.get("batch")
        for key, value in (("epoch", epoch), ("batch", batch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"state_dict has {key}={value!r}: not an int of 0 or more")
        if batch > len(self):
            raise ValueError(f"state_dict has batch={batch}, past the {len(self)} batches of an epoch")
        self.epoch, self._batch = epoch, batch
        self._resuming = True

    def stats(self) -> dict:
        """Per-stage times (among them the consumer's: "wait" for batches, and "consumer" between taking
        one and asking for the next), bytes moved, tier, consumer stalls, and for jpeg stores the decoders,
        how many images each decoded (and CPU fallbacks, failures), their rates in img/s, and the
        decode seconds spent until the GPU decoders were done and on the CPU's share after that
        (with worker processes, also their wall and CPU seconds: CPU well below wall means starved)."""
        out = self.counters.as_dict()
        if self.jpeg is not None:
            out |= self.jpeg.stats()
        return out

    def plan(self, epoch: int, number: int):
        """(sample indices in yield order, augment Params or None) of batch `number` of `epoch` on this rank."""
        return self._planner.now(epoch).batch(number)

    def _host_gather(self) -> HostGather:
        """The disk tier's gather (and every tier's on a CPU device): its pinned host slots allocated
        once, at the first pass (pinning is slow)."""
        if self._host is None:
            ring = None
            if self.copy_stream is not None:
                shape = tuple(self.tier.images.shape[1:])
                ring = PinnedRing(self.prefetch + 2, shape, self.batch_sampler.batch_size, pin=True)
                if not ring.pinned:
                    self.counters.note("pinned memory unavailable: pageable copies")
            self._host = HostGather(self.tier, self.gather, ring, self.copy_stream, self.device)
        return self._host

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor] | dict]:
        """`(images, labels)` batches (labels: soft targets with MixUp/CutMix; a dict with `fields`)
        to the end of an epoch. Each `iter()` is a new pass, as with a DataLoader: after a pass left
        early (a `break`) the next epoch begins (with `restart=True`, the same epoch again from its
        first batch); after `load_state_dict` the pass resumes after the last batch yielded then; after
        `set_epoch(e)`, epoch e begins."""
        self._check_usable()
        epoch, start = self.epoch, self._batch
        if not self._resuming and 0 < start < len(self):  # the last pass was left early
            epoch, start = (epoch, 0) if self.restart else (epoch + 1, 0)
        self._resuming = False
        if start >= len(self):
            epoch, start = epoch + 1, 0
        self.epoch, self._batch = epoch, start
        return self._pass(epoch, start)

    def _pass(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor] | dict]:
        if isinstance(self.store, Store):  # a file cut short under the memory map would end us in SIGBUS
            self.store.check_unchanged()
        plan = self._planner.get(epoch)
        carried = self._production.take_carried(epoch, start)
        if self.jpeg is not None:
            next_plan = functools.partial(self._planner.peek, epoch + 1) if self.tuning.carry else None
            batches = jpeg_feed(self.jpeg.pipelines, self._production, plan, start, epoch, next_plan, carried)
        elif self.tier.gathers_on_device:
            fused = self.augment is not None and self.tier.name in self.FUSED_GATHER
            batches = device_feed(plan, start, self.tier, self.copy_stream, self.prefetch, self.counters, fused)
        else:
            batches = host_feed(plan, start, self._host_gather(), self._production)
        try:
            while True:
                self._check_usable()  # before waiting: no producer makes batches for a forked child
                batch = next(batches, None)
                if batch is None:
                    break
                out = self._finish(batch)
                self._batch += 1
                yield out
        finally:
            batches.close()
        if self._batch >= len(self):
            self.epoch, self._batch = epoch + 1, 0

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("this gpufeed.Loader was made in another process (before a fork): its threads, "
                               "decode workers and CUDA state stay there; make a new Loader in this process")
        if self._closed:
            raise RuntimeError("this gpufeed.Loader was closed: its threads and decode workers are stopped; make a "
                               "new Loader (with `state_dict()`/`load_state_dict()` to go on where it was)")

    def _finish(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | dict:
        t0 = time.perf_counter()
        with stage_range("gpufeed.augment", self.copy_stream is not None):
            out = self._augment(batch)
        self.counters.add("augment", time.perf_counter() - t0)
        if self._fields is None:
            return out
        return batch_dict(self._fields, *out, batch.samples, self.counters,
                          functools.partial(self.plan, self.epoch, self._batch))

    def _augment(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.final:
            images = batch.images
        elif self.augment is not None:
            images = self.augment.apply(batch.images, batch.params, self.dtype, self.channels_last, batch.index)
        else:
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            images = batch.images.permute(0, 3, 1, 2).contiguous(memory_format=fmt)
        self.counters.count(len(batch.labels))
        if self.augment is not None and self.augment.batch_op is not None:  # drawn from (seed, epoch, batch)
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_033 + self._batch)
            return self.augment.batch_op(images, batch.labels, g)
        return images, batch.labels
