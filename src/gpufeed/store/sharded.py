"""Sharded stores (format version 4): writing one from a packed store, and reading one.

A shard is a version 3 store of its own (`shards/NNNNN/`, manifest and data files), holding a
contiguous run of the samples; the top manifest lists the shards in order with the SHA-256 of each
shard's manifest (whose own digests cover its data files), and the top labels and jpeg shapes let a
Loader plan an epoch without any shard. So a shard is one unit to upload, download, verify, cache
and evict, and a store in a bucket is opened by reading three small files.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpufeed.store import format as fmt
from gpufeed.store.format import Manifest, StoreError
from gpufeed.store.reader import Described, Store, map_checked
from gpufeed.store.writer import file_digest


def manifest_digest(path: Path) -> str:
    """The SHA-256 (hex) of a shard's manifest.json, as the top manifest records it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shard_bounds(store: Store, shard_size: int) -> list[int]:
    """Sample starts of shards of about `shard_size` bytes each (at least one sample each), and the count."""
    n = len(store)
    if store.mode == "raw":
        per = max(1, shard_size // fmt.raw_item_bytes(store.image_shape[0]))  # type: ignore[index]  # (raw)
        return [*range(0, n, per), n]
    ends = np.asarray(store.offsets)[1:]
    bounds, start = [0], 0
    while start < n:
        base = int(store.offsets[start])
        stop = int(np.searchsorted(ends, base + shard_size, side="left")) + 1  # the sample that reaches the size
        stop = min(max(stop, start + 1), n)
        bounds.append(stop)
        start = stop
    return bounds


def write_sharded(
    source: Store, out: Path, shard_size: int, on_shard: Callable[[str, Path], None] | None = None
) -> Manifest:
    """Write `source` (a packed version 3 store) as a sharded store in the empty folder `out`: each shard
    a version 3 store of a contiguous run of samples, then the top labels (and jpeg shapes), then the
    top manifest. `on_shard(name, folder)` is called as each shard is finished (an upload). Returns
    the top manifest, written last."""
    bounds = shard_bounds(source, shard_size)
    shards = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        name = fmt.shard_name(k)
        folder = out / name
        folder.mkdir(parents=True)
        manifest = _write_shard(source, a, b, folder)
        shards.append(
            {
                "name": name,
                "count": b - a,
                "bytes": sum(f["bytes"] for f in manifest.files.values()),
                "digest": manifest_digest(folder / fmt.MANIFEST),
            }
        )
        if on_shard is not None:
            on_shard(name, folder)
    files = {fmt.LABELS: _write(out / fmt.LABELS, np.asarray(source.labels.numpy(), "<i8"))}
    if source.mode == "jpeg":
        files[fmt.JPEG_SHAPES] = _write(out / fmt.JPEG_SHAPES, np.asarray(source.shapes, "<i4"))
    top = replace(source.manifest, files=files, shards=shards, version=fmt.SHARDED_SINCE)
    top.write(out)
    return top


def _write(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write `array` as a headerless data file and return its manifest entry."""
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(array).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return file_digest(path)


def _ranged(data: np.ndarray, offsets: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples [a, b) of a variable-length file: their bytes and their offsets from 0."""
    start, end = int(offsets[a]), int(offsets[b])
    return data[start:end], np.asarray(offsets[a : b + 1], "<i8") - start


def _write_shard(source: Store, a: int, b: int, folder: Path) -> Manifest:
    """Samples [a, b) of `source` as a version 3 store in `folder`."""
    m = source.manifest
    files: dict[str, dict[str, Any]] = {fmt.LABELS: _write(folder / fmt.LABELS, np.asarray(source._labels[a:b]))}
    if m.mode == "raw":
        files[fmt.RAW_IMAGES] = _write(folder / fmt.RAW_IMAGES, np.asarray(source.images[a:b]))
    else:
        data, offsets = _ranged(source.data, source.offsets, a, b)
        files[fmt.JPEG_DATA] = _write(folder / fmt.JPEG_DATA, data)
        files[fmt.JPEG_OFFSETS] = _write(folder / fmt.JPEG_OFFSETS, offsets)
        files[fmt.JPEG_SHAPES] = _write(folder / fmt.JPEG_SHAPES, np.asarray(source.shapes[a:b]))
    if m.version >= fmt.SOURCES_SINCE:
        data, offsets = _ranged(source._sources, source._source_offsets, a, b)  # type: ignore[arg-type]  # (opened)
        files[fmt.SOURCES] = _write(folder / fmt.SOURCES, data)
        files[fmt.SOURCE_OFFSETS] = _write(folder / fmt.SOURCE_OFFSETS, offsets)
    for name, spec in m.fields.items():
        column = source.column(name)
        names = fmt.field_files(name, spec)
        if column.fixed:
            files[names[0]] = _write(folder / names[0], np.asarray(column.values[a:b]))
        else:
            data, offsets = _ranged(column.data, column.offsets, a, b)
            files[names[0]] = _write(folder / names[0], data)
            files[names[1]] = _write(folder / names[1], offsets)
    shard = replace(m, count=b - a, files=files, skipped=[], shards=[], version=fmt.UNSHARDED_VERSION)
    shard.write(folder)
    return shard


class ShardedStore(Described):
    """A sharded store on this machine's disk, read as one store: `len`, `store[i]`, labels, classes,
    sources and fields across its shards (each opened, and its manifest's digest checked, when first
    used). `shard(k)` is shard k as a `Store`; `starts` the first sample of each shard, then the count."""

    def __init__(self, path: str | Path, manifest: Manifest | None = None):
        self.path = Path(path)
        self.manifest = manifest or Manifest.read(self.path)
        m = self.manifest
        if m.version < fmt.SHARDED_SINCE:
            raise StoreError(
                f"{self.path}: not a sharded store (format version {m.version}): open it with gpufeed.open"
            )
        self.starts = np.cumsum([0] + [s["count"] for s in m.shards]).astype(np.int64)
        self._mapped: dict[str, np.ndarray] = {}
        self._labels = map_checked(self.path, m, fmt.LABELS, (m.count,), self._mapped)
        bad = (self._labels < -1) | (self._labels >= len(m.classes)) if m.classes else self._labels < -1
        if bad.any():
            raise StoreError(f"{self.path / fmt.LABELS}: entry {int(np.argmax(bad))} is not a label (damaged store)")
        if m.mode == "jpeg":
            self.shapes = map_checked(self.path, m, fmt.JPEG_SHAPES, (m.count, 2), self._mapped)
            if (self.shapes <= 0).any():
                raise StoreError(
                    f"{self.path / fmt.JPEG_SHAPES}: entry {int(np.argmax((self.shapes <= 0).any(1)))} "
                    "is not a positive size (damaged store)"
                )
        self._shards: dict[int, Store] = {}
        self._pins: Mapping[int, Store] = {}  # `pinned`'s

    def shard_path(self, k: int) -> Path:
        return self.path / self.manifest.shards[k]["name"]

    def shard(self, k: int) -> Store:
        """Shard `k`, opened once; its manifest must be the one the top manifest recorded."""
        pinned = self._pins.get(k)
        if pinned is not None:
            return pinned
        if k not in self._shards:
            self._shards[k] = open_shard(self.shard_path(k), self.manifest, k)
        return self._shards[k]

    def pinned(self, shards: Mapping[int, Store]) -> ShardedStore:
        """This store, read through `shards` (number -> the shard as opened), e.g. those a batch's images
        were read from: a Loader reads the batch's fields through them on the training thread, where a
        remote store's shard evicted meanwhile was downloaded again (twice the downloads of an epoch
        with fields=("source",)); the maps of an evicted shard still hold its verified files. Other
        shards are opened as `shard` opens them."""
        view = copy.copy(self)
        view._pins = shards
        return view

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, index within it) of each of `indices`."""
        indices = np.asarray(indices, np.int64)
        shard = np.searchsorted(self.starts, indices, side="right") - 1
        return shard, indices - self.starts[shard]

    def check_unchanged(self) -> None:
        # (a copy: a producer making the next epoch's first batches may open another shard meanwhile)
        for shard in list(self._shards.values()):
            shard.check_unchanged()

    @property
    def nbytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest.shards)

    def _where(self, i: int) -> tuple[Store, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a store of {n}")
        (k,), (local,) = self.locate(np.array([i % n]))
        return self.shard(int(k)), int(local)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        shard, local = self._where(i)
        return shard[local]

    def encoded(self, i: int) -> torch.Tensor:
        shard, local = self._where(i)
        return shard.encoded(local)

    def source(self, i: int) -> str:
        shard, local = self._where(i)
        return shard.source(local)

    def field(self, name: str, i: int):
        shard, local = self._where(i)
        return shard.field(name, local)

    def column(self, name: str) -> ShardedColumn:
        if name not in self.manifest.fields:
            known = ", ".join(["label", "source", *self.manifest.fields]) or "none"
            raise KeyError(f"{self.path}: no field {name!r} (this store has: {known})")
        return ShardedColumn(self, name)

    def __repr__(self) -> str:
        return f"ShardedStore({str(self.path)!r}, mode={self.mode!r}, count={len(self)}, shards={len(self.starts) - 1})"


class ShardedColumn:
    """A field of every sample of a sharded store, read from the shards that hold a batch's samples."""

    def __init__(self, store: ShardedStore, name: str):
        self.store, self.name = store, name
        self.kind = store.manifest.fields[name]["kind"]

    @property
    def fixed(self) -> bool:
        return self.kind not in fmt.VARIABLE_KINDS

    def value(self, i: int) -> Any:
        shard, local = self.store._where(i)
        return shard.column(self.name).value(local)

    def runs(self, i: int) -> fmt.MaskRuns | None:
        shard, local = self.store._where(i)
        return shard.column(self.name).runs(local)

    def rows(self, indices: np.ndarray) -> np.ndarray | list:
        indices = np.asarray(indices, np.int64)
        shards, local = self.store.locate(indices)
        if not self.fixed:
            return [self.store.shard(int(k)).column(self.name).value(int(j)) for k, j in zip(shards, local)]
        first = self.store.shard(int(shards[0])).column(self.name).rows(local[:1]) if len(indices) else None
        out = np.empty(  # (a fixed-size field's rows: an array)
            (len(indices), *(first.shape[1:] if first is not None else ())),  # type: ignore[union-attr]
            first.dtype if first is not None else np.int64,  # type: ignore[union-attr]
        )
        for k in np.unique(shards):
            at = np.flatnonzero(shards == k)
            out[at] = self.store.shard(int(k)).column(self.name).rows(local[at])
        return out


def open_shard(path: Path, top: Manifest, k: int) -> Store:
    """Shard `k` of a sharded store at `path`, its manifest checked against the top manifest's digest
    (which vouches for the digests inside it) and its sample count."""
    entry = top.shards[k]
    try:
        digest = manifest_digest(path / fmt.MANIFEST)
    except FileNotFoundError:
        raise StoreError(f"{path}: shard {k} is missing (damaged store)") from None
    if digest != entry["digest"]:
        raise StoreError(
            f"{path / fmt.MANIFEST}: not the shard the store's manifest recorded (digest differs: damaged store)"
        )
    shard = Store(path)
    if len(shard) != entry["count"] or shard.mode != top.mode:
        raise StoreError(
            f"{path}: shard {k} holds {len(shard)} {shard.mode} samples, the store's manifest says "
            f"{entry['count']} {top.mode} (damaged store)"
        )
    return shard
