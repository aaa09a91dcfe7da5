"""`gpufeed.Loader`: batches from a raw or jpeg store, augmented on the device, the training loop
never waiting.

The loader owns the state (epoch, position, seed), the tier and the streams; what differs by the
data's kind (a store in one file, sharded, in a bucket, a folder read in place) is its `Input`'s
(`loader/inputs/`), and the loader names no store class. The planner draws each
epoch's indices and augment parameters ahead. `feeds` moves raw batches (asynchronous launches for
the gpu/host tiers, a producer thread with a pinned ring for the disk tier); `loader.jpeg` decodes
jpeg batches on a producer thread (GPU decoder + CPU worker processes) and resizes them in the
fused kernel. Either way the consumer's stream waits on each batch's event.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpufeed.augment.pipeline import Augment, triton_ahead, triton_ready_at
from gpufeed.decode.pool import shared
from gpufeed.decode.pool.segment import unavailable as workers_unavailable
from gpufeed.decode.scheduling.choice import check_decoders, load_ahead
from gpufeed.decode.tuning import Tuning
from gpufeed.loader.batch import Batch, Skipped
from gpufeed.loader.clips import Clip
from gpufeed.loader.feeds import HostGather, device_feed, host_feed
from gpufeed.loader.fields import FieldRequest, batch_dict
from gpufeed.loader.folder import index_cached
from gpufeed.loader.inputs import Input, open_input, reads_in_place
from gpufeed.loader.jpeg import PREFETCH, JpegPipelines, default_workers, jpeg_feed, jpeg_pipelines, takes_workers
from gpufeed.loader.planner import Planner
from gpufeed.loader.producer import CLOSE_WAIT, Carried, Production
from gpufeed.loader.sampler import (
    RAMP,
    RAMPS_BEFORE,
    Segment,
    ShardedBatchSampler,
    check_epoch,
    check_seed,
    resolve_rank,
)
from gpufeed.loader.settings import Decoding, Output, resolve_device
from gpufeed.loader.stats import Stats, stage_range
from gpufeed.logs import logger
from gpufeed.transfer.gather import Gatherer
from gpufeed.transfer.ring import PinnedRing

if TYPE_CHECKING:
    from gpufeed.loader.video import VideoClips
    from gpufeed.store.reader import Store
    from gpufeed.store.sharded import ShardedStore

log = logger(__name__)


# every Loader of this process that may have threads running: closed at the interpreter's exit, before
# it finalizes (see `producer.Producers`). Registered after torch's own exit hooks, so it runs before them
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for loader in list(_LIVE):
        if loader._pid == os.getpid():  # a forked child's copies are its parent's to stop
            loader.close()


def _shut_down(production, decoding, gather, source: Input, planner, tier, pid: int) -> None:
    """Stop a loader's threads and decode workers, in order, and return once they have ended: the
    producers first, each after the batch it makes (nothing uses the decoders they stop next), then
    the decoders (waiting for a batch a pipeline started ahead: its GPU decode may still read the
    store's page-locked bytes), the gather threads, the input (its byte source, a bucket's downloads)
    and the planner. `tier` (which
    keeps the store's bytes page-locked) is let go only after. A forked child's copy stops nothing."""
    if pid != os.getpid():
        return
    producers = production.producers
    producers.stop()
    production.drop_carried()
    finished = producers.join(CLOSE_WAIT)
    if decoding is not None:  # the JPEG pipelines, or a video store's decode threads
        decoding.close()
    if not finished and not producers.join(CLOSE_WAIT):
        log.warning("gpufeed.Loader.close: a producer thread did not end within %.0f s", 2 * CLOSE_WAIT)
    gather.close()
    source.close()
    planner.close()
    del tier


def _collected(*parts) -> None:
    """A loader collected without `close()`: its `_shut_down` on a thread of its own, which holds the
    parts (the tier too) until it ends. The collecting thread may be any thread, one the shutdown
    waits for included (fsspec's event loop, which a remote store's downloads wait on: shut down
    there, it waited for itself). Not a daemon: the interpreter's exit waits for it."""
    try:
        threading.Thread(target=_shut_down, args=parts, name="gpufeed-shutdown").start()
    except RuntimeError:  # the interpreter is finalizing: no new thread
        _shut_down(*parts)


def _start_ahead(device: str | torch.device, decoders: tuple[str, ...] | None, folder: bool) -> None:
    """Start, on threads of their own, what a GPU Loader's first batch would otherwise wait for: Triton's
    once-a-process work (`triton_ahead`) and, while a `folder` is indexed, loading the GPU decoders'
    library (`choice.load_ahead`). A device that can't be used is said by the constructor after the
    store's own errors."""
    try:
        resolved = resolve_device(device)
    except ValueError:
        return
    triton_ahead(resolved)
    if folder:
        load_ahead(resolved, decoders)


def _workers_ahead(store: str | os.PathLike, device: str | torch.device, decoders, num_workers, clip) -> None:
    """Start the CPU decode workers a Loader of a folder read in place takes (`shared.start_ahead`)
    before it lists the folder and reads its cached index, where it takes them (`jpeg.takes_workers`):
    not for a cold index (seconds of index processes: the workers' start would only compete with them,
    and might idle out first), nor where its arguments are refused (said by the constructor). A pool
    no loader takes ends after its idle time; one that can't start is left to the constructor, which
    says so and decodes on threads."""
    try:
        resolved = resolve_device(device)
        workers = _workers(num_workers, resolved)
        if decoders is not None:
            check_decoders(decoders)
    except (ValueError, TypeError):
        return
    if clip is not None or not index_cached(store) or workers_unavailable() is not None:
        return
    if takes_workers(workers, decoders, resolved.type == "cuda"):
        try:
            shared.start_ahead(workers)
        except (RuntimeError, OSError):
            pass  # (`DecodeWorkers` starts them again, and says why it can't)


# how a shuffled order is drawn, in a state's order key: one Philox stream per (seed, epoch)
# (`sampler.order_random`). States saved before it have none: their epochs' orders were drawn otherwise
ORDER_RANDOM = {"order_random": "philox(seed, epoch)"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _segments(value: object) -> tuple[Segment, ...]:
    """A state's "segments" as `Segment`s: a list of [world, batches] pairs of ints (their ranges are the
    sampler's to check, `ShardedBatchSampler._check_segment`); ValueError otherwise."""
    if isinstance(value, (list, tuple)) and all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_is_int(v) for v in pair) for pair in value
    ):
        return tuple(Segment(world, batches) for world, batches in value)
    raise ValueError(f"state_dict has segments={value!r}: not [[world, batches], ...] (ints)")


def _without(key: list, name: str) -> list:
    """An order key without its entry `name` (one an older gpufeed's state does not have)."""
    return [k for k in key if not (isinstance(k, dict) and name in k)]


def _ramped_before(key: list) -> list[list]:
    """An order key with each older gpufeed's "ramp" (`RAMPS_BEFORE`) in place of this one's."""
    return [[{"ramp": old} if isinstance(k, dict) and "ramp" in k else k for k in key] for old in RAMPS_BEFORE]


def _check_order(state: dict, mine: dict, segments: tuple[Segment, ...], ramped: bool, ended: bool = False) -> None:
    """Refuse `state` if its order key is not this loader's and the order it resumes in would differ.
    Keys of older gpufeeds are accepted where the order they resume in is the same: one saved before a
    store in a bucket had a shard-aware first epoch (no "first_window") at epoch 1 or later; one saved
    before a bucket's spans started on one shard (no "ramp"), or while they ended otherwise (an older
    "ramp"), in an epoch that is not `ramped` (a full shuffle); and at an epoch's start, where nothing
    of that epoch's order was consumed yet, or at its end (`ended`: every batch of it yielded), where
    nothing of it is left, those too and one saved before orders were drawn from a Philox stream (no
    `ORDER_RANDOM`)."""
    theirs, key = state.get("order", mine["order"]), mine["order"]
    if theirs == key:
        return
    epoch, start = state["epoch"], (state["batch"] == 0 and not segments) or ended
    older = [key, _without(key, "first_window")] if epoch >= 1 else [key]
    unramped = [_without(k, "ramp") for k in older] + [r for k in older for r in _ramped_before(k)]
    if theirs in older or (theirs in unramped and not ramped):
        return
    if theirs in unramped + [_without(k, "order_random") for k in older + unramped]:
        if start:
            return
        raise ValueError(
            f"state_dict was saved by an older gpufeed, whose order of an epoch was made otherwise: it resumes "
            f"only at an epoch's start or end, not at batch {state['batch']} of epoch {epoch} (set_epoch({epoch}) "
            f"starts that epoch again, set_epoch({epoch + 1}) the next)"
        )
    raise ValueError(f"state_dict has order={theirs}, this loader has {key}")


def _one_size(store) -> tuple[int, int] | None:
    """The (h, w) of every image of a jpeg store, if it is one for all: its batches then stack without
    an augment op that ends in a fixed size, as a raw store's do; else None."""
    shapes = np.asarray(store.shapes)
    if len(shapes) == 0 or not (shapes == shapes[0]).all():
        return None
    return int(shapes[0][0]), int(shapes[0][1])


def _workers(num_workers: int | None, device: torch.device) -> int:
    """The CPU decode worker processes asked for (None: `jpeg.default_workers`), checked."""
    workers = default_workers(device) if num_workers is None else num_workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"num_workers must be an int, 0 or more, got {workers!r}")
    return workers


def aspect_groups(sizes: tuple[int, int] | torch.Tensor, n: int, factor: bool | int) -> np.ndarray:
    """Each sample's aspect group for `Loader(group_by_aspect=factor)`: by width / height, at bounds
    2**linspace(-1, 1, 2k + 1) (True: k = 3, torchvision's reference default), or for k = 0 at 1."""
    k = 3 if factor is True else factor
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"group_by_aspect must be True, False or an int 0 or more, got {factor!r}")
    bounds = np.array([1.0]) if k == 0 else 2.0 ** np.linspace(-1, 1, 2 * k + 1)
    if isinstance(sizes, torch.Tensor):
        hw = sizes.numpy().astype(np.float64)
        return np.digitize(hw[:, 1] / hw[:, 0], bounds).astype(np.int64)
    return np.full(n, np.digitize(sizes[1] / sizes[0], bounds), np.int64)


def _default_augment(store, augment: Sequence | None, dtype: torch.dtype, group_by_aspect: bool | int):
    """(augment, dtype, one size) as the Loader uses them: a jpeg store of one image size (its (h, w),
    else None) needs no ops and then yields its images as stored, in uint8; a jpeg store of many sizes
    needs ops that end in one; `group_by_aspect` pads whatever the ops leave."""
    if group_by_aspect is not False and augment is None:
        augment = []  # padded to one shape per batch
    encoded = store.mode in ("jpeg", "video")
    one_size = _one_size(store) if encoded and group_by_aspect is False else None
    if encoded and not augment and group_by_aspect is False:
        if one_size is None:
            raise ValueError(
                f"{store.path}: a {store.mode} store holds {'images' if store.mode == 'jpeg' else 'frames'} of "
                "different sizes; give augment ops that end in a fixed size, e.g. [RandomResizedCrop(224), Normalize()]"
            )
        if augment is None:  # uint8 batches of the images as stored, as from a raw store
            augment, dtype = [], torch.uint8
    return augment, dtype, one_size


def _check_augment(augment: Augment, store, sizes: tuple[int, int] | torch.Tensor, size_divisible: int | None) -> None:
    """Refuse an op list that can't yield one batch shape from this store, when the Loader is built
    rather than at the first batch: drawn once on the store's extreme image sizes (smallest and largest
    side, widest and tallest); with `size_divisible`, as one padded batch. A batch op (MixUp, CutMix)
    needs the store's labels in its classes."""
    mixer, labels = augment.batch_op, store.labels
    if mixer is not None and len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= mixer.num_classes):
        raise ValueError(
            f"{store.path}: {type(mixer).__name__}(num_classes={mixer.num_classes}) needs "
            f"labels in 0..{mixer.num_classes - 1}; the store's are "
            f"{int(labels.min())}..{int(labels.max())} (-1: unlabelled)"
        )
    path = store.path
    height: int | torch.Tensor
    width: int | torch.Tensor
    if isinstance(sizes, torch.Tensor):
        if not len(sizes):
            return
        h, w = sizes[:, 0].double(), sizes[:, 1].double()
        picks = torch.stack([h.argmin(), h.argmax(), w.argmin(), w.argmax(), (w / h).argmin(), (w / h).argmax()])
        height, width = sizes[picks, 0].long(), sizes[picks, 1].long()
    else:
        height, width = sizes
    try:
        batches = None if size_divisible is None else [0, 6]
        augment.sample(6, height, width, torch.Generator().manual_seed(0), batches, size_divisible or 1)
    except ValueError as e:
        raise ValueError(f"{path}: augment ops {augment.ops!r}: {e}") from None


class Pass(Iterator[tuple[torch.Tensor, torch.Tensor] | dict]):
    """One pass over an epoch of a Loader: what `iter(loader)` returns, an iterator of its batches.

    A Loader makes one pass at a time: a pass takes its batches from the loader's producers and decoders
    and moves the loader's position (epoch, batch), and two at once shared them (two threads iterating
    one Loader got the same batches twice, then a KeyError). So a new `iter()` ends the pass before it,
    as a DataLoader's new iterator does, where no other live thread iterates that pass (it was this
    thread's, or its thread has ended): its producers stop, and a batch asked of it later raises
    RuntimeError saying why. Where another thread is iterating it, the new `iter()` raises RuntimeError
    instead: give each thread a Loader of its own. A pass left unfinished and dropped (a `break`) ends
    as it is collected, or with `close()`."""

    def __init__(self, batches: Generator[tuple[torch.Tensor, torch.Tensor] | dict, None, None]):
        self._batches = batches
        self._thread = threading.current_thread()  # the thread that last asked for a batch (or made it)
        self._ended: str | None = None  # why a newer pass ended this one
        self._asking = threading.Lock()  # held while a batch is asked for: threads sharing a pass take turns

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor] | dict:
        with self._asking:
            if self._ended is not None:
                raise RuntimeError(self._ended)
            self._thread = threading.current_thread()
            return next(self._batches)

    def close(self) -> None:
        """End the pass now (its producer threads stop), as a `break` out of a `for` loop over it does."""
        self._batches.close()

    def end_for_next(self) -> None:
        """End this pass for the one a new `iter()` of its loader begins (see the class); RuntimeError if
        another live thread is iterating it."""
        state = inspect.getgeneratorstate(self._batches)
        if state == inspect.GEN_CLOSED:  # finished: to its end, raised, or closed
            return
        thread, here = self._thread, threading.current_thread()
        busy = (thread is not here and thread.is_alive()) or not self._asking.acquire(blocking=False)
        if not busy:  # (a batch asked for now waits for the lock, then finds the pass ended)
            try:
                self._ended = (
                    "this pass over a gpufeed.Loader was ended by a newer iter(), set_epoch() or "
                    "load_state_dict() of the same Loader: a Loader makes one pass at a time (as a "
                    "DataLoader's new iterator ends the one before)"
                )
                self._batches.close()
            finally:
                self._asking.release()
        if busy:
            raise RuntimeError(
                f"this gpufeed.Loader is being iterated by thread {thread.name!r} (a pass not finished): a Loader "
                "makes one pass at a time, and two at once would share its batches; give each thread a Loader "
                "of its own, or finish or close() that pass first"
            )


class Loader:
    """Iterate `(images, labels)` batches of a gpufeed store on `device`, as a DataLoader would.

    Args:
        store: a `Store` or the path of one (raw or jpeg, sharded or not); the URL of a sharded store in
            a bucket (`s3://`, `gs://`, `az://`, `https://`, any fsspec URL), read through a local cache
            (`cache_dir`, `cache_limit`, `storage_options`); or, to read images in place without packing
            (an inference or evaluation pass), a folder (ImageFolder or flat), a CSV/JSONL list or
            uncompressed tar shards (see `loader.folder`).
        batch_size: samples per batch on this rank.
        device: where batches are made and returned ("cuda", "cuda:1", "cpu").
        shuffle: a seeded permutation per epoch (else store order); each batch's samples come in a
            seeded random order either way, as part of the plan.
        seed: seeds the permutation and every augment parameter; with (epoch, rank) it fixes a batch.
            An int in 0..2**64 - 1 (else ValueError, here). Epochs (`set_epoch`, `load_state_dict`)
            are ints in 0..2**64 - 1 too; every (seed, epoch) pair has an order of its own (a Philox
            stream keyed by both: `sampler.order_random`), none repeated by another pair.
        drop_last: drop the uneven tail of the epoch, and keep every batch full (an undecodable sample
            replaced, see `on_error`); else shards are padded by wrapping and the last batch may be
            short.
        augment: `gpufeed.augment` ops (geometric, then ColorJitter, then Normalize); None yields
            uint8. A jpeg store of images of different sizes needs ops that end in a fixed size.
            Checked here, not at iteration.
        dtype: output dtype when `augment` is given (uint8 otherwise).
        channels_last: return NHWC-strided batches.
        cache: raw stores: "gpu", "host", "disk" or "auto" (the first that fits in half of the free
            memory); jpeg stores keep their bytes in host memory ("gpu" is served as "host").
        rank, world_size: the shard to read; default from torch.distributed, else RANK/WORLD_SIZE.
        prefetch: batches made ahead of the consumer, at most (default 3; jpeg: 6, and also the next
            epoch's first ones, made as an epoch ends and dropped if another epoch is iterated).
        gather_threads: disk tier: CPU threads gathering rows (default min(8, cores)).
        on_error: jpeg: "skip" replaces an undecodable sample by another of its batch where batches are
            kept full (`drop_last=True`, shuffled or not; warned once, counted), and in an evaluation
            pass (`drop_last=False`) leaves it out of its batch, so each sample counts at most once,
            and names it in `loader.skipped` (`Skipped`: sample, source, reason); "raise" raises
            `DecodeError` naming it. Any store: a damaged text or JSON field value is None under "skip"
            (warned once) and raises `StoreError` under "raise".
        num_workers: jpeg: CPU decode worker processes (default with a GPU: this rank's cores but two,
            or but an eighth of them if more; on CPU all of them; 0 decodes on threads of this
            process). With a GPU they decode all they can, the GPU decoders what they can't.
        decoders: jpeg: names among "hw", "nvjpeg", "cuda", "cpu"; default one GPU decoder (the
            engines if nvImageCodec is installed, else nvJPEG) plus "cpu". video: ("nvdec", "cpu")
            also decodes part of each batch's clips on the GPU's video engines (TorchCodec's CUDA
            decoding, an optional install), the part following both sides' rates; default ("cpu",).
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
            "boxes_count" (N,), and "boxes_kept" (N, M), each box's index among the sample's stored
            boxes (-1 after the count): those under a pixel are dropped, and a sample's other
            per-instance values (COCO's "category", "iscrowd") are picked with it. "keypoints" too:
            (N, M, K, 3) x, y, visibility (0 once a point leaves the image) and "keypoints_count"
            (`augment.keypoints` says how they move). "masks" too, nearest (`augment.masks`): instance
            masks as an (N, M, H, W) uint8 tensor with "masks_count", dropped with their boxes as
            keypoints are, or label maps (N, H, W) of the stored dtype. Crowd instances (a store's
            JSON field "iscrowd" marks them 1, as a COCO file packs it) are left out of boxes,
            keypoints and masks, as torchvision's reference scripts and detectron2 leave them out of
            training targets.
        keep_crowd: with boxes, keypoints or masks: yield crowd instances too ("iscrowd", asked for
            as a field, says which they are), e.g. to treat them as regions to ignore.
        keypoint_flip: with "keypoints": the point each of an instance's K keypoints becomes when the
            image is mirrored (COCO's persons: [0, 2, 1, 4, 3, ...], left and right swapped); None:
            points keep their places.
        resolution: the output size by epoch (a callable: epoch -> an int side or (h, w); e.g.
            `gpufeed.augment.ResolutionRamp(160, 192, 30, 38)`, FFCV's progressive resizing): each
            epoch's augment chain makes that size (`Augment.at_size`: its last op that fixes the
            size makes it, earlier sizes scaled alike). A pure function of the epoch: a resumed job
            gets the same sizes.
        mask_fill: with "masks" that are label maps: the value where the image takes a fill
            (outside the stored image, a warp's corners): e.g. 255, an ignore index. Instance masks
            are 0 there.
        cache_dir, cache_limit, storage_options: a store in a bucket: the local folder its shards are
            cached in (default under ~/.cache/gpufeed/stores; the ranks of a machine may share one), the
            most bytes kept there (an int or "200GB"; None: no limit), and fsspec's options for the URL
            (credentials, endpoint). With a limit the epoch's order is shard-aware (`shuffle_window`);
            without one (or with one that holds the store) a jpeg store's first epoch is shard-aware
            too, over a quarter of its shards, so that it trains while they download; later epochs
            are full shuffles.
        shuffle_window: a sharded store: the shards taken in a seeded random order, each one's samples
            spread at random over the places of this many shards (None: a full shuffle; with a
            `cache_limit`, about as many as the cache holds for each of this machine's ranks, less
            three; a store in a bucket whose cache holds it: a quarter of its shards in epoch 0, then
            full shuffles). Part of the order: a resumed job keeps it.
        group_by_aspect: batches of images of one aspect ratio at native aspect ratio, for detection
            and segmentation as torchvision's reference scripts and detectron2 batch them: the ops may
            leave images of different sizes (e.g. `Resize(800, max_size=1333)` and a flip: crops,
            resizes, flips, colour and pixel ops), each batch's samples are of one aspect group where
            the epoch allows, and each batch is padded with zeros at the right and bottom to one
            shape, its largest image's rounded up to `size_divisible`. True: torchvision's eight
            groups (bounds at 2**linspace(-1, 1, 7) of width / height); an int k: 2k + 2 groups at
            2**linspace(-1, 1, 2k + 1), 0: wider than tall or not (detectron2's two). Fields batches
            also get "image_size" (N, 2): each image's (h, w) at the top left. Part of the order
            (`sampler`): deterministic and resumable as any other.
        size_divisible: with `group_by_aspect`, the multiple each batch's height and width are padded to.
        clip: a video store (`pack(..., mode="video")`): the clips each sample is (`gpufeed.Clip`: frames,
            stride or fps, one random clip a video each epoch or `clips_per_video` evenly spread, the
            batch's layout; default `Clip()`). Every frame of a clip gets the same augment draw, each
            clip its own; batches are (N, T, C, H, W) (or `layout="NCTHW"`), labels the videos'.
            `num_workers` is then the decode processes (default: this rank's cores; 0: threads);
            `fields` may ask for "label", "video" (each clip's video, its store index), "frames" ((N, T)
            indices of its frames in the video), "source" and the store's fields (a list's further
            columns: each clip's video's value).
        tuning: jpeg: the JPEG path's measured settings (`gpufeed.decode.tuning.Tuning`), for
            benchmarks that compare others; the default is what measurements chose.

    Raises:
        ValueError: bad arguments, an op list that can't give one batch shape, CUDA missing.
        StoreError: the store is missing, damaged or of a newer format.
    """

    def __init__(
        self,
        store: Store | ShardedStore | str | Path,
        batch_size: int = 256,
        device: str | torch.device = "cuda",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        augment: Sequence | None = None,
        dtype: torch.dtype = torch.float16,
        channels_last: bool = False,
        cache: str = "auto",
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int | None = None,
        gather_threads: int | None = None,
        on_error: str = "skip",
        num_workers: int | None = None,
        decoders: tuple[str, ...] | None = None,
        restart: bool = False,
        pad: bool = True,
        fields: Sequence[str] | None = None,
        tuning: Tuning | None = None,
        cache_dir: str | Path | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict | None = None,
        shuffle_window: int | None = None,
        keypoint_flip: Sequence[int] | None = None,
        mask_fill: int = 0,
        resolution: Callable[[int], int | tuple[int, int]] | None = None,
        group_by_aspect: bool | int = False,
        size_divisible: int = 32,
        keep_crowd: bool = False,
        clip: Clip | None = None,
    ):
        called = time.perf_counter()
        seed = check_seed(seed)  # before anything starts: a str or None seed used to fail at the first batch
        self.tuning = tuning or Tuning()
        in_place = reads_in_place(store)
        _start_ahead(device, decoders, self.tuning.open_ahead and in_place)
        if in_place and isinstance(store, (str, Path)):  # (its listing and index take a while: its workers start)
            _workers_ahead(store, device, decoders, num_workers, clip)
        self.input = open_input(store, cache_dir, cache_limit, storage_options)
        opened = time.perf_counter()  # (`stats()["start"]`: where a constructor's time goes)
        self.store = self.input.store
        if self.tuning.fetch_process:
            self.input.download_elsewhere()
        if self.tuning.lead_lands_first:
            self.input.lead_lands_first()
        self.fields = tuple(fields) if fields is not None else None
        self.clip: Clip | None = None  # the video path's modules load only for a video store (or to refuse clip=)
        if self.store.mode == "video" or clip is not None:
            from gpufeed.loader.video import check_video

            self.clip = check_video(self.store, clip, self.fields, augment, group_by_aspect, decoders, cache)
        video_fields = self.clip is not None and self.fields is not None
        flip = (
            None if video_fields else FieldRequest.check(self.fields, self.store, keypoint_flip, mask_fill, keep_crowd)
        )
        augment, dtype, one_size = _default_augment(self.store, augment, dtype, group_by_aspect)
        self.device = resolve_device(device)
        if self.tuning.open_ahead and not in_place and self.store.mode == "jpeg":
            # a store's GPU decoders open on a thread of their own once its pipelines are made; the
            # library they need starts loading now (a folder's started at the call, before its index)
            load_ahead(self.device, decoders)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        shape = self.store.image_shape or one_size  # a jpeg store of one size is planned as a raw store
        sizes = torch.from_numpy(np.array(self.store.shapes)) if shape is None else (shape[0], shape[1])
        per_video = self.clip.per_video if self.clip is not None else 1
        if isinstance(sizes, torch.Tensor) and per_video > 1:  # a sample is a clip: its video's size
            sizes = sizes.repeat_interleave(per_video, 0)
        shards = self.input.shards(shuffle_window, batch_size)
        self.batch_sampler = ShardedBatchSampler(
            len(self.store) * per_video,
            batch_size,
            shuffle=shuffle,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=drop_last,
            pad=pad,
            shards=shards,
            groups=None if group_by_aspect is False else aspect_groups(sizes, len(self.store), group_by_aspect),
        )
        # an evaluation pass: each sample at most once, an undecodable one left out and named in `skipped`.
        # drop_last=True promises full batches, shuffled or not: an undecodable sample is replaced there
        self.evaluation = not drop_last
        self.skipped: list[Skipped] = []
        self.augment = Augment(augment) if augment is not None else None
        self.size_divisible = None if group_by_aspect is False else size_divisible
        self._group_by_aspect = group_by_aspect
        if self.augment is not None:
            _check_augment(self.augment, self.store, sizes, self.size_divisible)
        self.output = Output(
            self.device, self.augment, dtype if self.augment is not None else torch.uint8, channels_last
        )
        prefetch = prefetch if prefetch is not None else PREFETCH if self.store.mode == "jpeg" else 3
        self.seed = seed
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        self.on_error = on_error
        self.tier = self.input.tier(self.device, cache)
        log.info("gpufeed.Loader: tier %s (%s)", self.tier.name, self.tier.reason)
        self.counters = Stats(self.tier.name, origin=called)
        self.counters.mark("store_opened", opened)
        self._production = Production(max(1, prefetch), self.counters)
        self.jpeg: JpegPipelines | None = None
        self.video: VideoClips | None = None
        if self.clip is not None:
            from gpufeed.loader.video import VideoClips, nvdec_side

            nvdec, why = nvdec_side(decoders, self.device, self.tuning.nvdec_threads)
            if why is not None:
                self.counters.note(why)
                if decoders is not None and "cpu" not in decoders:
                    raise ValueError(f"{self.store.path}: decoders={tuple(decoders)}: {why}")
                if self.device.type == "cuda":
                    log.warning("gpufeed: %s", why)
            self.video = VideoClips(
                self.store, self.clip, seed, self.device, num_workers, batch_size, self.tuning, nvdec
            )
            self.video.check_memory(self.prefetch)
        elif self.store.mode == "jpeg":
            images = self.input.byte_source(self.tier)
            decoding = Decoding(
                decoders,
                _workers(num_workers, self.device),
                on_error,
                batch_size,
                self.tuning,
                exact=self.evaluation,
                fields=self.fields is not None,
            )
            self.jpeg = jpeg_pipelines(images, self.output, decoding, self.counters)
            self.counters.mark("decoding_made")
        self._pid = os.getpid()
        self._closed = False
        _LIVE.add(self)
        self.gather = Gatherer(gather_threads or min(8, os.cpu_count() or 1))
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.epoch, self._batch = 0, 0
        self.restart, self._resuming = restart, False
        self._passing = threading.Lock()  # a new pass (`__iter__`) looks at the one before it and replaces it
        self._last_pass: weakref.ref[Pass] | None = None
        self._host: HostGather | None = None  # the disk tier's gather, its pinned ring made at the first pass
        if resolution is not None and self.augment is None:
            raise ValueError(f"{self.store.path}: resolution is a schedule for the augment ops' output size")
        self._planner = Planner(
            self.batch_sampler, self.augment, seed, sizes, resolution=resolution, size_divisible=self.size_divisible
        )
        try:
            self._planner.augment(0)  # the schedule's first size, checked (and the chain kept for epoch 0)
        except ValueError as e:
            raise ValueError(f"{self.store.path}: resolution: {e}") from None
        # what close() does, also when the loader is dropped without it (started as it is collected,
        # before its attributes go; it holds the parts, never the loader). At exit `_close_all` closes it
        self._shut_down = weakref.finalize(
            self,
            _collected,
            self._production,
            self.jpeg if self.jpeg is not None else self.video,
            self.gather,
            self.input,
            self._planner,
            self.tier,
            self._pid,
        )
        self._shut_down.atexit = False
        self._fields = (
            None
            if self.fields is None or video_fields
            else FieldRequest(self.fields, self.store, self.device, on_error, flip, mask_fill, keep_crowd)
        )
        # the first pass's plan, made while the decoders start (its order first where the input starts
        # work from it)
        self._planner.start(self.epoch, order_first=self.input.begins_early)
        self.counters.mark("constructor")

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
        self._closed = True
        finalizer = getattr(self, "_shut_down", None)  # (None: a constructor that raised before making it)
        parts = finalizer.detach() if finalizer is not None else None  # once: None after
        if parts is not None:
            _shut_down(*parts[2])  # here, and waited for
        _LIVE.discard(self)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _end_last_pass(self) -> None:
        """End the pass before (`Pass.end_for_next`): a new pass, or a new position, replaces it (call with
        `_passing` held)."""
        last = self._last_pass() if self._last_pass is not None else None
        if last is not None:
            last.end_for_next()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (an int in 0..2**64 - 1, else ValueError) from its first batch at the next iteration."""
        epoch = check_epoch(epoch)
        with self._passing:  # a pass still under way would move the position on after this
            self._end_last_pass()
            self.epoch, self._batch = epoch, 0
            self._resume(epoch, ())

    def state_dict(self) -> dict:
        """Where the job is, the same on every rank: the next iteration resumes right after the last
        batch yielded, at this world size or another (`load_state_dict`). "store" is the store's
        `digest`: a resume on another store (or this one packed again) is refused."""
        segments = self.batch_sampler.segments(self.epoch)
        return {
            "epoch": self.epoch,
            "batch": self._batch,
            "world_size": self.world_size,
            "segments": [[seg.world, seg.batches] for seg in segments],
            "seed": self.seed,
            "batch_size": self.batch_sampler.batch_size,
            "samples": len(self.store),
            "order": self._order_key(),
            "store": self.store.digest,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` (from any rank's `state_dict()`, at any world size) was: the next `iter()`
        yields what no rank had yielded of that epoch. At the same world size that is the same batches
        as before; at another, the rest of the epoch's global order cut into this world's spans (each
        remaining sample once with `pad=False`). Every field is checked before anything changes:
        ValueError naming the field if one is not what a Loader writes (a type, a range, segments no job
        could have left), or if the seed, batch size, store (its size, and its digest where the state
        has one: a state saved before gpufeed kept it is checked on the rest) or order settings differ
        (the order would not be the same)."""
        mine = self.state_dict()
        if not isinstance(state, dict) or any(
            key not in state for key in ("epoch", "batch", "world_size", "seed", "batch_size", "samples")
        ):
            raise ValueError(f"not a gpufeed.Loader state_dict (it needs the keys {sorted(mine)})")
        for key, least in (("epoch", 0), ("batch", 0), ("world_size", 1), ("batch_size", 1), ("samples", 0)):
            value = state[key]
            if not _is_int(value) or value < least:
                raise ValueError(f"state_dict has {key}={value!r}: not an int of {least} or more")
        check_epoch(state["epoch"], "state_dict's epoch")
        if not _is_int(state["seed"]):
            raise ValueError(f"state_dict has seed={state['seed']!r}: not an int")
        segments = _segments(state.get("segments", []))
        if "store" in state and not isinstance(state["store"], str):
            raise ValueError(f"state_dict has store={state['store']!r}: not a store's digest (a str)")
        for key in ("seed", "batch_size", "samples"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict has {key}={state[key]}, this loader has {mine[key]}")
        if state.get("store", mine["store"]) != mine["store"]:
            raise ValueError(
                f"state_dict is of the store whose digest is {state['store'][:16]}..., this loader's "
                f"({self.store.path}) is {mine['store'][:16]}...: another store, or this one packed again; "
                "its position would go on over other images (set_epoch starts an epoch of this one afresh)"
            )
        shards = self.batch_sampler.shards
        epoch, batch = state["epoch"], state["batch"]
        if state["world_size"] != self.world_size and batch:  # what every rank yielded there is an earlier part now
            segments, batch = (*segments, Segment(state["world_size"], batch)), 0
        try:
            length = self.batch_sampler.length(epoch, segments)
        except ValueError as e:
            raise ValueError(f"state_dict: {e}") from None
        ended = batch > 0 and batch == length  # (every batch of the epoch yielded: what is left is in no order)
        _check_order(state, mine, segments, shards is not None and shards.ramped(epoch), ended)
        if batch > length:
            raise ValueError(f"state_dict has batch={batch}, past the {length} batches of its epoch")
        with self._passing:  # a pass still under way would move the position on after this
            self._end_last_pass()
            self._resume(epoch, segments)
            self.epoch, self._batch = epoch, batch
            self._resuming = True

    def _resume(self, epoch: int, segments: tuple[Segment, ...]) -> None:
        """Plan `epoch` as what `segments` left of it; plans and batches made for it otherwise are dropped."""
        if self.batch_sampler.segments(epoch) != segments:
            self.batch_sampler.resume(epoch, segments)
            self._planner.forget(epoch)
            self._production.drop_carried()

    def _order_key(self) -> list:
        """The settings the global order depends on besides the seed: a state from another order is refused.
        A shuffled order says how it is drawn (`ORDER_RANDOM`): an older gpufeed's was drawn otherwise."""
        shards = self.batch_sampler.shards
        key: list = [
            self.batch_sampler.shuffle,
            self.batch_sampler.drop_last,
            self.batch_sampler.pad,
            None if shards is None else shards.window,
        ]
        if shards is not None and shards.first_window is not None:
            key.append({"first_window": shards.first_window})
        if shards is not None and shards.ramp:
            key.append({"ramp": RAMP})
        if self.batch_sampler.groups is not None:
            key.append({"group_by_aspect": self._group_by_aspect})
        if self.clip is not None:  # which clips the samples are, and how many a video gives
            c = self.clip
            key.append({"clip": [c.frames, c.stride, c.fps, c.clips_per_video]})
        return [*key, dict(ORDER_RANDOM)] if self.batch_sampler.shuffle else key  # (a copy: a state is the caller's)

    def stats(self) -> dict:
        """Per-stage times (among them the consumer's: "wait" for batches, and "consumer" between taking
        one and asking for the next), bytes moved, tier, consumer stalls, how the loader started ("start":
        seconds from the constructor's call to its store open, to a jpeg store's pipelines made and
        workers started, to its return, to the first batch handed over, on a GPU to
        the end of Triton's once-a-process work (negative: it ended before), and for jpeg
        stores to the GPU decoders taken into use and to each decode worker's `Ready`), and for jpeg
        stores the decoders, how many images each decoded (and CPU fallbacks, failures), their rates in img/s, and the
        decode seconds spent until the GPU decoders were done and on the CPU's share after that
        (with worker processes, also their wall and CPU seconds: CPU well below wall means starved);
        for video stores "video" (`VideoClips.stats`: decode processes or threads, the shared slots'
        bytes)."""
        out = self.counters.as_dict()
        started = self.jpeg.started() if self.jpeg is not None else {}
        if self.device.type == "cuda":
            started["triton_ready"] = triton_ready_at()
        out["start"] = self.counters.start(started)
        if self.jpeg is not None:
            out |= self.jpeg.stats()
        if self.video is not None:
            out["video"] = self.video.stats()
        return out

    def plan(self, epoch: int, number: int):
        """(sample indices in yield order, augment Params or None) of batch `number` of `epoch` on this rank."""
        return self._planner.peek(epoch).batch(number)

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

    def __iter__(self) -> Pass:
        """`(images, labels)` batches (labels: soft targets with MixUp/CutMix; a dict with `fields`)
        to the end of an epoch. Each `iter()` is a new pass, as with a DataLoader: after a pass left
        early (a `break`) the next epoch begins (with `restart=True`, the same epoch again from its
        first batch); after `load_state_dict` the pass resumes after the last batch yielded then; after
        `set_epoch(e)`, epoch e begins. One pass at a time (`Pass`): a new `iter()` ends the pass before
        it, and raises RuntimeError if another thread is iterating that one."""
        self._check_usable()
        with self._passing:
            self._end_last_pass()
            epoch, start = self.epoch, self._batch
            length = self.batch_sampler.length(epoch)
            if not self._resuming and 0 < start < length:  # the last pass was left early
                epoch, start = (epoch, 0) if self.restart else (epoch + 1, 0)
            self._resuming = False
            if start >= self.batch_sampler.length(epoch):
                epoch, start = epoch + 1, 0
            check_epoch(epoch, "the next epoch")  # (none after the last: 2**64 - 1)
            if self.restart and start == 0:
                self._resume(epoch, ())  # a fresh pass is the whole epoch
            self.epoch, self._batch = epoch, start
            made = Pass(self._pass(epoch, start))
            self._last_pass = weakref.ref(made)
        return made

    def _pass(self, epoch: int, start: int) -> Generator[tuple[torch.Tensor, torch.Tensor] | dict, None, None]:
        self.counters.mark("first_pass")  # its first batch asked for
        order = self._planner.early(epoch)  # (the first pass: its plan may still be being drawn)
        if order is not None:
            self.input.begin_early(order, epoch, start)  # a bucket's shards fetched ahead from now
        plan = self._planner.get(epoch)
        self.counters.mark("first_plan")  # in hand (planned on a thread since the constructor)
        self.input.begin(plan, epoch, start, self._planner)  # its checks; a bucket's shards fetched ahead
        carried = self._production.take_carried(epoch, start)
        next_plan = functools.partial(self._planner.peek, epoch + 1) if self.tuning.carry else None
        if self.jpeg is not None:
            batches = jpeg_feed(self.jpeg.pipelines, self._production, plan, start, epoch, next_plan, carried)
        elif self.video is not None:
            from gpufeed.loader.video import video_feed

            labels, stream = self.store.labels, self.copy_stream
            batches = video_feed(plan, start, epoch, self.video, labels, self._production, stream, next_plan, carried)
        elif self.tier.gathers_on_device:
            fused = self.augment is not None and self.tier.name in self.tuning.fused_gather
            # (a tier that gathers on the device: a CUDA device, which has a copy stream)
            batches = device_feed(plan, start, self.tier, self.copy_stream, self.prefetch, self.counters, fused)  # type: ignore[arg-type]
        else:
            batches = host_feed(plan, start, self._host_gather(), self._production)
        try:
            while True:
                self._check_usable()  # before waiting: no producer makes batches for a forked child
                batch = next(batches, None)
                if batch is None:
                    break
                self.skipped += batch.skipped
                if batch.skipped and not len(batch.labels):  # evaluation: none of its samples decoded
                    self._batch += 1
                    continue
                out = self._finish(batch)
                self._batch += 1
                yield out
        finally:
            batches.close()
        if self._batch >= len(plan):
            self.epoch, self._batch = epoch + 1, 0

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                "this gpufeed.Loader was made in another process (before a fork): its threads, "
                "decode workers and CUDA state stay there; make a new Loader in this process"
            )
        if self._closed:
            raise RuntimeError(
                "this gpufeed.Loader was closed: its threads and decode workers are stopped; make a "
                "new Loader (with `state_dict()`/`load_state_dict()` to go on where it was)"
            )

    def _finish(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | dict:
        t0 = time.perf_counter()
        with stage_range("gpufeed.augment", self.copy_stream is not None):
            out = self._augment(batch)
        self.counters.add("augment", time.perf_counter() - t0)
        self.counters.mark("first_batch")
        if self.video is not None and self.fields is not None:
            from gpufeed.loader.video import video_batch_dict

            return video_batch_dict(self.store, self.fields, *out, batch.clips)
        if self._fields is None:
            return out
        fields = self._fields
        if batch.shards is not None:  # read as the batch's images were
            fields = dataclasses.replace(fields, store=self.input.fields_store(batch.shards))
        return batch_dict(
            fields, *out, batch.samples, self.counters, functools.partial(self.plan, self.epoch, self._batch)
        )

    def _augment(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.final:
            images = batch.images
        elif self.augment is not None:
            # (a batch not final, with augment ops: its params were planned)
            params = batch.params
            if self.clip is not None:  # one draw per clip, the same for each of its frames
                params = params.take(torch.arange(len(batch.labels)).repeat_interleave(self.clip.frames))  # type: ignore[union-attr]
            images = self.augment.apply(batch.images, params, self.dtype, self.channels_last, batch.index)  # type: ignore[arg-type]
        else:
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            images = batch.images.permute(0, 3, 1, 2).contiguous(memory_format=fmt)
        if self.clip is not None:  # N * T frames, one clip's frames after another
            images = images.unflatten(0, (-1, self.clip.frames))
            if self.clip.layout == "NCTHW":
                images = images.transpose(1, 2).contiguous()
        self.counters.count(len(batch.labels))
        if self.augment is not None and self.augment.batch_op is not None:  # drawn from (seed, epoch, batch)
            mixed = ((self.seed * 1_000_003 + self.epoch) * 1_000_033 + self._batch) % (1 << 64)  # manual_seed's range
            g = torch.Generator().manual_seed(mixed)
            return self.augment.batch_op(images, batch.labels, g)
        return images, batch.labels
