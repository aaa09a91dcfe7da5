"""Downloads from a store in a bucket, with no state between calls: a try of a request and the tries
after it (`retried`: backoff, timeouts, a missing file, a full disk told apart), a remote folder's
files at once (byte ranges from an object store, fsspec's `get` elsewhere; each try in a folder of
its own), and files kept only once their digests are those recorded (`Fetcher.checked`). The cache
(`store.remote`) decides what to download and where; packing to a bucket retries its uploads here."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufeed.store.format import StoreError
from gpufeed.store.locations import shown
from gpufeed.store.scratch import held_folder
from gpufeed.store.writer import file_digest

RETRIES = 5  # tries of each download before the shard is named in an error
BACKOFF = 0.5  # seconds before the second try, doubling
PART = 4 << 20  # from an object store, a shard's files come as byte ranges of at most this, all at once
RANGES_AT_ONCE = 16  # ranges of one download held in memory at once: 64 MB, so a process's fetch pool up to 192 MB
RANGE_TRIES = 3  # tries of a range within one try of a download (one that timed out: none again, `retried`'s)
TIMEOUT_TRIES = 2  # tries of a request that the server did not answer within its timeouts (`retried`)
RANGED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")  # protocols whose servers all answer byte ranges


def retried(what: str, call: Callable[[], Any], retries: int = RETRIES, local: Path | None = None) -> Any:
    """`call()`, tried again after a transient error (with backoff); the last error is raised as a
    StoreError naming `what`. A missing object is not transient. A request the server did not answer
    within its timeouts (`timed_out`) is tried `TIMEOUT_TRIES` times in all: each try waited the
    timeouts already (s3fs's own tries of it too), and a server that accepts and never answers should
    be said in minutes, not after an hour. An error of a file in the folder `local` (the cache's) is
    this disk's: raised as it is, at once, for the caller to name the folder (a download's folder
    deleted under it was "not found", as if the bucket had lost the file)."""
    error: Exception
    for attempt in range(retries):
        try:
            return call()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreError(
                    f"{what}: the cache disk is full ({e.strerror}): free space or set a smaller cache_limit"
                ) from None
            if local is not None and _inside(e.filename, local):
                raise
            if isinstance(e, FileNotFoundError):
                raise StoreError(f"{what}: not found") from None
            error = e
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - a filesystem library's own errors (botocore, aiohttp, ...)
            error = e
        if timed_out(error) and attempt + 1 >= TIMEOUT_TRIES:
            raise StoreError(
                f"{what}: the server did not answer ({attempt + 1} tries, each within its connect and read timeouts: "
                f"storage_options set them), last: {type(error).__name__}: {_scrubbed(error)}"
            ) from None
        if attempt + 1 < retries:
            time.sleep(BACKOFF * 2**attempt)
    raise StoreError(f"{what}: failed {retries} times, last: {type(error).__name__}: {_scrubbed(error)}") from None


def _inside(filename: object, folder: Path) -> bool:
    """Whether `filename` (an OSError's, maybe None) names a file in `folder` on this disk."""
    if not isinstance(filename, (str, os.PathLike)):
        return False
    path, root = os.path.abspath(filename), os.path.abspath(folder)
    return os.path.commonpath([path, root]) == root


def timed_out(error: BaseException) -> bool:
    """Whether `error` says a request got no answer (or no connection) within its timeouts: Python's,
    asyncio's and fsspec's TimeoutError, botocore's ConnectTimeoutError and ReadTimeoutError, aiohttp's
    timeouts (by name: the filesystem libraries are imported only where they are used)."""
    return isinstance(error, TimeoutError) or any("Timeout" in kind.__name__ for kind in type(error).__mro__)


def _scrubbed(error: BaseException) -> str:
    """An error's message without URL credentials."""
    return re.sub(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@", r"\1", str(error))[:300]


def _bytes(path: Path) -> int | None:
    """The file's size, or None where it is not there."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _not_yet(folder: Path, files: dict) -> dict[str, int | None]:
    """Those of `files` (name -> manifest entry) not yet in `folder`, with their recorded sizes."""
    return {name: meta["bytes"] for name, meta in files.items() if not (folder / name).exists()}


def is_whole(path: Path, meta: dict) -> bool:
    """Whether the file at `path` is the one a manifest entry (`meta`) records: its bytes and digest."""
    return path.exists() and file_digest(path) == {"bytes": meta["bytes"], "digest": meta["digest"]}


class Fetcher:
    """Downloads of the store at `url` (its files under `root` on the fsspec filesystem `fs`) into
    folders under `local` (the cache folder: an error of a file there is this disk's, `retried`)."""

    def __init__(self, fs, root: str, url: str, local: Path):
        self.fs, self.root, self.url, self.local = fs, root, url, local

    def get(self, remote: str, files: dict[str, int | None], into: Path) -> None:
        """Files of the remote folder `remote` (name -> its bytes, None: not known) into the local folder
        `into`, at once. Each try downloads into a folder of its own and moves into `into` only what
        it finished (all of it, or after a failure the files it had whole): before fsspec 2026.4 a
        failed `get` left its other downloads running, and one finishing late must not write over a
        file a later try has made, or a shard already in place. From an object store, files of known
        size come as byte ranges (`_get_ranges`)."""
        if not files:
            return
        attempt = Path(tempfile.mkdtemp(prefix=".try-", dir=into))
        finished: list[str] = []
        sizes = {n: size for n, size in files.items() if size is not None}
        ranged = len(sizes) == len(files) and bool(set(_protocols(self.fs)) & set(RANGED))
        try:
            if ranged:
                self._get_ranges(remote, sizes, attempt, finished)
            else:
                self.fs.get([f"{remote}/{n}" for n in files], [os.fspath(attempt / n) for n in files])
                finished += files
        except BaseException:
            if not ranged:  # which files the failed get finished: those at their full size
                finished[:] = [n for n, size in sizes.items() if _bytes(attempt / n) == size]
            raise
        finally:
            for name in dict.fromkeys(finished):
                os.replace(attempt / name, into / name)
            shutil.rmtree(attempt, ignore_errors=True)

    def _get_ranges(self, remote: str, sizes: dict[str, int], into: Path, finished: list[str]) -> None:
        """The files `sizes` names (name -> bytes) of the remote folder `remote` into `into` as byte
        ranges of at most `PART`, `RANGES_AT_ONCE` at a time (fsspec's `cat_ranges`, concurrent), each
        file's name put in `finished` once all its ranges are written. One stream through a link of
        20 ms carried about 48 MB/s where the link carried 125 (the development machine, remote_bench's
        link): a cache with room to fetch two shards ahead used 70 % of the link."""
        parts = [(n, at, min(at + PART, size)) for n, size in sizes.items() for at in range(0, size, PART)]
        left = {n: 0 for n in sizes}
        for n, _, _ in parts:
            left[n] += 1
        with contextlib.ExitStack() as files:
            out = {n: files.enter_context(open(into / n, "wb")) for n in sizes}
            finished += [n for n, count in left.items() if count == 0]  # empty files
            for first in range(0, len(parts), RANGES_AT_ONCE):
                for (n, a, _), blob in self._ranges(remote, parts[first : first + RANGES_AT_ONCE]):
                    out[n].seek(a)
                    out[n].write(blob)
                    left[n] -= 1
                    if left[n] == 0:
                        out[n].close()
                        finished.append(n)

    def _ranges(self, remote: str, group: list[tuple[str, int, int]]) -> list[tuple[tuple[str, int, int], bytes]]:
        """Each (file, start, end) of `group` with its bytes, fetched at once; a range that failed, or came
        short, is asked for again (`RANGE_TRIES` tries in all, with backoff; the download's own retries
        come on top), so that one transient error does not cost the others: a file of many ranges
        would rarely come whole in one try (a test's server failing every third request: 15 s)."""
        got: list[tuple[tuple[str, int, int], bytes]] = []
        error: BaseException | None = None
        for attempt in range(RANGE_TRIES):
            if attempt:
                time.sleep(BACKOFF * 2 ** (attempt - 1))
            blobs = self.fs.cat_ranges(
                [f"{remote}/{n}" for n, _, _ in group],
                [a for _, a, _ in group],
                [b for _, _, b in group],
                on_error="return",
            )
            again = []
            for part, blob in zip(group, blobs, strict=True):
                if isinstance(blob, FileNotFoundError) or (isinstance(blob, BaseException) and timed_out(blob)):
                    raise blob  # missing, or no answer within the timeouts: the download's tries decide
                if isinstance(blob, BaseException) or len(blob) != part[2] - part[1]:
                    error = (
                        blob
                        if isinstance(blob, BaseException)
                        else OSError(f"{part[0]}: {len(blob)} bytes came for its range {part[1]}-{part[2]}")
                    )
                    again.append(part)
                else:
                    got.append((part, blob))
            if not again:
                return got
            group = again
        assert error is not None
        raise error

    def checked(self, remote: str, files: dict[str, dict], into: Path) -> None:
        """Files of the remote folder `remote` (name -> manifest entry) into the local folder `into`, at
        once (`_get`), each in place only once its digest is the one recorded: else a StoreError
        naming it (`_check`), and nothing of it kept. A shard's files, and the store's own."""
        with held_folder(into, ".fetch-") as temp:
            # a try that failed part way left some files whole: the next fetches the others
            retried(self.shown(remote), lambda: self.get(remote, _not_yet(temp, files), temp), local=self.local)
            for name, meta in files.items():
                self.check(f"{remote}/{name}", is_whole(temp / name, meta))
            for name in files:
                os.replace(temp / name, into / name)

    def shown(self, remote: str) -> str:
        """The remote path `remote` (under the store's root) as messages name it: the store's URL without
        credentials, then the path within the store."""
        return f"{shown(self.url)}/{remote[len(self.root) :].strip('/')}".rstrip("/")

    def check(self, remote: str, ok: bool) -> None:
        """A StoreError naming the remote file unless its download was `ok` (its digest as recorded)."""
        if not ok:
            raise StoreError(
                f"{self.shown(remote)}: not what the store's manifest recorded (its digest differs: "
                "damaged in the bucket or in transfer); it is not used"
            )
