"""Write a store atomically: build it in a hidden sibling directory, rename it into place last.

A crash, kill or Ctrl-C at any point leaves either the old destination or the complete new
store, never a directory that opens as a half-written store; the hidden folder a killed pack
leaves beside it, the next pack to that destination removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from gpufeed.store.format import CHECKSUM_BLOCK, MANIFEST, StoreError


class TreeHasher:
    """Streaming form of the store digest: SHA-256 over the SHA-256 of each 64 MiB block."""

    def __init__(self):
        self._blocks: list[bytes] = []
        self._block = hashlib.sha256()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while data.nbytes:
            take = min(CHECKSUM_BLOCK - self._filled, data.nbytes)
            self._block.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == CHECKSUM_BLOCK:
                self._blocks.append(self._block.digest())
                self._block, self._filled = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        blocks = self._blocks + ([self._block.digest()] if self._filled or not self._blocks else [])
        return hashlib.sha256(b"".join(blocks)).hexdigest()


class HashingWriter:
    """Append-only file writer that keeps the byte count and the store digest as it goes."""

    def __init__(self, path: Path):
        self.path = path
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115  held open across writes; close() closes it
        self._hash = TreeHasher()
        self.bytes = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self._hash.update(view)
        self.bytes += view.nbytes

    def close(self) -> dict[str, object]:
        """Flush to disk and return the manifest entry {"bytes", "digest"}."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"bytes": self.bytes, "digest": self._hash.hexdigest()}

    def abandon(self) -> None:
        """Close the file of a store that is not finished (its folder is removed): the disk space of a
        removed file is freed only once no descriptor holds it. Data it could not write is dropped."""
        with contextlib.suppress(OSError):  # the buffer's last flush (a full disk): the file closes anyway
            self._f.close()


def _block_digest(fd: int, index: int, size: int) -> bytes:
    start = index * CHECKSUM_BLOCK
    h = hashlib.sha256()
    done = 0
    length = min(CHECKSUM_BLOCK, size - start)
    while done < length:
        chunk = os.pread(fd, min(8 << 20, length - done), start + done)
        if not chunk:
            raise OSError(f"short read at byte {start + done}")
        h.update(chunk)
        done += len(chunk)
    return h.digest()


def file_digest(path: Path, threads: int | None = None) -> dict[str, object]:
    """Manifest entry {"bytes", "digest"} of an existing file, its blocks hashed in parallel."""
    return fd_digest(os.open(path, os.O_RDONLY), threads)


def fd_digest(fd: int, threads: int | None = None) -> dict[str, object]:
    """`file_digest` of an open file descriptor, which it closes."""
    try:
        size = os.fstat(fd).st_size
        count = max(1, -(-size // CHECKSUM_BLOCK))
        with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:
            blocks = list(pool.map(lambda i: _block_digest(fd, i, size), range(count)))
    finally:
        os.close(fd)
    return {"bytes": size, "digest": hashlib.sha256(b"".join(blocks)).hexdigest()}


@contextmanager
def exclusive(dest: Path) -> Iterator[None]:
    """Hold the lock that lets one pack at a time write `dest` (an flock on a hidden sibling file:
    the kernel drops it if the process dies, so a killed pack leaves no stale lock); raise StoreError
    if another pack holds it."""
    path = dest.parent / f".{dest.name}.lock"
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(
                f"{dest}: another gpufeed pack is writing this destination now ({path} is locked)"
            ) from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:  # not a file the previous holder unlinked after we opened it
            break
        os.close(fd)
    try:
        yield
    finally:
        os.unlink(path)
        os.close(fd)


@contextmanager
def atomic_store_dir(dest: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory; on success it replaces `dest`, on any failure it is removed. One pack
    at a time per destination (`exclusive`)."""
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(dest):
        _remove_stale(dest)
        with _atomic(dest, overwrite) as work:
            yield work


def _remove_stale(dest: Path) -> None:
    """Remove the scratch folders of packs to `dest` that died (SIGKILL, a crash, power loss) before
    they could: safe while we hold `dest`'s lock, as no live pack can then own one. A previous
    store set aside for replacing (.old-) goes too, unless `dest` is missing: it may be all there is."""
    prefix = glob.escape(f".{dest.name}.")
    stale = list(dest.parent.glob(prefix + "packing-*"))
    if dest.exists():
        stale += dest.parent.glob(prefix + "old-*")
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _atomic(dest: Path, overwrite: bool) -> Iterator[Path]:
    if dest.exists() and not overwrite:
        raise StoreError(f"{dest}: destination exists (pass overwrite=True / --overwrite to replace it)")
    if dest.exists() and not dest.is_dir():
        raise StoreError(f"{dest}: destination exists and is not a directory")
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
