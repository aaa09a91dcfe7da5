"""Who reads through a cache folder now: each process whose Loader reads a store through it registers
there (a file in `users/` saying its process id, host and `cache_limit`, on which it keeps an exclusive lock:
let go by the kernel when the process ends, whatever its end), so that a process joining a cache
folder sees the others. The processes sharing one cache split its limit; one that counted on it
alone (no LOCAL_WORLD_SIZE), or gave another limit, found no room mid-epoch: two ranks blocked for
two minutes, then failed, or the smaller limit's process blamed itself for the other's shards.
`gpufeed.store.remote.ShardCache.join` registers, and refuses another limit; the Loader joins as it
is made, and refuses more processes than LOCAL_WORLD_SIZE says (`loader._window`). A store only opened
(`gpufeed inspect`) reads its top files and registers nothing."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

USERS = "users"  # in a cache folder: a file a process registered by


@dataclass(frozen=True)
class User:
    """A process reading through a cache folder now (its id, on `host`: a folder on a shared disk may be
    read from several machines), and the `cache_limit` it gave (None: none)."""

    pid: int
    limit: int | None
    host: str = ""


class Registration:
    """This process's entry in a cache folder's `users/`, held (locked) until `close`."""

    def __init__(self, folder: Path, limit: int | None):
        users = folder / USERS
        users.mkdir(exist_ok=True)
        # made whole and locked under a name `others` passes over, then renamed in: a reader never
        # sees an entry without its lock (and takes it for one whose process is gone)
        fd, temp = tempfile.mkstemp(prefix=".", dir=users)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "cache_limit": limit}).encode())
            self.path = users / f"{os.getpid()}-{Path(temp).name[1:]}.json"
            os.replace(temp, self.path)
        except BaseException:
            os.close(fd)
            Path(temp).unlink(missing_ok=True)
            raise
        self._fd: int | None = fd

    def close(self) -> None:
        """Take the entry out (the process no longer reads through the folder)."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def others(folder: Path, mine: Path | None = None) -> list[User]:
    """The other processes reading through the cache folder `folder` now (one entry per registration;
    this process's own, `mine`, and any other of this process on this host left out: a process id
    repeats across containers and machines, so the host is compared too); entries of processes gone
    are removed."""
    found: list[User] = []
    try:
        entries = list(os.scandir(folder / USERS))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR)
        except OSError:  # removed meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its process holds it: it runs
                with open(entry.path) as f:
                    said = json.load(f)
                user = User(int(said["pid"]), said["cache_limit"], str(said.get("host", "")))
                if Path(entry.path) != mine and (user.pid, user.host) != (os.getpid(), socket.gethostname()):
                    found.append(user)
            else:  # nobody holds it: its process is gone
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        except (OSError, ValueError, KeyError, TypeError):  # an entry being removed, or not one of ours
            pass
        finally:
            os.close(fd)
    return found
