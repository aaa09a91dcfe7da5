"""What decoders take (a batch's encoded images as byte ranges of one buffer) and return (the
decoded images addressed from one base).

Per-image bookkeeping is numpy arrays, not tensors: every small torch op lets go of the GIL and has
to win it back from the training thread and the loader's other threads, and numpy does the same work
in fewer, cheaper calls (docs/benchmarks.md, "The producer's cycle").
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over read-only memory (a store's memory map, a decoder's buffer); it must not be
    written to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


# a decoded image's element strides (c, y, x) with c = YCC420 say it is a JPEG's YCbCr 4:2:0 planes
# (Y, then Cb and Cr at half the size rounded up, each row after row), as the GPU's JPEG engines
# decode it without a colour conversion kernel per image; the resize kernel converts (`augment.fused`)
YCC420 = 0

# how far from a JPEG's last byte its end-of-image marker may sit for the GPU's decoders to take it
# (`Encoded.cut_short`); cameras pad a few bytes at most, and a file with more still decodes on the CPU
EOI_WINDOW = 4096
# why a GPU decoder left such an image to the CPU
CUT_SHORT = f"no JPEG end marker in its last {EOI_WINDOW} bytes (cut short?): left to the CPU"


class WorkersStopped(RuntimeError):
    """A CPU share's decode workers were stopped before they answered: the loader was closed, or
    the interpreter is exiting. Not a sample's fault, so never reported as an undecodable sample."""


@dataclass
class Encoded:
    """A batch's encoded images: image k is `data[begins[k]:ends[k]]` (`array` is `data` as numpy)."""

    data: torch.Tensor  # uint8, 1-D: the store's bytes where the tier keeps them (or a batch's, read)
    array: np.ndarray
    begins: np.ndarray  # int64 (N,)
    ends: np.ndarray
    file_index: np.ndarray | None = None  # read in place: the file each image was read from (int64, into
    file_begins: np.ndarray | None = None  # the folder's `files`), and where it starts in that file
    # images whose bytes are still in their files, read into `array` by `readable` (None: they are there)
    fill: Callable[[Encoded], None] | None = None
    # lets go of what reading the batch holds (a bucket's shards in its cache), once: `let_go`
    release: Callable[[bool], None] | None = None

    @classmethod
    def of(cls, data: torch.Tensor, offsets: np.ndarray, indices: np.ndarray) -> Encoded:
        """Images `indices` of a store whose image i is data[offsets[i]:offsets[i + 1]]."""
        return cls(data, data.numpy(), offsets[indices], offsets[indices + 1])

    @classmethod
    def joined(cls, blobs: list) -> Encoded:
        """Encoded images given one by one (bytes-like), back to back in one buffer."""
        arrays = [np.frombuffer(b, np.uint8) for b in blobs]
        lengths = np.array([len(a) for a in arrays], np.int64)
        data = np.concatenate(arrays) if arrays else np.zeros(0, np.uint8)
        ends = np.cumsum(lengths)
        return cls(torch.from_numpy(data), data, ends - lengths, ends)

    def __len__(self) -> int:
        return len(self.begins)

    def let_go(self, now: bool = True) -> None:
        """The batch is made (or dropped): what its read holds may go (`ShardBytes`: a bucket's shards
        become evictable as soon as no batch being made reads them), at once where `now`, else a few
        batches later (an error while it was made: its decode workers may still read its files). Its
        parts (`take`) hold nothing."""
        release, self.release = self.release, None
        if release is not None:
            release(now)

    @contextmanager
    def made(self) -> Iterator[None]:
        """The block makes or drops the batch: `let_go` after it, at once, or a few batches later where
        it raised (its decode workers may still read its files)."""
        try:
            yield
        except BaseException:
            self.let_go(now=False)
            raise
        self.let_go()

    def take(self, positions) -> Encoded:
        """The images at `positions` (anything numpy indexes with)."""
        pick = lambda a: None if a is None else a[positions]  # noqa: E731
        return Encoded(
            self.data,
            self.array,
            self.begins[positions],
            self.ends[positions],
            pick(self.file_index),
            pick(self.file_begins),
            self.fill,
        )

    def readable(self) -> Encoded:
        """These images with their bytes in `array`, read now where they are still in their files. A
        sharded store's batch is read so (`loader.bytes.ShardBytes`): the decode workers read their
        share from the shard files themselves, so the loader copies only what its own decoders take
        (the GPU decoders' share; CPU threads), not every image under the GIL beside the training loop.
        Every decoder in this process calls this before it reads bytes."""
        if self.fill is None:
            return self
        self.fill(self)
        return replace(self, fill=None, release=None)  # (the batch's own copy lets go: `let_go`)

    def _read(self) -> None:
        if self.fill is not None:
            raise RuntimeError("these images' bytes were not read: Encoded.readable() first")

    def cut_short(self) -> np.ndarray:
        """Per image, whether it lacks a JPEG end-of-image marker (FF D9) in its last `EOI_WINDOW`
        bytes: a file cut short, or one with much data after its end. The GPU's decoders fill a cut
        file's missing rows with gray and report success, where the CPU's (Pillow) refuses it, so such
        images go to the CPU: the same file gets the same verdict whichever decoder its batch share
        drew. (Entropy-coded data never holds FF D9: FF there is always followed by 00 or a restart
        marker.)"""
        self._read()
        a, cut = self.array, self.ends - self.begins < 4
        whole = np.flatnonzero(~cut)
        last = self.ends[whole] - 2
        cut[whole] = (a[last] != 0xFF) | (a[last + 1] != 0xD9)
        for k in whole[cut[whole]].tolist():  # bytes after the marker: rare
            b, e = int(self.begins[k]), int(self.ends[k])
            cut[k] = b"\xff\xd9" not in a[max(b, e - EOI_WINDOW) : e].tobytes()
        return cut

    def tensors(self) -> list[torch.Tensor]:
        self._read()
        return [self.data[a:b] for a, b in zip(self.begins.tolist(), self.ends.tolist())]

    def arrays(self) -> list[np.ndarray]:
        self._read()
        return [self.array[a:b] for a, b in zip(self.begins.tolist(), self.ends.tolist())]


@dataclass
class Decoded:
    """Decoded RGB uint8 images (CHW, HWC: any layout), in batch order except the ones that failed,
    addressed from one base: image i starts `offsets[i]` elements from `base` (possibly in another
    allocation, which `keep` holds alive) with element strides `strides[i]` = (c, y, x) (c = `YCC420`:
    YCbCr 4:2:0 planes instead)."""

    base: torch.Tensor  # uint8
    offsets: np.ndarray  # int64 (N,)
    sizes: np.ndarray  # int64 (N, 2): height, width as decoded
    strides: np.ndarray  # int64 (N, 3)
    keep: list = field(default_factory=list)  # the tensors the offsets point into
    failed: dict[int, str] = field(default_factory=dict)  # position in its list -> reason
    # called with an event recorded after the kernels that read `base`: hands its buffer back for reuse
    on_done: Callable[[torch.cuda.Event], None] | None = None
    # (N, 4) int64 y0 x0 y1 x1 per image: the region of the stored image that its pixels are; all -1
    # (or None for every image): the whole image, maybe DCT-reduced
    regions: np.ndarray | None = None
    cut: int = 0  # images decoded whole, then cut to the region asked (the region alone was refused)
    # a CPU decoder's: the seconds its threads or workers spent decoding these images, summed (its own
    # rate's measure, not what else it decoded meanwhile), and when the last of them finished
    busy: float = 0.0
    done_at: float = 0.0

    def kept(self, count: int) -> np.ndarray:
        """Positions (0..count-1) of the images that were decoded, in order."""
        return _kept(count, self.failed)

    def alone(self) -> np.ndarray:
        """Per image, whether its pixels are a region of the stored image (not the whole, maybe DCT-reduced)."""
        return np.zeros(len(self.sizes), bool) if self.regions is None else self.regions[:, 0] >= 0


def _kept(count: int, failed: dict[int, str]) -> np.ndarray:
    every = np.arange(count)
    return np.delete(every, list(failed)) if failed else every


def in_place(images: list[torch.Tensor], failed: dict[int, str], shapes: np.ndarray | None = None) -> Decoded:
    """Address CHW images where they are (no copy): offsets relative to the first image.

    `shapes` (N, 2): the sizes the store records for the images `images` came from (failed ones
    included). Where every image holds 3 x h x w elements and they are contiguous, as a decoder that
    allocates each image makes them, their layout follows from the shapes; that takes two C calls per
    image through `map` instead of a Python loop over their sizes and strides. Any other image
    (another size than the store records, a view) is read from the tensors themselves."""
    if not images:
        return Decoded(
            torch.empty(0, dtype=torch.uint8),
            np.zeros(0, np.int64),
            np.zeros((0, 2), np.int64),
            np.zeros((0, 3), np.int64),
            [],
            failed,
        )
    offsets = np.fromiter(map(torch.Tensor.data_ptr, images), np.int64, len(images))
    if shapes is not None:
        sizes = shapes[_kept(len(shapes), failed)]
        numels = np.fromiter(map(torch.Tensor.numel, images), np.int64, len(images))
        if (
            len(sizes) == len(images)
            and np.array_equal(numels, 3 * sizes[:, 0] * sizes[:, 1])
            and all(map(torch.Tensor.is_contiguous, images))
        ):
            sizes = sizes.astype(np.int64)
            strides = np.stack([sizes[:, 0] * sizes[:, 1], sizes[:, 1], np.ones_like(sizes[:, 1])], 1)
            return Decoded(images[0], offsets - offsets[0], sizes, strides, images, failed)
    sizes = np.array([t.shape[1:] for t in images], np.int64)
    strides = np.array([t.stride() for t in images], np.int64)
    return Decoded(images[0], offsets - offsets[0], sizes, strides, images, failed)


class PinnedStaging:
    """Pinned host buffers reused across batches, each free again once the kernels reading it ran.

    Pinning memory is slow (a system call that locks every page), so a fresh pinned buffer per batch
    would cost a good part of the batch's time. `alloc(nbytes)` makes another kind of buffer
    (anything with `numel()`). Safe to share between threads (the pipelines share the workers')."""

    def __init__(self, pin: bool = True, alloc: Callable[[int], Any] | None = None):
        self.pin = pin
        self._alloc = alloc or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))
        self._free: list = []
        self._busy: deque[tuple[torch.cuda.Event, Any]] = deque()
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        """A buffer of at least `nbytes` (the smallest free one that fits, else a new one)."""
        with self._lock:
            while self._busy and self._busy[0][0].query():
                self._free.append(self._busy.popleft()[1])
            fits = [k for k, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # by position: `list.remove` would compare tensors element-wise
                return self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
        return self._alloc(nbytes + nbytes // 4)  # headroom for the next sizes

    def give_back(self, buf, done: torch.cuda.Event | None) -> None:
        """`buf` may be reused once `done` (recorded after the last GPU work reading it) has completed;
        at once if `done` is None."""
        with self._lock:
            if done is None:
                self._free.append(buf)
            else:
                self._busy.append((done, buf))

    def drain(self) -> list:
        """Every buffer, once the GPU work reading it is done; the staging is empty after."""
        with self._lock:
            for done, buf in self._busy:
                done.synchronize()
                self._free.append(buf)
            self._busy.clear()
            buffers, self._free = self._free, []
        return buffers


def into_pixels(boxes: np.ndarray, shapes: np.ndarray, part: Decoded) -> np.ndarray:
    """Crop `boxes` (N, 4: x0 y0 x1 y1 of stored images of `shapes`) in `part`'s decoded pixels, which
    may be a region of the image or the whole image DCT-reduced."""
    spans = np.zeros((len(shapes), 4))
    spans[:, 2:] = shapes
    alone = part.alone()
    if alone.any():
        spans[alone] = part.regions[alone]  # type: ignore[index]  # some alone: regions given
    ratio = part.sizes / (spans[:, 2:] - spans[:, :2])  # decoded pixels per stored pixel: (y, x)
    return (boxes - spans[:, [1, 0, 1, 0]]) * ratio[:, [1, 0, 1, 0]]


def hwc_strides(sizes: np.ndarray) -> np.ndarray:
    """Element strides (c, y, x) of contiguous HWC RGB images of `sizes` (N, 2: height, width)."""
    w = sizes[:, 1].astype(np.int64)
    return np.stack([np.ones_like(w), 3 * w, np.full_like(w, 3)], 1)


def to_device(
    host: torch.Tensor, end: int, device: torch.device, staging: PinnedStaging, buf, pin: bool
) -> tuple[torch.Tensor, Callable | None]:
    """`host[:end]` (decoded pixels in `buf`, one of `staging`'s buffers) where kernels on `device` read
    them, and the `on_done` that hands `buf` back. On a GPU with `pin`, one asynchronous copy on the
    current stream from page-locked memory: the copy engine moves the pixels, so the kernels that read
    them never wait on PCIe while holding the GPU's cores. Otherwise a copy now, and `buf` is free at once."""
    if device.type == "cuda" and pin:
        out = torch.empty(end, dtype=torch.uint8, device=device)
        out.copy_(host[:end], non_blocking=True)
        return out, lambda done: staging.give_back(buf, done)
    out = host[:end].to(device, copy=True)
    staging.give_back(buf, None)
    return out, None


def packed(
    images: list[torch.Tensor],
    failed: dict[int, str],
    device: torch.device,
    staging: PinnedStaging,
    regions: np.ndarray | None = None,
    pin: bool = True,
) -> Decoded:
    """Put contiguous HWC host images (of `regions`, see `Decoded`) back to back in one of `staging`'s
    buffers, then where kernels on `device` read them (`to_device`)."""
    sizes = np.array([t.shape[:2] for t in images], np.int64).reshape(-1, 2)
    numels = sizes[:, 0] * sizes[:, 1] * 3
    offsets = np.cumsum(numels) - numels
    strides = hwc_strides(sizes)
    if not images:
        return Decoded(torch.empty(0, dtype=torch.uint8, device=device), offsets, sizes, strides, [], failed)
    total = int(numels.sum())
    buf = staging.take(total)
    torch.cat([t.reshape(-1) for t in images], out=buf[:total])
    base, on_done = to_device(buf, total, device, staging, buf, pin)
    return Decoded(base, offsets, sizes, strides, [], failed, on_done=on_done, regions=regions)


def nvimgcodec_install(cuda: str | None = None) -> str:
    """The command that installs nvImageCodec for CUDA `cuda` (default: the one this torch was built for)."""
    major = (cuda or torch.version.cuda or "13").split(".")[0]
    return f"pip install 'gpufeed[nvimgcodec-cu{major}]'"
