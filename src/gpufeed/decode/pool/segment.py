"""Shared buffers that the decode worker processes write pixels into.

A `Segment` is an anonymous shared-memory file (memfd) of the loader's process, which workers open
through /proc: no name in /dev/shm, nothing left behind if the process is killed. On a GPU it is
page-locked (registered with CUDA), so its pixels reach the device in one DMA copy.
"""

from __future__ import annotations

import mmap
import os
import weakref
from pathlib import Path

import torch

from gpufeed.transfer.uva import Registration


def unavailable() -> str | None:
    """Why decode worker processes can't run here, or None if they can."""
    if not hasattr(os, "memfd_create") or not Path(f"/proc/{os.getpid()}/fd").is_dir():
        return "decode worker processes need Linux (memfd and /proc)"
    return None


class Segment:
    """A shared buffer of `nbytes` that workers open as /proc/PID/fd/FD; page-locked if `device` is CUDA."""

    def __init__(self, nbytes: int, device: torch.device):
        self.fd = os.memfd_create("gpufeed-decode", os.MFD_CLOEXEC)
        self._close_fd = weakref.finalize(self, os.close, self.fd)  # also when dropped without close()
        self.nbytes = nbytes
        try:
            # its memfd's inode: a worker that opens /proc/PID/fd/FD checks it finds this segment there, not
            # another the fd number was given to since (a row can outlive its loader's close, `shared`)
            self.id = os.fstat(self.fd).st_ino
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes)
        except OSError:
            self._close_fd()
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registration = Registration(self.tensor.data_ptr(), nbytes) if device.type == "cuda" else None

    def numel(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self.tensor = self._registration = None  # type: ignore[assignment]  # closed: not read again
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the map goes with it
            pass
        self._close_fd()
