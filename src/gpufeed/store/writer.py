"""Write a store atomically: build it in a hidden sibling directory, rename it into place last.

A crash, kill or Ctrl-C at any point leaves either the old destination or the complete new
store, never a directory that opens as a half-written store.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from gpufeed.store.format import MANIFEST, StoreError

HASH_CHUNK = 8 << 20


class HashingWriter:
    """Append-only file writer that keeps the byte count and SHA-256 as it goes."""

    def __init__(self, path: Path):
        self.path = path
        self._f: BinaryIO = open(path, "wb")
        self._sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self._sha.update(view)
        self.bytes += view.nbytes

    def close(self) -> dict[str, object]:
        """Flush to disk and return the manifest entry {"bytes", "sha256"}."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"bytes": self.bytes, "sha256": self._sha.hexdigest()}


def file_digest(path: Path) -> dict[str, object]:
    """Manifest entry {"bytes", "sha256"} of an existing file, read in chunks."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


@contextmanager
def atomic_store_dir(dest: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory; on success it replaces `dest`, on any failure it is removed."""
    dest = Path(dest).absolute()
    if dest.exists() and not overwrite:
        raise StoreError(f"{dest}: destination exists (pass overwrite=True / --overwrite to replace it)")
    if dest.exists() and not dest.is_dir():
        raise StoreError(f"{dest}: destination exists and is not a directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    work = dest.parent / f".{dest.name}.packing-{tag}"
    work.mkdir()
    try:
        yield work
        if not (work / MANIFEST).is_file():
            raise StoreError(f"{work}: internal error, store has no manifest at commit")
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{tag}"
            dest.rename(old)
            work.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            work.rename(dest)
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
