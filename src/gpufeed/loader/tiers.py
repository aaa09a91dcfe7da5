"""Where the loader reads pixels from: GPU memory, page-locked host memory, or the page cache.

- `gpu`: the whole store is copied to the device once; batches are gathered there.
- `host`: the store's memory map is page-locked and registered with CUDA (one copy in RAM,
  shared through the page cache by every process on the machine); the GPU gathers batches
  straight over PCIe, no CPU copy at all. If registration fails, a pinned copy is used.
- `disk`: batches are gathered by CPU threads from the memory map into a pinned ring.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from gpufeed.store.reader import Store, as_tensor
from gpufeed.transfer.uva import device_view

log = logging.getLogger(__name__)
TIERS = ("auto", "gpu", "host", "disk")
REGISTER_FLAGS = 0x01 | 0x02 | 0x08  # cudaHostRegisterPortable | Mapped | ReadOnly


@dataclass
class Tier:
    """The chosen tier, the tensor batches are gathered from, and why."""

    name: str
    images: torch.Tensor = field(repr=False)  # (N, H, W, 3) uint8, on the device that gathers
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


def choose(store: Store, device: torch.device, cache: str) -> tuple[str, str]:
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


class _Registration:
    """Keeps host memory registered with CUDA for as long as it is referenced."""

    def __init__(self, array: np.ndarray):
        self.array, self.ptr = array, array.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, array.nbytes, REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {int(err)}")

    def __del__(self):
        torch.cuda.cudart().cudaHostUnregister(self.ptr)


def _zero_copy(array: np.ndarray, device: torch.device) -> tuple[torch.Tensor, object]:
    """A CUDA tensor reading `array` (host memory) over PCIe, and the owner to keep alive."""
    reg = _Registration(array)
    return device_view(reg.ptr, array.shape, device), reg


def materialize(store: Store, device: torch.device, cache: str) -> Tier:
    """Build the tier `cache` asks for (or picks), degrading loudly when it cannot."""
    name, reason = choose(store, device, cache)
    if store.mode == "jpeg":
        return Tier("disk", as_tensor(store.data), store.labels, "jpeg store: encoded bytes read from the page cache")
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
            log.warning("host tier: cannot register the store with CUDA (%s); falling back to CPU gathers "
                        "into pinned buffers (slower)", e)
            return Tier("disk", images, labels, f"{reason}; zero-copy unavailable ({e})")
    if name == "host":  # CPU device: the page cache is host memory already, shared by every process
        return Tier("host", images, labels, reason + "; CPU device reads the page cache in place")
    return Tier("disk", images, labels, reason)
