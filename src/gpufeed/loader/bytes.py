"""Where a jpeg Loader's encoded bytes come from: the seam between the JPEG pipeline and storage.

The pipeline (`jpeg_batch.JpegBatcher`) and its CPU decode workers ask a `ByteSource` for each
batch's bytes and never look at what is behind it. Two sources exist:

- `PackedBytes`: a packed jpeg store, whose `data.bin` is memory-mapped (and page-locked on a GPU,
  the host tier): a batch is a view, nothing is read; the workers map the same file.
- `loader.folder.FolderStore`: JPEGs read where they are (a folder, a list, tar shards): each batch
  is read from its files on threads, a batch ahead; the workers read their share themselves.

A remote store's local cache will be a third: it implements the same few calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from gpufeed.decode.base import Encoded


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

    @property
    def labels(self) -> torch.Tensor: ...

    def __len__(self) -> int: ...

    def source(self, i: int) -> str:
        """Where sample `i` came from (a file, `shard.tar:key`)."""

    def read_later(self, indices: np.ndarray) -> Callable[[], Encoded]:
        """Start getting the bytes of images `indices`; the returned call waits for them. An image that
        can't be read is left empty (its decoder fails it, and the Loader says so)."""

    def for_workers(self) -> WorkerView:
        """What the CPU decode worker processes read from."""


class PackedBytes:
    """A packed jpeg store's bytes, as the tier keeps them (`data`: the memory map, page-locked or not)."""

    reads_ahead = False

    def __init__(self, store, data: torch.Tensor):
        self.store, self._data = store, data
        self.path = store.path
        self.shapes = np.asarray(store.shapes).view(np.ndarray)
        self._offsets = np.asarray(store.offsets).view(np.ndarray)

    @property
    def labels(self) -> torch.Tensor:
        return self.store.labels

    def __len__(self) -> int:
        return len(self.store)

    def source(self, i: int) -> str:
        return self.store.source(i)

    def read_later(self, indices: np.ndarray) -> Callable[[], Encoded]:
        batch = Encoded.of(self._data, self._offsets, indices)
        return lambda: batch

    def for_workers(self) -> WorkerView:
        return WorkerView(data=self.store.data)
