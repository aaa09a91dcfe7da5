"""What `gpufeed doctor` says about the software stack: versions, mismatches, and the fixing command.

The GPU decoders need three things to agree: the NVIDIA driver (it caps the CUDA version a
program may use), torch's CUDA build, and the CUDA build of nvImageCodec's wheel. A mismatch
does not crash: the hardware JPEG engines quietly go unused. So doctor names every version and,
for each mismatch, the command that fixes it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as metadata
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpufeed._version import __version__
from gpufeed.decode.base import nvimgcodec_install

NVIMGCODEC = {12: "nvidia-nvimgcodec-cu12", 13: "nvidia-nvimgcodec-cu13"}
NVJPEG = {12: "nvidia-nvjpeg-cu12", 13: "nvidia-nvjpeg"}


@dataclass(frozen=True)
class Stack:
    """The versions that matter, as found (None: not installed / no driver)."""

    gpufeed: str
    python: str
    torch: str | None
    torch_cuda: str | None  # torch.version.cuda; None for a CPU-only build
    torchvision: str | None
    driver: str | None  # the kernel module's version, e.g. "580.65.06"
    driver_cuda: str | None  # the newest CUDA the driver supports, e.g. "13.0"
    wheels: dict[str, str] = field(default_factory=dict)  # nvImageCodec and nvJPEG wheels installed
    triton: str | None = None  # the GPU augment kernels' compiler


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> tuple[str | None, str | None]:
    text = Path("/proc/driver/nvidia/version")
    driver = None
    if text.is_file():
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text.read_text(errors="replace"))
        driver = found.group(1) if found else "unknown version"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return driver or "unknown version", f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return driver, None


def collect() -> Stack:
    """The stack of this environment, read from package metadata and the driver (no CUDA init)."""
    torch_version: str | None
    torch_cuda: str | None
    try:
        import torch

        torch_version, torch_cuda = torch.__version__, torch.version.cuda
    except ImportError:
        torch_version = torch_cuda = None
    driver, driver_cuda = _driver()
    wheels = {d: v for d in (*NVIMGCODEC.values(), *NVJPEG.values()) if (v := _version(d))}
    return Stack(
        __version__,
        platform.python_version(),
        torch_version,
        torch_cuda,
        _version("torchvision"),
        driver,
        driver_cuda,
        wheels,
        _version("triton"),
    )


def _major(version: str | None) -> int | None:
    return int(version.split(".")[0]) if version and version[0].isdigit() else None


def problems(s: Stack) -> list[str]:
    """Each mismatch in `s`, with the command that fixes it; empty when everything fits."""
    out = []
    cuda, driver_cuda = _major(s.torch_cuda), _major(s.driver_cuda)
    if s.driver and s.torch and cuda is None:
        out.append(
            f"torch {s.torch} is a CPU-only build on a machine with an NVIDIA driver: install a CUDA "
            "build (the command for your CUDA is at https://pytorch.org/get-started/locally/)"
        )
    if cuda and driver_cuda and cuda > driver_cuda:  # within a major version, CUDA's minor-version compatibility holds
        out.append(
            f"torch is built for CUDA {s.torch_cuda} but the driver ({s.driver}) supports CUDA up to "
            f"{s.driver_cuda}: upgrade the driver, or install torch for CUDA {driver_cuda} "
            f"(pip install torch torchvision --index-url https://download.pytorch.org/whl/cu{driver_cuda}X, "
            "X the minor version pytorch.org lists)"
        )
    if cuda and s.driver and s.triton is None:
        out.append(
            "Triton is not installed, so GPU augmentation runs as several torch kernels per op instead of "
            "one kernel per pass (slower): pip install triton"
        )
    if cuda not in NVIMGCODEC or not s.driver:  # no driver: no GPU whose JPEG engines the wheels would serve
        return out
    install = nvimgcodec_install(s.torch_cuda)
    wrong = [d for c, d in NVIMGCODEC.items() if c != cuda and d in s.wheels]
    wrong += [d for c, d in NVJPEG.items() if c != cuda and d in s.wheels and NVJPEG[cuda] not in s.wheels]
    if wrong:
        out.append(
            f"{', '.join(wrong)} installed but torch is built for CUDA {s.torch_cuda}, so the hardware "
            f"JPEG engines go unused: pip uninstall -y {' '.join(wrong)} && {install}"
        )
    elif NVIMGCODEC[cuda] not in s.wheels:
        out.append(
            f"nvImageCodec is not installed, so the GPU's hardware JPEG engines (A100, H100, H200) go unused: {install}"
        )
    elif NVIMGCODEC[cuda] in s.wheels and NVJPEG[cuda] not in s.wheels:
        out.append(f"{NVIMGCODEC[cuda]} is installed without {NVJPEG[cuda]}, which its JPEG decoders need: {install}")
    return out


def report(s: Stack | None = None) -> list[str]:
    """Doctor's lines: one naming every version, then one per problem."""
    s = s or collect()
    torch = f"torch {s.torch} (CUDA {s.torch_cuda})" if s.torch_cuda else f"torch {s.torch or 'missing'} (CPU only)"
    driver = f"NVIDIA driver {s.driver} (CUDA up to {s.driver_cuda or '?'})" if s.driver else "no NVIDIA driver"
    wheels = ", ".join(f"{d} {v}" for d, v in s.wheels.items()) or "no nvImageCodec/nvJPEG wheels"
    lines = [
        f"versions: gpufeed {s.gpufeed}, Python {s.python}, {torch}, torchvision {s.torchvision or 'missing'}, "
        f"{driver}, {wheels}, Triton {s.triton or 'missing'}"
    ]
    return lines + [f"fix: {p}" for p in problems(s)]
