"""Where the loader reads pixels from: GPU memory, page-locked host memory, or the page cache.

- `gpu`: the whole store is copied to the device once; batches are gathered there.
- `host`: the store's memory map is page-locked and registered with CUDA (one copy in RAM,
  shared through the page cache by every process on the machine); the GPU gathers batches
  straight over PCIe, no CPU copy at all. If registration fails, the disk tier is used.
- `disk`: batches are gathered by CPU threads from the memory map into a pinned ring.

A jpeg store's encoded bytes are decoded from host memory whatever the tier: `host` page-locks
them in RAM, `disk` reads them from the page cache (see `_encoded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpufeed.decode.base import as_tensor
from gpufeed.logs import logger
from gpufeed.store.reader import Store
from gpufeed.store.sharded import ShardedStore
from gpufeed.transfer.uva import device_view, register

log = logger(__name__)
TIERS = ("auto", "gpu", "host", "disk")


@dataclass
class Tier:
    """The chosen tier, the tensor batches are gathered from, and why."""

    name: str
    images: torch.Tensor = field(repr=False)  # (N, H, W, 3) uint8 on the device that gathers; jpeg: CPU bytes
    labels: torch.Tensor = field(repr=False)  # (N,) int64, same device as images
    reason: str = ""
    _keep: list = field(default_factory=list, repr=False)  # owners of the memory `images` reads

    @property
    def gathers_on_device(self) -> bool:
        return self.images.device.type != "cpu"


def host_budget() -> int:
    """Bytes of host RAM a store may occupy: half of what the kernel says is available."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // 2
    except (OSError, KeyError, ValueError):
        return 0


def choose(store: Store | ShardedStore, device: torch.device, cache: str) -> tuple[str, str]:
    """(tier, reason) for `cache` ("auto" picks by what fits)."""
    if cache not in TIERS:
        raise ValueError(f"cache must be one of {TIERS}, got {cache!r}")
    size = store.nbytes
    if cache != "auto":
        if cache == "gpu" and device.type != "cuda":
            raise ValueError(f"cache='gpu' needs a CUDA device, got {device}")
        return cache, "asked for"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if size <= free // 2:
            return "gpu", f"store {size / 1e9:.2f} GB fits in half of the {free / 1e9:.1f} GB free on {device}"
    budget = host_budget()
    if size <= budget:
        return "host", f"store {size / 1e9:.2f} GB fits in half of available RAM ({budget * 2 / 1e9:.1f} GB)"
    return "disk", f"store {size / 1e9:.2f} GB exceeds the host budget ({budget / 1e9:.1f} GB): streaming"


def _zero_copy(array: np.ndarray, device: torch.device) -> tuple[torch.Tensor, object]:
    """A CUDA tensor reading `array` (host memory) over PCIe, and the owner to keep alive."""
    ptr = array.ctypes.data
    reg = register(ptr, array.nbytes)
    return device_view(ptr, array.shape, device), reg


def in_place(labels: torch.Tensor) -> Tier:
    """The tier of JPEGs read where they are (`loader.folder`): each batch is read from its files."""
    return Tier("files", torch.empty(0, dtype=torch.uint8), labels, "JPEGs read in place from their files")


class ShardedRows:
    """A sharded raw store's images as (N, S, S, 3) rows, gathered from its shards' memory maps (what
    the disk tier, and the host tier on a CPU device, read): `take_rows` is the Gatherer's."""

    def __init__(self, store: ShardedStore):
        self.store = store
        side = store.image_shape[0]  # type: ignore[index]  # (raw: (S, S, 3))
        self.shape = (len(store), side, side, 3)
        self.device = torch.device("cpu")

    def take_rows(self, idx: np.ndarray, out: np.ndarray) -> None:
        shards, local = self.store.locate(idx)
        for k in np.unique(shards).tolist():
            at = np.flatnonzero(shards == k)
            out[at] = np.take(self.store.shard(k).images, local[at], 0)

    def fill(self, out: torch.Tensor) -> torch.Tensor:
        """Every row, shard after shard, into `out` (on any device)."""
        for k, start in enumerate(self.store.starts[:-1].tolist()):
            images = as_tensor(self.store.shard(k).images)
            for a in range(0, len(images), 4096):
                out[start + a : start + a + len(images[a : a + 4096])].copy_(images[a : a + 4096])
        return out


def materialize(store: Store, device: torch.device, cache: str) -> Tier:
    """Build the tier `cache` asks for (or picks) of a store in one file, degrading loudly when it cannot."""
    name, reason = choose(store, device, cache)
    if store.mode == "jpeg":
        return _encoded(store, device, cache, name, reason)
    images, labels = as_tensor(store.images), store.labels
    if name == "gpu":
        gpu = torch.empty(images.shape, dtype=torch.uint8, device=device)
        for start in range(0, len(images), 4096):
            gpu[start : start + 4096].copy_(images[start : start + 4096])
        return Tier("gpu", gpu, labels.to(device), reason)
    if name == "host" and device.type == "cuda":
        try:
            view, owner = _zero_copy(store.images, device)
            return Tier("host", view, labels.to(device), reason + "; GPU gathers from page-locked page cache", [owner])
        except (RuntimeError, TypeError) as e:
            log.warning(
                "host tier: cannot register the store with CUDA (%s); falling back to CPU gathers "
                "into pinned buffers (slower)",
                e,
            )
            return Tier("disk", images, labels, f"{reason}; zero-copy unavailable ({e})")
    if name == "host":  # CPU device: the page cache is host memory already, shared by every process
        return Tier("host", images, labels, reason + "; CPU device reads the page cache in place")
    return Tier("disk", images, labels, reason)


def materialize_sharded(store: ShardedStore, device: torch.device, cache: str) -> Tier:
    """`materialize` of a sharded store."""
    name, reason = choose(store, device, cache)
    return _sharded(store, device, name, reason)


def _sharded(store: ShardedStore, device: torch.device, name: str, reason: str) -> Tier:
    """Tier of a sharded store: a jpeg store's bytes are read from its shards per batch (`ShardBytes`);
    a raw store's images are copied into GPU memory (gpu) or into page-locked host memory the GPU reads
    (host: one copy per process, not the page cache's), or gathered from the shards' maps (disk, and
    every tier on a CPU device)."""
    labels = store.labels
    if store.mode == "jpeg":
        return Tier("shards", torch.empty(0, dtype=torch.uint8), labels, "JPEG bytes read from the store's shards")
    rows = ShardedRows(store)
    if name == "gpu":
        gpu = rows.fill(torch.empty(rows.shape, dtype=torch.uint8, device=device))
        return Tier("gpu", gpu, labels.to(device), reason + "; shards copied to GPU memory")
    if name == "host" and device.type == "cuda":
        host = np.empty(rows.shape, np.uint8)
        rows.fill(torch.from_numpy(host))
        try:
            view, owner = _zero_copy(host, device)
            return Tier(
                "host", view, labels.to(device), reason + "; shards copied to page-locked host memory", [owner, host]
            )
        except (RuntimeError, TypeError) as e:
            log.warning("host tier: cannot register the store's copy with CUDA (%s); CPU gathers instead (slower)", e)
    return Tier(
        "disk" if device.type == "cuda" or name == "disk" else name,
        rows,  # type: ignore[arg-type]
        labels,
        reason + "; gathered from the shards",
    )


def _encoded(store: Store, device: torch.device, cache: str, name: str, reason: str) -> Tier:
    """Tier of a jpeg store's encoded bytes. Every decoder parses bitstreams on the host (nvJPEG,
    nvImageCodec and libjpeg take host memory), so the fastest place for them is page-locked RAM:
    `host` locks the memory map there (no page faults, nothing evicted, DMA-able); `gpu` is served so."""
    data, labels = as_tensor(store.data), store.labels
    if name == "gpu":
        if cache == "auto":  # it fits in GPU memory; whether host RAM holds it decides
            name, reason = choose(store, torch.device("cpu"), "auto")
        else:
            log.warning(
                "%s: cache='gpu' on a jpeg store: decoders read bitstreams from host memory, so its "
                "encoded bytes are page-locked in RAM instead (the host tier)",
                store.path,
            )
            name, reason = "host", "cache='gpu' asked for; decoders read bitstreams from host memory"
    if name == "disk" or device.type != "cuda" or data.numel() == 0:
        where = "page-locked" if name == "host" and device.type == "cuda" else "read from the page cache"
        return Tier(name, data, labels, f"{reason}; jpeg store: encoded bytes {where}")
    try:
        owner = register(store.data.ctypes.data, store.data.nbytes)
    except RuntimeError as e:
        log.warning(
            "host tier: cannot page-lock the jpeg store's %.2f GB of encoded bytes (%s); they are read "
            "from the page cache instead",
            store.data.nbytes / 1e9,
            e,
        )
        return Tier("disk", data, labels, f"{reason}; page-locking failed ({e})")
    return Tier("host", data, labels, f"{reason}; encoded bytes page-locked in RAM", [owner])
