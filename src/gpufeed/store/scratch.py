"""Temporary folders that say whether their owner still runs: a download's beside the cache's shards, a
pack's scratch folder in TMPDIR. A process killed (SIGKILL, OOM) left them for good: a cache gathered
255 KB of them over its 200 KB limit, TMPDIR a store's worth a pack. Each holds an `OWNER` file its
process keeps an exclusive lock on (`fcntl.flock`: let go by the kernel when the process ends, whatever
its end, and known to every process of the machine); `reclaim` removes those whose lock nobody holds.
A lock file, not the folder itself: an exclusive lock needs a file open for writing on NFS."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

OWNER = ".owner"  # in a held folder: the file its process keeps locked


@contextlib.contextmanager
def held_folder(parent: Path, prefix: str) -> Iterator[Path]:
    """A new folder in `parent`, named `prefix` then the process id and a random part, held (`OWNER`
    locked) while the block runs, then removed with what is left in it. A folder a `reclaim` took
    between its making and its lock is not used: another is made."""
    while True:
        folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
        try:
            fd = os.open(folder / OWNER, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # reclaimed before its lock
            continue
        except OSError:  # (made read-only meanwhile): no folder without an owner left behind
            with contextlib.suppress(OSError):
                folder.rmdir()
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a reclaim holds it, and removes it
            os.close(fd)
            continue
        try:
            if os.stat(folder / OWNER).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError
        except FileNotFoundError:  # reclaimed between the two: its lock is on a removed file
            os.close(fd)
            continue
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(fd)  # lets go of the lock, once nothing of the folder is left
        return


def let_go(folder: Path) -> None:
    """Take the `OWNER` file out of a held folder that is about to become something else (moved into
    place): its process still holds the lock on the removed file, and `reclaim` no longer sees an
    owner there (nor takes it: a held folder without one is never removed)."""
    (folder / OWNER).unlink(missing_ok=True)


def reclaim(parent: Path, prefix: str, legacy: bool = False) -> list[str]:
    """Remove the folders in `parent` that `held_folder` made with a prefix the regular expression
    `prefix` matches and whose owner is gone (its `OWNER` lock free), and with `legacy` those named as
    `tempfile.mkdtemp` named them before folders were held (the prefix, then the random part: made by a
    gpufeed that no longer runs there); the names removed. A held folder without `OWNER` is left
    alone: it was just made, or is being moved into place."""
    held = re.compile(prefix + r"\d+-[a-z0-9_]+")
    old = re.compile(prefix + r"[a-z0-9_]+") if legacy else None
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        if old is not None and old.fullmatch(entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
            continue
        if not held.fullmatch(entry.name):
            continue
        try:
            fd = os.open(os.path.join(entry.path, OWNER), os.O_RDWR)
        except OSError:  # no owner file: made just now, or being moved into place
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its process runs
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)  # under the lock: a maker that took it meanwhile sees so
            removed.append(entry.name)
        finally:
            os.close(fd)
    return removed
