"""One jpeg batch, made on the loader's producer thread: decoded, cropped, resized, augmented.

The crops are planned from the stored sizes; the scheduler splits the batch between the GPU
decoders (each one batched call that releases the GIL) and the CPU decode worker processes
(`decode.pool.workers`, CUDA-free); one resize kernel, reading every decoder's part, writes the finished
batch on the pipeline's stream. The next batch's CPU share is handed to the workers before this batch's
GPU share is decoded, so the workers never wait for the producer thread; a folder read in place
reads the files of the batch after that meanwhile. Samples no decoder can read are replaced by
another sample of the same batch (`on_error="skip"`, counted, warned about once with the index) or
raise naming the index (`"raise"`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from gpufeed.augment.params import Params
from gpufeed.augment.pipeline import Augment, fused_kernels
from gpufeed.decode import Scheduler
from gpufeed.decode.base import Decoded, Encoded, into_pixels
from gpufeed.decode.scheduling.choice import decoder_room
from gpufeed.decode.scheduling.shares import Started
from gpufeed.decode.scheduling.steering import Pace
from gpufeed.loader.batch import Batch, Skipped
from gpufeed.loader.bytes import ByteSource
from gpufeed.loader.settings import Decoding, Output
from gpufeed.loader.stats import Reading, Stats, stage_range
from gpufeed.logs import logger
from gpufeed.transfer.ring import hand_over
from gpufeed.transfer.upload import upload

log = logger(__name__)


class DecodeError(RuntimeError):
    """A sample of a jpeg store could not be decoded (on_error="raise")."""


@dataclass
class ReadAhead:
    """The files of a pipeline's next batch, being read (a folder read in place)."""

    indices: np.ndarray
    result: Callable[[], Encoded]


@dataclass
class Upcoming:
    """A batch this pipeline makes later: its samples and augment parameters."""

    indices: torch.Tensor
    params: Params


class JpegBatcher:
    """Turns (indices, params) into a finished (images, labels) batch on the loader's device."""

    def __init__(
        self,
        images: ByteSource,
        output: Output,
        decoding: Decoding,
        counters: Stats,
        threads: int,
        cpu=None,
        gpu_turn: threading.Lock | None = None,
    ):
        """`images`: where the bytes come from; `threads`: CPU decode threads where `cpu` (the shared worker
        processes) is None; `gpu_turn`: a lock the pipelines' GPU decodes take turns with."""
        self.images, self.output, self.counters = images, output, counters
        self.on_error, self.exact, tuning = decoding.on_error, decoding.exact, decoding.tuning
        self._fields = decoding.fields
        device = output.device
        self._shapes = images.shapes.astype(np.int64)
        room = decoder_room(self._shapes, decoding.batch_size, tuning.prealloc) if output.cuda else None
        # on a GPU, whether Triton's kernels import is asked when a batch first needs to know (`fused`):
        # asked here, a fresh process's constructor waited 0.35-0.39 s for the import that
        # `triton_ahead`'s thread was making, while the workers and the engines started anyway
        self._fused: bool | None = None if output.cuda else False
        self.scheduler = Scheduler(
            device,
            threads,
            decoding.decoders,
            cpu,
            gpu_turn,
            room,
            tuning,
            decoding.host_threads,
            planar=functools.partial(_planar, tuning.planar),  # the resize kernel converts the engines' YCbCr planes
        )
        self.stream = torch.cuda.Stream(device, priority=tuning.priority) if output.cuda else None
        # the per-batch tables go up on a stream of their own: a copy from pageable memory first waits
        # for all the work queued on its stream, and on `stream` that is the batch's decodes and copies
        self._tables = torch.cuda.Stream(device) if output.cuda else None
        self._warned = threading.Event()
        self._labels = images.labels.numpy()
        self._inflight: deque = deque()  # (event, decoded buffers) until the kernels reading them ran
        self._reads: deque[ReadAhead] = deque()  # coming batches being read (a source that reads ahead)
        self._next: tuple[np.ndarray, Started] | None = None  # the next batch (its indices), started
        self._read: Reading | None = None  # the loader's counters when `make` was last called
        self._compiled = not tuning.compile_ahead  # the batch kernels compiled once, during a decode (where `fused`)
        log.debug("gpufeed.Loader: jpeg decoders %s", " + ".join(self.scheduler.names))

    @property
    def fused(self) -> bool:
        """Whether batches are finished by the Triton kernels (a GPU where they import) rather than by
        torch ops; the first ask imports them, or waits for `triton_ahead`'s thread doing so."""
        if self._fused is None:
            self._fused = fused_kernels(launch=False) is not None
        return self._fused

    def make(self, idx: torch.Tensor, params: Params, ahead: tuple[Upcoming, ...] = ()) -> Batch:
        """The finished batch, with the store index of each sample (a failed one's replacement's; in an
        evaluation pass failed ones are left out instead, and named in `skipped`). `ahead`: this
        pipeline's next batches: the first is started now (its CPU share decoded while this batch is
        finished), the files of the second (a folder read in place) read meanwhile."""
        pace, self._read = self.counters.since(self._read)
        with stage_range("gpufeed.decode+resize", self.stream is not None):
            return self._make(idx, params, ahead, pace)

    def _make(
        self,
        idx: torch.Tensor,
        params: Params,
        ahead: tuple[Upcoming, ...] = (),
        pace: Pace | None = None,
        replacing: bool = False,
    ) -> Batch:
        """Host-side bookkeeping is numpy: see `gpufeed.decode.base` for why. `replacing`: this batch stands
        in for one none of whose samples decoded; if none of its own does either, DecodeError (the caller
        tries the next samples), never another replacement within it."""
        i = idx.numpy()
        started = self._started(i, params)
        with started.batch.made():  # (then a bucket's shards it alone reads may be evicted)
            self._start_ahead(ahead, pace)
            if not self._compiled and self.fused:
                self._compile(len(i), params)
            t1 = time.perf_counter()
            parts, failed = self.scheduler.finish(started, pin=self.fused)
            t2 = time.perf_counter()
            self.counters.add("decode", t2 - t1)
            self.counters.mark("first_decoded")  # (stats()["start"]: where a first batch's time went)
            if failed:
                instead = self._instead(idx, failed, params, replacing)
                if instead is not None:
                    return instead
            samples, labels, copies = self._stand_ins(i, failed)
            images, targets = self._resized(parts, started, labels, params, len(i))
            self.counters.add("resize", time.perf_counter() - t2)
            return self._batch(i, images, targets, samples, failed, copies)

    def _start_ahead(self, ahead: tuple[Upcoming, ...], pace: Pace | None) -> None:
        """Start decoding the next batch (`ahead[0]`), and reading the one after it where the bytes are
        read ahead (`ahead[1]`): both while this batch finishes, only where their bytes are there to
        read (`ByteSource.ready`): a batch whose shards are still downloading is started when it is
        made, so this batch does not wait for them; and the one after it is then not read ahead either
        (the next batch's read would find it first and read it again: a bucket's fetch ahead counted
        its samples twice)."""
        if ahead:
            following = ahead[0].indices.numpy()
            self._forget_next()
            if not self.images.ready(following):
                return
            self._next = following, self._start(following, ahead[0].params, pace)
        if self.images.reads_ahead and len(ahead) > 1 and self.images.ready(ahead[1].indices.numpy()):
            later = ahead[1].indices.numpy()
            first = self._read_first(later, ahead[1].params)
            self._reads.append(ReadAhead(later, self.images.read_later(later, first)))

    def _instead(self, idx: torch.Tensor, failed: dict[int, str], params: Params, replacing: bool) -> Batch | None:
        """The batch made instead of this one, whose samples `failed` did not decode, or None where it
        goes on: each failure is told (`_failed`, which raises under on_error="raise"); where none
        decoded, an evaluation's batch is empty, and a training batch is made of the next samples
        (`_replaced`; a replacement whose samples all fail raises DecodeError)."""
        if self.exact:
            self._failed(idx, failed)
            return self._empty(idx.numpy(), failed, params) if len(failed) == len(idx) else None
        if len(failed) == len(idx) and self.on_error == "skip":
            if replacing:
                raise DecodeError(f"none of samples {idx.numpy().tolist()} decodes")
            self._failed(idx, failed)
            return self._replaced(idx, params)
        self._failed(idx, failed)
        return None

    def _stand_ins(self, i: np.ndarray, failed: dict[int, str]) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """The batch's samples and labels with each failed position standing in for the next good one
        (`copies`: failed position -> the good one it copies), so that a training batch stays full."""
        samples, labels = i.copy(), self._labels[i]
        good = [p for p in range(len(i)) if p not in failed]
        copies = {p: next((g for g in good if g > p), good[0]) for p in failed}
        if copies:
            labels[list(copies)] = labels[list(copies.values())]
            samples[list(copies)] = samples[list(copies.values())]
        return samples, labels, copies

    def _resized(self, parts, started, labels: np.ndarray, params: Params, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded `parts` cropped and resized into the batch (the fused kernel on a GPU, roi_align on
        a CPU), with its labels on the batch's device."""
        shapes, boxes = started.shapes, started.boxes
        for part, positions in parts:  # boxes into each image's decoded pixels (a region, maybe DCT-reduced)
            boxes[positions] = into_pixels(boxes[positions], shapes[positions], part)
        if self.fused:
            return self._gpu(parts, boxes, labels, params)
        return self._cpu(parts, boxes, params, n), torch.from_numpy(labels)

    def _batch(
        self,
        i: np.ndarray,
        images: torch.Tensor,
        labels: torch.Tensor,
        samples: np.ndarray,
        failed: dict[int, str],
        copies: dict[int, int],
    ) -> Batch:
        """The finished batch: in an evaluation without the samples that `failed` (each at most once),
        else full, a failed position's image a copy of the one it stands in for."""
        if failed and self.exact:
            good = [p for p in range(len(i)) if p not in failed]
            kept = upload(torch.tensor(good), images.device)
            return Batch(
                images.index_select(0, kept),
                labels.index_select(0, kept.to(labels.device)),
                None,
                final=True,
                samples=i[good],
                skipped=self._skipped(i, failed),
                shards=self.images.opened(i[good]) if self._fields else None,
            )
        for p, src in copies.items():
            images[p] = images[src]
        shards = self.images.opened(samples) if self._fields else None  # (each shard looked at: only for fields)
        return Batch(images, labels, None, final=True, samples=samples, shards=shards)

    def _skipped(self, i: np.ndarray, failed: dict[int, str]) -> tuple[Skipped, ...]:
        return tuple(Skipped(int(i[p]), _source(self.images, int(i[p])), failed[p]) for p in sorted(failed))

    def _empty(self, i: np.ndarray, failed: dict[int, str], params: Params) -> Batch:
        """An evaluation batch none of whose samples decoded: no images, all of them reported."""
        dev = self.output.device
        images = torch.empty((0, 3, *params.out_hw), dtype=self.output.dtype, device=dev)
        labels = torch.empty(0, dtype=torch.int64, device=dev if self.fused else "cpu")
        return Batch(images, labels, None, final=True, samples=i[:0], skipped=self._skipped(i, failed))

    def _started(self, i: np.ndarray, params: Params) -> Started:
        """Batch `i`, started: by the call that made the batch before it, or now."""
        if self._next is not None:
            indices, started = self._next
            if np.array_equal(indices, i) and np.array_equal(started.boxes, params.boxes.numpy()):
                self._next = None
                return started
        return self._start(i, params)

    def _start(self, i: np.ndarray, params: Params, pace: Pace | None = None) -> Started:
        """Read batch `i`'s bytes and hand the scheduler the batch (its CPU share starts decoding)."""
        t0 = time.perf_counter()
        batch = self._encoded(i, params)
        self.counters.add("read", time.perf_counter() - t0, int((batch.ends - batch.begins).sum()))
        self.counters.mark("first_read")  # its bytes in hand (a bucket's: its shards downloaded)
        try:
            return self.scheduler.start(batch, self._shapes[i], params.boxes.numpy().copy(), params.out_hw, pace)
        except BaseException:
            batch.let_go(now=False)  # (part of it may be with the workers)
            raise

    def _forget_next(self) -> None:
        """Drop a started batch nobody asked for (an epoch left early, a batch made again)."""
        if self._next is not None:
            started, self._next = self._next[1], None
            with started.batch.made():
                self.scheduler.drop(started)

    def _encoded(self, i: np.ndarray, params: Params) -> Encoded:
        while self._reads:
            ahead = self._reads.popleft()
            read = ahead.result()  # waited for even if unused: no reads left running behind the loader
            if np.array_equal(ahead.indices, i):
                return read
            read.let_go()
        return self.images.read_later(i, self._read_first(i, params))()

    def _read_first(self, i: np.ndarray, params: Params) -> np.ndarray | None:
        """The positions of batch `i` whose bytes this process reads first (`Scheduler.read_first`); None
        (not worked out) for a source that reads whole batches or none."""
        if not self.images.reads_in_part:
            return None
        return self.scheduler.read_first(self._shapes[i], params.boxes.numpy())

    def _replaced(self, idx: torch.Tensor, params: Params, tries: int = 8) -> Batch:
        """A batch none of whose samples decoded (`on_error="skip"`): made of the samples that follow
        them in the store instead, each with its own label and the same crop relative to its size,
        trying up to `tries` steps further. Deterministic, so a resumed run makes the same batch."""
        n, shapes = len(self.images), torch.from_numpy(self._shapes)
        for step in range(1, tries + 1):
            other = (idx + step) % n
            scale = (shapes[other] / shapes[idx]).flip(1).repeat(1, 2).to(params.boxes.dtype)  # (w, h, w, h)
            moved = replace(params, boxes=params.boxes * scale)
            try:
                return self._make(other, moved, replacing=True)
            except DecodeError:  # those failed too: one step further
                continue
        raise DecodeError(
            f"{self.images.path}: samples {idx.tolist()} and the {tries} after each cannot be "
            "decoded: the store looks damaged (gpufeed verify names the files)"
        )

    def _failed(self, idx: torch.Tensor, failed: dict[int, str]) -> None:
        first = min(failed)
        where = f"{self.images.path}: sample {int(idx[first])}"
        why = f"{failed[first]}{_from(self.images, int(idx[first]))}"
        if self.on_error == "raise":
            raise DecodeError(f"{where} cannot be decoded ({why})")
        done = "left out (evaluation: loader.skipped names them)" if self.exact else "replaced"
        self.counters.note(f"{len(failed)} undecodable sample(s) {done}, e.g. {where} ({why})")
        if not self._warned.is_set():
            self._warned.set()
            log.warning(
                "%s cannot be decoded (%s); %s (further ones are counted in loader.stats())",
                where,
                why,
                "left out of its batch: an evaluation pass counts each sample at most once "
                "(loader.skipped names every one)"
                if self.exact
                else "replaced by another sample (of its batch, or the ones after it if the whole batch failed)",
            )

    def _gpu(self, parts, boxes: np.ndarray, labels: np.ndarray, params: Params) -> tuple[torch.Tensor, torch.Tensor]:
        """One resize kernel for the whole batch, whichever decoder made each image (the kernel reads
        each at its offset from the first part's buffer, into another buffer as well); the per-image
        table, the boxes, the flips and the labels go to the device in two copies (plus the augment
        parameters), on their own stream."""
        out = self.output
        aug: Augment = self.output.augment  # type: ignore[assignment]  # a jpeg store's Loader has augment ops
        dev = out.device
        out_dtype, out_last, scale, shift = aug.kernel_output(params, out.dtype, out.channels_last, dev)
        fmt = torch.channels_last if out_last else torch.contiguous_format
        batch = torch.empty((len(boxes), 3, *params.out_hw), dtype=out_dtype, device=dev, memory_format=fmt)
        parts = [(part, positions) for part, positions in parts if len(positions)]
        src = parts[0][0].base if parts else None  # every image's offset is from here, into its own part's buffer
        src_ptr = src.data_ptr() if src is not None else 0
        flat = [
            _joined([part.offsets + (part.base.data_ptr() - src_ptr) for part, _ in parts]),
            _joined([part.sizes.ravel() for part, _ in parts]),
            _joined([part.strides.ravel() for part, _ in parts]),
            _joined([positions for _, positions in parts]),
            labels,
        ]
        table, at = _table(flat)
        floats = np.concatenate([boxes.ravel(), params.flip.numpy()]).astype(np.float32)
        t0 = time.perf_counter()
        with torch.cuda.stream(self._tables):
            table_d = torch.from_numpy(table).to(dev, non_blocking=True)
            floats_d = torch.from_numpy(floats).to(dev, non_blocking=True)
            on_device = params.to(dev, non_blocking=True, boxes=False)  # the boxes and flips went in `floats`
            copied = self._tables.record_event()  # type: ignore[union-attr]  # a GPU's: _gpu runs on one
        hand_over(copied, table_d, floats_d, *(t for t in on_device.tensors() if t.is_cuda))
        self.counters.add("resize.copies", time.perf_counter() - t0)  # a part of "resize"
        boxes_d, flip_d = floats_d[: boxes.size], floats_d[boxes.size :]
        views = [table_d[a : a + len(c)] for c, a in zip(flat, at)]
        if parts:
            fused_kernels().resample_packed(src, *views[:4], boxes_d, flip_d, batch, scale, shift)
        done = torch.cuda.current_stream(dev).record_event()
        self._inflight.append((done, [part.keep for part, _ in parts]))
        for part, _ in parts:
            if part.on_done is not None:
                part.on_done(done)
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()
        labels_d = views[-1]
        return aug.complete(batch, on_device, out.dtype, out.channels_last), labels_d

    def _compile(self, n: int, params: Params) -> None:
        """Run the batch's kernels once on a one-pixel stand-in while the first batch decodes: Triton
        compiles a kernel the first time a machine runs it (seconds), which would otherwise come after
        that decode, on the first batch's time (docs/benchmarks.md, "Start-up and GPU memory"). The
        output is dropped."""
        self._compiled = True
        stand_in = Decoded(
            torch.zeros(3, dtype=torch.uint8, device=self.output.device),
            np.zeros(1, np.int64),
            np.ones((1, 2), np.int64),
            np.ones((1, 3), np.int64),
        )
        self._gpu([(stand_in, np.zeros(1, np.int64))], params.boxes.numpy().copy(), np.zeros(n, np.int64), params)

    def _cpu(self, parts, boxes: np.ndarray, params: Params, n: int) -> torch.Tensor:
        """CPU device: edge-pad the decoded images to one size, then the roi_align path (same math)."""
        images: list = [None] * n
        for part, positions in parts:
            for k, p in enumerate(positions.tolist()):
                (h, w), (sc, sy, sx) = part.sizes[k].tolist(), part.strides[k].tolist()
                chw = part.base.as_strided((3, h, w), (sc, sy, sx), int(part.offsets[k]))
                images[p] = chw.permute(1, 2, 0)
        filler = next(im for im in images if im is not None)
        images = [filler if im is None else im for im in images]
        top_h, top_w = max(im.shape[0] for im in images), max(im.shape[1] for im in images)
        batch = torch.from_numpy(
            np.stack(
                [
                    np.pad(im.numpy(), ((0, top_h - im.shape[0]), (0, top_w - im.shape[1]), (0, 0)), mode="edge")
                    for im in images
                ]
            )
        )
        padded = replace(params, boxes=torch.from_numpy(boxes), identity=False)
        augment = self.output.augment  # a jpeg store's Loader has augment ops
        return augment.apply(batch, padded, self.output.dtype, self.output.channels_last)  # type: ignore[union-attr]

    def close(self) -> None:
        """Stop this pipeline's decoders (the shared CPU workers are `JpegPipelines`' to stop)."""
        self._forget_next()  # its CPU share collected while the workers run: its buffer goes back to them
        self.scheduler.close()


def _joined(columns: list[np.ndarray]) -> np.ndarray:
    """The parts' columns one after another (int64; empty without parts)."""
    return np.concatenate(columns).astype(np.int64, copy=False) if columns else np.zeros(0, np.int64)


def _table(columns: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """int64 columns back to back in one array, each starting on 16 bytes (Triton specializes a
    kernel on its pointers' alignment: unaligned views would compile more variants), and where each
    starts."""
    at = [0]
    for c in columns:
        at.append(at[-1] + len(c) + len(c) % 2)
    table = np.zeros(at[-1], np.int64)
    for c, a in zip(columns, at):
        table[a : a + len(c)] = c
    return table, at[:-1]


def _source(images: ByteSource, i: int) -> str:
    """Where sample `i` came from, or "" where the source doesn't know (a store packed by gpufeed 0.1)."""
    try:
        return images.source(i)
    except Exception:  # noqa: BLE001  only the report loses it
        return ""


def _from(images: ByteSource, i: int) -> str:
    """The suffix "; <its source>" where the source knows it."""
    where = _source(images, i)
    return f"; {where}" if where else ""


def _planar(wanted: bool) -> bool:
    """Whether the engines give the resize kernel YCbCr planes (`Tuning.planar`): only where it imports."""
    return wanted and fused_kernels(launch=False) is not None
