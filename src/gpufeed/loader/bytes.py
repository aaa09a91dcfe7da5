"""Where a jpeg Loader's encoded bytes come from: the seam between the JPEG pipeline and storage.

The pipeline (`jpeg_batch.JpegBatcher`) and its CPU decode workers ask a `ByteSource` for each
batch's bytes and never look at what is behind it. Three sources exist:

- `PackedBytes`: a packed jpeg store, whose `data.bin` is memory-mapped (and page-locked on a GPU,
  the host tier): a batch is a view, nothing is read; the workers map the same file.
- `loader.folder.FolderStore`: JPEGs read where they are (a folder, a list, tar shards): what the
  loader's own decoders take of each batch is read from its files on threads, a batch ahead
  (`Scheduler.read_first`); the workers read their share themselves.
- `ShardBytes`: a sharded store's (on this disk, or a remote store's shards in its local cache):
  each batch copied from its shards' memory maps, a batch ahead; the workers read the shard files.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from gpufeed.decode.base import Encoded
from gpufeed.store import format as fmt


@dataclass(frozen=True)
class WorkerView:
    """What decode worker processes read images from: the store's file (`data`, a memory map they map
    too), or a table of files that each board row names by number (`files`)."""

    data: np.memmap | None = None
    files: list[str] | None = None


class ByteSource(Protocol):
    """A jpeg Loader's images: their stored sizes and labels, where each came from, and their bytes."""

    path: Path
    shapes: np.ndarray  # (N, 2) height, width as stored (the crops are planned from them)
    reads_ahead: bool  # reading a batch takes time worth starting a batch early (files); False: a view
    reads_in_part: bool  # `read_later` reads only its `first` positions ahead; False: it ignores them

    @property
    def labels(self) -> torch.Tensor: ...

    def __len__(self) -> int: ...

    def source(self, i: int) -> str:
        """Where sample `i` came from (a file, `shard.tar:key`)."""

    def read_later(self, indices: np.ndarray, first: np.ndarray | None = None) -> Callable[[], Encoded]:
        """Start getting the bytes of images `indices`; the returned call waits for them. An image that
        can't be read is left empty (its decoder fails it, and the Loader says so). `first`: the
        positions this process's decoders will likely take (`Scheduler.read_first`), worth reading
        ahead; a source may read only those now and the rest when asked (`Encoded.readable`)."""

    def for_workers(self) -> WorkerView:
        """What the CPU decode worker processes read from."""

    def ready(self, indices: np.ndarray) -> bool:
        """Whether the bytes of images `indices` can be read now without waiting for a download (a
        batch is started ahead only then: `JpegBatcher._start_ahead`)."""

    def opened(self, indices: np.ndarray) -> dict[int, Any] | None:
        """The shards of a sharded store that images `indices` (just read) are in, as opened (number ->
        shard), for their fields (`Batch.shards`); None for any other source."""


class OfAStore:
    """A store's labels, length and sources, for the byte sources of a packed or sharded store (`store`)."""

    store: Any

    @property
    def labels(self) -> torch.Tensor:
        return self.store.labels

    def __len__(self) -> int:
        return len(self.store)

    def source(self, i: int) -> str:
        return self.store.source(i)

    def opened(self, indices: np.ndarray) -> dict[int, Any] | None:
        return None

    def ready(self, indices: np.ndarray) -> bool:
        return True


class PackedBytes(OfAStore):
    """A packed jpeg store's bytes, as the tier keeps them (`data`: the memory map, page-locked or not)."""

    reads_ahead = False
    reads_in_part = False

    def __init__(self, store, data: torch.Tensor):
        self.store, self._data = store, data
        self.path = store.path
        self.shapes = np.asarray(store.shapes).view(np.ndarray)
        self._offsets = np.asarray(store.offsets).view(np.ndarray)

    def read_later(self, indices: np.ndarray, first: np.ndarray | None = None) -> Callable[[], Encoded]:
        batch = Encoded.of(self._data, self._offsets, indices)
        return lambda: batch

    def for_workers(self) -> WorkerView:
        return WorkerView(data=self.store.data)


class ShardBytes(OfAStore):
    """A sharded jpeg store's bytes (on this disk, or in a remote store's cache). The decode workers read
    their share of a batch from the shard files themselves; the images the loader's own decoders take
    (the GPU decoders' share, CPU threads) are copied from the shards' memory maps into the batch's
    buffer when they ask (`Encoded.readable`). Copying every image there, as before, held the GIL for
    about a millisecond a batch beside the training loop (a sharded store trained 4-16 points below the
    same photos packed whole, H100). A remote store's shards are downloaded when a batch is read ahead
    (if the fetch-ahead has not), and held in its cache until no batch being made reads them (the
    batch's `Encoded.let_go`; after an error in its making, `HELD_FOR` reads more)."""

    reads_ahead = True
    reads_in_part = False  # (its decoders copy what they take from the maps as they ask)
    # reads (batches) a shard stays held after its last use where its batches are made but not said to
    # be (an error while one was made: its decode workers may read on): a pipeline reads batch k + 2
    # while it makes batch k, and 4 covers those in flight. Made batches let go at once (`let_go`):
    # held `HELD_FOR` reads after their last use, a cache of 9 shards for batches of about a shard
    # each held 6 of them, and fetched ahead 2 at once for stretches of an epoch
    # (docs/benchmarks.md, "Training from a bucket")
    HELD_FOR = 4
    # reads after which a batch never said to be made no longer holds its shards (a count left by an
    # error between its read and its start): not one being made, whatever the pipelines and retries
    FORGOTTEN = 64

    def __init__(self, store, on_read: Callable[[list[int], list[int]], None] | None = None):
        """`on_read(shards, counts)`: told of each batch's reads (a bucket's fetch ahead, `ReadAhead.read`)."""
        self.store, self.path = store, store.path
        self.shapes = np.asarray(store.shapes).view(np.ndarray)
        self._cache = getattr(store, "cache", None)  # a remote store's ShardCache
        self._on_read = on_read
        self._held: dict[int, int] = {}  # shard -> the read that last used it
        self._making: dict[int, int] = {}  # shard -> batches read from it and not yet made (or dropped)
        self._reads = 0
        self._lock = threading.Lock()

    def files(self) -> list[str]:
        """Every shard's data file, by shard number (where it is, or will be, on this disk)."""
        return [str(self.store.shard_path(k) / fmt.JPEG_DATA) for k in range(len(self.store.starts) - 1)]

    def for_workers(self) -> WorkerView:
        return WorkerView(files=self.files())

    def read_later(self, indices: np.ndarray, first: np.ndarray | None = None) -> Callable[[], Encoded]:
        shards, local = self.store.locate(indices)
        used, inverse, counts = np.unique(shards, return_inverse=True, return_counts=True)
        release = self._use(used.tolist(), counts.tolist())
        try:
            maps = [self.store.shard(k) for k in used.tolist()]
        except BaseException:
            if release is not None:
                release(True)  # (nothing reads them: not read)
            raise
        begins_in_file, sizes = np.empty(len(indices), np.int64), np.empty(len(indices), np.int64)
        for u, shard in enumerate(maps):  # (plain arrays: a memory map's slices cost a Python object each)
            at = np.flatnonzero(inverse == u)
            offsets = shard.offsets.view(np.ndarray)
            begins_in_file[at] = offsets[local[at]]
            sizes[at] = offsets[local[at] + 1] - begins_in_file[at]
        ends = np.cumsum(sizes)
        begins = ends - sizes
        buffer = np.empty(int(ends[-1]) if len(ends) else 0, np.uint8)
        datas = {k: shard.data.view(np.ndarray) for k, shard in zip(used.tolist(), maps)}

        def fill(part: Encoded) -> None:  # images of this batch (`part`), into its buffer
            files, starts = part.file_index, part.file_begins
            if files is None or starts is None:
                raise ValueError(f"{self.path}: a batch's images must say their shards to be read")
            for b, e, k, at in zip(part.begins.tolist(), part.ends.tolist(), files.tolist(), starts.tolist()):
                buffer[b:e] = datas[k][at : at + e - b]

        encoded = Encoded(
            torch.from_numpy(buffer), buffer, begins, ends, shards.astype(np.int64), begins_in_file, fill, release
        )
        return lambda: encoded

    def ready(self, indices: np.ndarray) -> bool:
        """Whether every shard of images `indices` is on this disk: held, or in a remote store's cache.
        Reading a batch whose shards are still downloading waits for them, and a batch started ahead
        so made the one before it wait: a cold bucket's first batch came 0.83 s after its bytes were in
        hand, the next two batches' shards downloading (docs/benchmarks.md, "Training from a bucket")."""
        if self._cache is None:
            return True
        with self._lock:
            held = set(self._held)
        return all(k in held or self._cache.present(k) for k in np.unique(self.store.locate(indices)[0]).tolist())

    def opened(self, indices: np.ndarray) -> dict[int, Any] | None:
        """The shards of images `indices`, as opened: held still, the batch made from them being made (its
        `Encoded.let_go` comes after), so a remote store's are in its cache and none is downloaded."""
        shards, _ = self.store.locate(indices)
        return {int(k): self.store.shard(int(k)) for k in np.unique(shards)}

    def _use(self, shards: list[int], counts: list[int]) -> Callable[[bool], None] | None:
        """Hold `shards` in a remote store's cache (downloaded if needed) for a batch read from them, and
        let go of those whose time is up (`_expired`); tell the fetch-ahead what was read (`counts`
        samples of each). Returns what says the batch is made or dropped (its `Encoded.release`)."""
        if self._cache is None:
            return None
        with self._lock:
            self._reads += 1
            taken: list[int] = []
            try:
                for k in shards:
                    if k not in self._held:
                        self._cache.use(k)
                    self._held[k] = self._reads
                    self._making[k] = self._making.get(k, 0) + 1
                    taken.append(k)
            except BaseException:
                self._done(taken)  # (held still: they go as their time is up)
                raise
            self._let_go(self._expired())
        if self._on_read is not None:
            self._on_read(shards, counts)
        return functools.partial(self._made, shards)

    def _expired(self) -> list[int]:
        """Held shards whose time is up: no batch being made reads them and none read them in the last
        `HELD_FOR` reads, or their last read was `FORGOTTEN` reads ago. A shard a batch being made
        reads is never let go by age alone (pipelines read batches up to 2 a pipeline ahead, and a
        batch none of whose images decoded reads up to 8 more in its making). Under `_lock`."""
        reads = self._reads
        return [
            k
            for k, last in self._held.items()
            if reads - last > self.FORGOTTEN or (reads - last > self.HELD_FOR and k not in self._making)
        ]

    def _made(self, shards: list[int], now: bool = True) -> None:
        """A batch read from `shards` is made or dropped: those no other batch being made reads go, at
        once where `now`, else `HELD_FOR` reads later (an error while it was made: its decode workers
        may still read them)."""
        with self._lock:
            self._done(shards)
            if now:
                self._let_go([k for k in shards if k in self._held and k not in self._making])
            else:  # `HELD_FOR` reads from now
                self._held.update({k: self._reads for k in shards if k in self._held})

    def _done(self, shards: list[int]) -> None:
        """One batch fewer being made of each of `shards`. Under `_lock`."""
        for k in shards:
            left = self._making.get(k, 0) - 1
            if left > 0:
                self._making[k] = left
            else:
                self._making.pop(k, None)

    def _let_go(self, shards: list[int]) -> None:
        """Release `shards` in the cache (it may evict them now). Under `_lock`."""
        for k in shards:  # (`_making` keeps its counts: a batch forgotten still says when it is made)
            del self._held[k]
            self._cache.release(k)  # type: ignore[union-attr]  # (held: with a cache)

    def close(self) -> None:
        with self._lock:
            self._let_go(list(self._held))
            self._making.clear()
