"""Page-locked host memory seen by the GPU at its own address (unified virtual addressing)."""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

REGISTER_FLAGS = 0x01 | 0x02 | 0x08  # cudaHostRegisterPortable | Mapped | ReadOnly


class _DeviceArray:
    """Describes `nbytes` of page-locked host memory at `ptr` as a CUDA uint8 array."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def device_view(ptr: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over page-locked host memory (pinned or registered): kernels read it over
    PCIe, nothing is copied. The caller keeps the host memory alive and pinned while kernels read it."""
    with torch.cuda.device(device):
        return torch.as_tensor(_DeviceArray(ptr, shape), device=device)


_registered: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(ptr: int, nbytes: int) -> Registration:
    """Page-lock and map host memory for the GPU while the returned object lives; a range that is
    registered already (the same store's map under two loaders) shares that registration, as CUDA
    refuses to register memory twice."""
    reg = _registered.get((ptr, nbytes))
    if reg is None:
        reg = _registered[(ptr, nbytes)] = Registration(ptr, nbytes)
    return reg


@functools.cache
def _runtime():
    """The CUDA runtime library torch loaded, called through ctypes, which lets go of the GIL for the
    call (torch's `cudart()` binding holds it: page-locking a decode segment of a hundred megabytes
    then stopped every Python thread, the training loop's included, for tens of milliseconds).
    `torch.cuda.cudart()` where it can't be found (a runtime linked into torch)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            return lib
        except (OSError, AttributeError):
            continue
    return torch.cuda.cudart()


class Registration:
    """Page-locks `nbytes` of existing host memory at `ptr` (a memory map, a shared segment) and maps
    it for the GPU, for as long as this object lives. Raises RuntimeError if CUDA refuses."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = None
        torch.cuda.init()  # the runtime library is loaded and this process's context made
        err = _runtime().cudaHostRegister(ptr, nbytes, REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
        self.ptr = ptr

    def __del__(self):
        if self.ptr is not None:
            _runtime().cudaHostUnregister(self.ptr)
