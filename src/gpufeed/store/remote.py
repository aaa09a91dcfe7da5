"""Sharded stores in a bucket (any fsspec URL: `s3://`, `gs://`, `az://`, `https://`, `file://`), read
through a bounded local cache.

Opening reads the manifest, then the store's own files (the labels, the jpeg sizes, fields) at once
and checked as a shard's are (`fetch.Fetcher.checked`), into the cache folder;
a shard is downloaded when first needed or ahead of the epoch plan (`readahead.ReadAhead`), its
manifest checked against the digest the top manifest recorded and each of its files against the
digests in its manifest, then kept until the cache needs room. Every rank of a machine may share
one cache folder: a shard is downloaded once (an exclusive lock per shard while it is fetched), and
a shard in use by any of them (a shared lock) is not evicted. A restarted job finds its verified
shards there. Transient errors are retried with backoff; a shard that keeps failing or whose
digest differs is named in one StoreError; a full cache disk is a StoreError saying so.

URLs are shown without credentials (`shown`), and `storage_options` are never logged.

What runs where: the caller's threads download on demand (`ensure`); a Loader's `ReadAhead`
(`store/readahead.py`: one `gpufeed-fetch` pool of a few threads) downloads ahead of the plan,
never past `cache_limit`, and gives the cache its eviction order (`ShardCache.order`); the requests
themselves are `store/fetch.py`'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpufeed.logs import logger
from gpufeed.store import format as fmt
from gpufeed.store import users
from gpufeed.store.fetch import Fetcher, is_whole, retried
from gpufeed.store.fetch_process import Ended, FetchProcess
from gpufeed.store.format import Manifest, StoreError
from gpufeed.store.locations import filesystem, parse_size, shown, store_url
from gpufeed.store.scratch import held_folder, let_go, reclaim
from gpufeed.store.sharded import ShardedStore, manifest_digest, open_shard
from gpufeed.store.users import Registration, User
from gpufeed.user_cache import user_cache

log = logger(__name__)

WAIT_FOR_ROOM = 120.0  # seconds a download waits for the machine's ranks to let go of shards in a full cache
VERIFIED = ".verified"  # in a shard's cache folder: its digest, written once every file checked


MARKER = ".gpufeed-cache"  # in a cache folder: that gpufeed made it, and for which store (`cache_folder`)


def reclaim_downloads(folder: Path) -> list[str]:
    """Remove the cache folder's downloads that no process finishes: temporary folders of a process
    killed mid-download (a shard's beside the shards, the store's own files' in `top/`), and those of a
    gpufeed before they were held (`store.scratch`); what was removed, as paths in the folder."""
    removed = [f"{fmt.SHARDS}/{name}" for name in reclaim(folder / fmt.SHARDS, r"\.\d+-", legacy=True)]
    removed += [f"top/{name}" for name in reclaim(folder / "top", r"\.fetch-", legacy=True)]
    if removed:
        log.info("gpufeed: removed %d downloads of processes gone from the cache %s", len(removed), folder)
    return removed


def default_cache_dir(url: str) -> Path:
    home = user_cache() / "stores"
    return home / hashlib.sha1(shown(url).encode()).hexdigest()[:16]


def cache_folder(cache_dir: str | os.PathLike | None, url: str) -> Path:
    """The cache folder of the store at `url`: `cache_dir`, or by default one of its own under
    ~/.cache/gpufeed/stores. The cache deletes and writes files there, so it must be a folder gpufeed
    made for this store (its `MARKER` file names the store), or a new or empty one (marked here);
    else a ValueError says why. An empty `cache_dir` (an unset environment variable) made the working
    directory the cache, and a user's `shards/00000/...` was deleted. A default folder made before
    markers were is gpufeed's own, and is marked as it is. Ranks making one folder at once agree: the
    marker appears whole (a link), and only its own temporary files may be beside it in a new folder."""
    where = shown(url)
    if cache_dir is not None and not os.fspath(cache_dir).strip():
        raise ValueError(
            f"{where}: cache_dir is empty (an unset environment variable?): give the folder to cache the "
            "store's shards in, or None for the default (~/.cache/gpufeed/stores)"
        )
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir(url)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{where}: cache_dir {folder} is not a folder") from None
    except OSError as e:
        raise StoreError(f"{where}: cache_dir {folder} can't be made ({e.strerror})") from None
    marker = folder / MARKER
    try:
        if not marker.exists():
            others = sorted(name for name in os.listdir(folder) if not name.startswith(MARKER))
            # another rank marks a new folder before it makes anything in it: what it made means a marker
            if others and cache_dir is not None and not marker.exists():
                shown_others = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
                raise ValueError(
                    f"{where}: cache_dir {folder} holds files gpufeed did not make ({shown_others}), and the "
                    "cache deletes files in its folder: give a new or empty folder (a cache of an older "
                    f"gpufeed has no {MARKER} file: delete it)"
                )
            temp = folder / f"{MARKER}.{os.getpid()}.{threading.get_ident()}"
            temp.write_text(
                f"This folder is gpufeed's cache of a store in a bucket: gpufeed deletes and writes files in it.\n"
                f"store: {where}\n"
            )
            try:
                os.link(temp, marker)  # whole, and the first one made stays
            except FileExistsError:
                pass
            except OSError:  # a filesystem without links
                os.replace(temp, marker)
            finally:
                temp.unlink(missing_ok=True)
        owner = next(
            (line[len("store: ") :] for line in marker.read_text().splitlines() if line.startswith("store: ")), ""
        )
    except OSError as e:
        raise StoreError(f"{where}: cache_dir {folder} can't be used ({e.strerror or e})") from None
    if owner != where:
        raise ValueError(
            f"{where}: cache_dir {folder} is the cache of {owner or 'another store'} ({MARKER} says so): "
            "give each store a cache folder of its own"
        )
    return folder


@dataclass(frozen=True)
class Download:
    """A shard this process downloaded: when it began and ended (`time.monotonic()`), and whether the
    fetch ahead downloaded it (else a batch being read asked for it first, and waited for it; a batch
    may also wait for a shard the fetch ahead is downloading)."""

    shard: int
    began: float
    ended: float
    ahead: bool


class ShardCache:
    """A local folder holding some of a remote sharded store's shards, at most `limit` bytes of them."""

    def __init__(self, fs, root: str, manifest: Manifest, folder: Path, limit: int | None, url: str):
        self.fs, self.root, self.manifest, self.folder, self.limit, self.url = fs, root, manifest, folder, limit, url
        self.fetch = Fetcher(fs, root, url, folder)  # the downloads themselves (no state between them)
        (folder / fmt.SHARDS).mkdir(parents=True, exist_ok=True)
        (folder / "locks").mkdir(exist_ok=True)
        (folder / "reserved").mkdir(exist_ok=True)
        reclaim_downloads(folder)
        self._lock = threading.Lock()
        self._in_use: dict[int, tuple[int, int]] = {}  # shard -> (our uses, fd holding its shared lock)
        # the eviction order, the caller's (`readahead.ReadAhead.places`): each shard this process will
        # read by its place in that reading; none (the default) evicts the least recently used first
        self.order: Callable[[], dict[int, int]] = dict
        self.downloaded = 0  # bytes this process downloaded
        self.fetched = 0  # shards this process downloaded
        # told of each shard this process downloads, on the thread that downloaded it (a benchmark's
        # timeline of the link: benchmarks/remote_bench.py sets it; nothing is kept here)
        self.on_download: Callable[[Download], None] | None = None
        # told a shard's number as its files are asked for (its manifest in and checked), on the thread
        # downloading it: the fetch ahead starts the next shards then (`readahead.ReadAhead._leads_alone`)
        self.on_files: Callable[[int], None] = lambda k: None
        # where the shards' files download: this process's threads, or a process of their own once it is
        # ready (`download_elsewhere`)
        self.elsewhere: FetchProcess | None = None
        self.sizes = [s["bytes"] for s in manifest.shards]  # each shard's bytes, by number
        biggest = max(self.sizes, default=0)
        if limit is not None and limit < biggest:
            raise StoreError(
                f"{shown(url)}: cache_limit {limit} bytes is smaller than its largest shard ({biggest} bytes): raise it"
            )
        self._registration: Registration | None = None  # this process's entry among the folder's readers (`join`)
        self._unregister: Callable[[], object] = lambda: None

    def join(self) -> None:
        """Count this process among the readers of the cache folder (`store.users`), once: a Loader joins
        as it is made, so that the processes sharing the folder see each other and split its limit (a
        store only opened, as `gpufeed inspect` does, reads its top files and joins nothing). ValueError
        where another reader gave another cache_limit."""
        if self._registration is not None:
            return
        # registered before the others are looked at: of two processes joining at once, one sees the other
        registration = Registration(self.folder, self.limit)
        self._registration = registration
        self._unregister = weakref.finalize(self, registration.close)  # at `close`, or when collected
        differ = [user for user in self.others() if user.limit != self.limit]
        if differ:
            self._unregister()
            self._registration = None
            raise ValueError(
                f"{shown(self.url)}: cache_dir {self.folder} is read now by process {differ[0].pid} "
                f"{'on ' + differ[0].host + ' ' if differ[0].host else ''}with cache_limit {differ[0].limit} "
                f"(this one: {self.limit}): the processes sharing a cache folder split one limit; give them "
                "all the same cache_limit, or each a cache_dir of its own"
            )

    def path(self, k: int) -> Path:
        return self.folder / self.manifest.shards[k]["name"]

    def others(self) -> list[User]:
        """The other processes reading through this cache folder now (`store.users`)."""
        return users.others(self.folder, self._registration.path if self._registration is not None else None)

    def present(self, k: int) -> bool:
        marker = self.path(k) / VERIFIED
        try:
            return marker.read_text() == self.manifest.shards[k]["digest"]
        except OSError:
            return False

    def ensure(self, k: int) -> Path:
        """Shard `k` in the cache, verified (downloaded now if it is not), and marked recently used."""
        with self.folder_errors():
            path = self._ensure(k, wait=True)
        assert path is not None  # waiting, it is there or an error says why
        return path

    @contextlib.contextmanager
    def folder_errors(self) -> Iterator[None]:
        """A StoreError naming the cache folder for an error of the block that the folder caused: gone
        (deleted while in use) or not writable (made read-only), or any other error of this disk (an
        OSError, named with its file). A raw FileNotFoundError came out mid-epoch, or "not found" as if
        the bucket had lost the shard, its download's folder removed under it."""
        try:
            yield
        except StoreError:
            unusable = self.unusable()
            if unusable is not None:
                raise StoreError(unusable) from None
            raise
        except OSError as e:
            unusable = self.unusable()
            if unusable is not None:
                raise StoreError(unusable) from None
            what = f"{e.filename}: " if e.filename else ""
            if e.errno == errno.ENOENT:
                why = "gone (deleted while in use?)"
            elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                why = "not writable (made read-only?)"
            else:
                why = e.strerror or str(e)
            raise StoreError(f"{shown(self.url)}: the cache folder {self.folder}: {what}{why}") from None

    def unusable(self) -> str | None:
        """Why the cache folder can't be used now (a folder of it gone, or not writable), or None."""
        for path in (self.folder, self.folder / fmt.SHARDS, self.folder / "locks", self.folder / "reserved"):
            part = "" if path == self.folder else f" ({path.name})"
            if not path.is_dir():
                return (
                    f"{shown(self.url)}: the cache folder {self.folder}{part} is gone (deleted while in use?): "
                    "the cache needs it while the store is read"
                )
            if not os.access(path, os.W_OK | os.X_OK):
                return (
                    f"{shown(self.url)}: the cache folder {self.folder}{part} is not writable (made read-only?): "
                    "the cache writes its downloads there"
                )
        return None

    def _ensure(self, k: int, wait: bool) -> Path | None:
        """`ensure`; without `wait`, None where the cache has no room for it now (nothing is evicted that
        a rank holds)."""
        while True:
            if self.present(k):
                os.utime(self.path(k) / VERIFIED)
                return self.path(k)
            # one process (or thread) of the machine downloads it; the others find it there after. Never
            # blocked on the lock: a rank that holds the shard (a shared lock) keeps it as long as it reads
            fd = os.open(self._lock_path(k), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if not wait:  # being downloaded, or read: nothing to fetch ahead
                    return None
                time.sleep(0.02)
                continue
            try:
                if self.present(k):
                    continue
                reservation = self._make_room(self.sizes[k], k, wait)
                if reservation is None:
                    return None
                try:
                    self._download(k, ahead=not wait)
                finally:
                    reservation.unlink(missing_ok=True)
            finally:
                os.close(fd)  # releases the lock

    def use(self, k: int) -> Path:
        """Shard `k` in the cache and held there (`hold`) until `release(k)`: downloaded first if needed
        (and again, should another process have evicted it between the download and the hold)."""
        while True:
            path = self.ensure(k)
            with self.folder_errors():
                self.hold(k)
            if self.present(k):
                return path
            self.release(k)

    def hold(self, k: int) -> None:
        """Keep shard `k` from eviction (by any process) until `release(k)`: its images are being read.
        Take it with `use` (a hold blocks this process's own download of the shard). The shared lock is
        waited for outside this object's lock: a download of `k` keeps its exclusive lock until it has
        counted its bytes under that one (waiting inside it stopped a loader for good)."""
        with self._lock:
            uses, fd = self._in_use.get(k, (0, -1))
            if fd >= 0:
                self._in_use[k] = (uses + 1, fd)
                return
        fd = os.open(self._lock_path(k), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        with self._lock:
            uses, held = self._in_use.get(k, (0, -1))
            if held >= 0:  # another thread took it meanwhile: one descriptor a shard
                os.close(fd)
                fd = held
            self._in_use[k] = (uses + 1, fd)

    def ensure_if_room(self, k: int) -> Path | None:
        """`ensure` without waiting (a fetch ahead): None where shard `k` is being downloaded or read
        elsewhere, or where the cache has no room for it now (nothing is evicted that a rank holds)."""
        return self._ensure(k, wait=False)

    def holding(self) -> set[int]:
        """The shards this process holds (`hold`)."""
        with self._lock:
            return set(self._in_use)

    def held(self, k: int) -> bool:
        """Whether this process holds shard `k` (`hold`)."""
        with self._lock:
            return k in self._in_use

    def release(self, k: int) -> None:
        with self._lock:
            uses, fd = self._in_use.get(k, (0, -1))
            if uses <= 1:
                self._in_use.pop(k, None)
                if fd >= 0:
                    os.close(fd)
            else:
                self._in_use[k] = (uses - 1, fd)

    def used(self) -> int:
        """Bytes of verified shards in the cache folder (every process's), counted under the lock that
        evictions take: a shard evicted during the count and another fetched in its room would both be
        counted otherwise (a download finishing during it had its room reserved before)."""
        with self.folder_errors(), self._exclusive_path(self.folder / "locks" / "space.lock"):
            return sum(size for k, size in enumerate(self.sizes) if self.present(k))

    def _make_room(self, size: int, k: int, wait: bool) -> Path | None:
        """Reserve `size` bytes for shard `k`'s download, evicting shards that no process holds (in
        `_victims`' order) until they fit beside the shards present and the downloads reserved (by
        every process of the machine: under one lock, each reservation a file naming its process); the
        reservation file, which the caller removes once the shard is in place. Without `wait` (a fetch
        ahead), None where the shards `_victims` lets go, less those a process holds or downloads now,
        cannot make the room: then nothing is evicted (a shard another rank held was counted as room
        once, and the fetch evicted this rank's later shards and still found none)."""
        if self.limit is None:
            return self.folder / "locks" / "unlimited"  # nothing to reserve; unlinking it is harmless
        deadline = time.monotonic() + WAIT_FOR_ROOM
        while True:
            with self._exclusive_path(self.folder / "locks" / "space.lock"):
                # the reservations first: a download that ends between the two looks (its shard marked
                # verified, then its reservation removed, outside this lock) is counted by one of them,
                # or twice; the other way round it was counted by neither, and one shard too many came in
                reserved = self._reserved()
                present = [j for j in range(len(self.manifest.shards)) if j != k and self.present(j)]
                used = sum(self.sizes[j] for j in present) + sum(reserved.values())
                victims = self._victims(present, k, wait)
                if not wait:
                    freeable = sum(self.sizes[j] for j in victims if self._evictable(j))
                    if used - freeable + size > self.limit:
                        return None  # fetching ahead: evicting what may go would not make room, so evict nothing
                for j in victims:
                    if used + size <= self.limit:
                        break
                    if self._evict(j):
                        used -= self.sizes[j]
                if used + size <= self.limit:
                    reservation = self.folder / "reserved" / f"{k:05d}.{os.getpid()}.{threading.get_ident()}"
                    reservation.write_text(str(size))
                    return reservation
                with self._lock:
                    ours = not reserved and all(j in self._in_use for j in present)  # nobody else will let go
            if not wait:
                return None
            if ours or time.monotonic() > deadline:
                raise StoreError(
                    f"{shown(self.url)}: cache_limit {self.limit} bytes holds only the shards in use "
                    f"({used} bytes) and not the next ({size}); raise it"
                )
            time.sleep(0.05)

    def _victims(self, present: list[int], k: int, wait: bool) -> list[int]:
        """Of the `present` shards, those that may go to make room for shard `k`, first to go first: the
        ones this rank will not read, least recently used first (another rank's may be among them),
        then those it reads after `k`, the last read first (for `k` needed now, `wait`: all it reads).
        A fetch ahead evicts none the rank reads before `k`, nor any for a `k` no longer wanted
        (queued before a batch read it). Evicting none the rank will read at all starved the fetch
        ahead from the second epoch of a cache smaller than the store on: the next epoch's order
        wants every shard present again, so each batch downloaded its own shards, one after another
        (55 % of the link against 79 % in the first epoch; docs/benchmarks.md, "Training from a
        bucket")."""
        at = self.order()
        # those read after this place may go (a k no longer wanted ahead: none the rank reads)
        after = -1 if wait else at.get(k, len(at))

        def last_used(j: int) -> float:
            try:
                return (self.path(j) / VERIFIED).stat().st_mtime
            except OSError:  # evicted meanwhile by another process
                return 0.0

        unwanted = sorted((j for j in present if j not in at), key=last_used)
        return unwanted + sorted((j for j in present if at.get(j, -1) > after), key=lambda j: -at[j])

    def _reserved(self) -> dict[Path, int]:
        """The downloads under way on this machine (reservations of living processes), and their sizes."""
        out = {}
        for path in (self.folder / "reserved").iterdir():
            try:
                pid = int(path.name.split(".")[1])
                os.kill(pid, 0)
                out[path] = int(path.read_text() or 0)
            except (ValueError, IndexError, OSError):  # a process that died mid-download: its room is free
                path.unlink(missing_ok=True)
        return out

    @contextlib.contextmanager
    def _alone(self, k: int) -> Iterator[bool]:
        """Whether shard `k` is free to evict, its lock held for the block where it is: no rank of this
        process holds it, and no process holds or downloads it."""
        with self._lock:
            held = k in self._in_use
        if held:
            yield False
            return
        fd = os.open(self._lock_path(k), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
            else:
                yield True
        finally:
            os.close(fd)  # releases the lock, if taken

    def _evictable(self, k: int) -> bool:
        """Whether shard `k` could be evicted now (`_alone`)."""
        with self._alone(k) as alone:
            return alone

    def _evict(self, k: int) -> bool:
        """Remove shard `k` from the cache unless a process holds it; whether it was removed."""
        with self._alone(k) as alone:
            if alone:
                (self.path(k) / VERIFIED).unlink(missing_ok=True)  # not present from here on
                shutil.rmtree(self.path(k), ignore_errors=True)
            return alone

    def _lock_path(self, k: int) -> Path:
        return self.folder / "locks" / f"{k:05d}.lock"

    @staticmethod
    @contextlib.contextmanager
    def _exclusive_path(path: Path) -> Iterator[None]:
        """An exclusive lock on `path` (any process of the machine) while the block runs."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _download(self, k: int, ahead: bool) -> None:
        """Shard `k` into a temporary folder beside its place, every file checked, then moved into place.
        Two round trips: its manifest (which names its files), then all its files at once (`_get`: byte
        ranges from an object store, else fsspec's `get` of a list); one file after another paid the
        link's latency per file, and a cold epoch over a 20 ms link ran at 44 % of a plain parallel
        download (docs/benchmarks.md, "Training from a bucket")."""
        entry = self.manifest.shards[k]
        remote = f"{self.root}/{entry['name']}"
        final = self.path(k)
        began = time.monotonic()
        with held_folder(final.parent, f".{final.name}-") as temp:  # a killed process's: `reclaim`
            retried(
                self.fetch.shown(f"{remote}/{fmt.MANIFEST}"),
                lambda: self.fetch.get(remote, {fmt.MANIFEST: None}, temp),
                local=self.folder,
            )
            ok = manifest_digest(temp / fmt.MANIFEST) == entry["digest"]
            self.fetch.check(f"{remote}/{fmt.MANIFEST}", ok)
            files = Manifest.read(temp).files
            try:
                self.on_files(k)
            except Exception as e:  # noqa: BLE001  (the fetch ahead's; a pool shut at exit) not this download's
                log.debug("gpufeed: told of shard %d's files: %s", k, e)
            self._checked(remote, files, temp)
            shutil.rmtree(final, ignore_errors=True)
            let_go(temp)
            os.replace(temp, final)
            ended = time.monotonic()  # before it is there: a batch reading it may end an epoch
            (final / VERIFIED).write_text(entry["digest"])
            with self._lock:
                self.downloaded += entry["bytes"]
                self.fetched += 1
            told = self.on_download
            if told is not None:
                told(Download(k, began, ended, ahead))

    def _checked(self, remote: str, files: dict, temp: Path) -> None:
        """A shard's files into `temp`, checked: in the download process where it is ready (`elsewhere`),
        else, or where it ended before it answered (its leftovers removed), in this process."""
        away = self.elsewhere
        if away is not None and away.ready():
            try:
                away.checked(remote, files, temp)
                return
            except Ended:
                if away.closed:  # the cache was closed: its downloads stop
                    raise
                for leftover in temp.glob(".fetch-*"):  # (`Fetcher.checked`'s folder, left by the ended process)
                    shutil.rmtree(leftover, ignore_errors=True)
        self.fetch.checked(remote, files, temp)

    def download_elsewhere(self) -> None:
        """Download the shards' files in a process of their own from now on (`store.fetch_process`: no
        thread of this process then stands between them and the link), once it is ready; until then,
        and where its filesystem can't be sent to one (said once), in this process."""
        if self.elsewhere is not None:
            return
        try:
            self.elsewhere = FetchProcess(self.fetch)
        except Exception as e:  # noqa: BLE001 - the process did not start, or a filesystem that does not pickle
            why = "their process did not start" if isinstance(e, OSError) else "its filesystem can't be sent to another"
            log.warning("gpufeed: %s: downloads stay in this process (%s: %s)", shown(self.url), why, e)
            return
        weakref.finalize(self, self.elsewhere.close)

    def close(self) -> None:
        """Let go of the shards this process holds, and leave the folder's readers (and end the download
        process, if any)."""
        with self._lock:
            for _, fd in self._in_use.values():
                os.close(fd)
            self._in_use.clear()
        self._unregister()
        if self.elsewhere is not None:
            self.elsewhere.close()


class RemoteStore(ShardedStore):
    """A sharded store at an fsspec URL, read through a `ShardCache` in `cache_dir` (default under
    ~/.cache/gpufeed/stores; a folder of this store's own: `cache_folder`) of at most `cache_limit`
    bytes (an int or "200GB"; None: no limit)."""

    def __init__(
        self,
        url: str,
        cache_dir: str | Path | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict | None = None,
    ):
        self.url = store_url(url)
        self.fs, root = filesystem(self.url, storage_options)
        root = root.rstrip("/")
        folder = cache_folder(cache_dir, self.url)
        head = folder / "top"
        head.mkdir(exist_ok=True)
        where = shown(self.url)
        raw = retried(f"{where}/{fmt.MANIFEST}", lambda: self.fs.cat_file(f"{root}/{fmt.MANIFEST}"))
        _atomic_write(head / fmt.MANIFEST, raw)
        try:
            manifest = Manifest.read(head)
        except StoreError as e:
            raise StoreError(str(e).replace(str(head), where)) from None
        if manifest.version < fmt.SHARDED_SINCE:
            raise StoreError(
                f"{where}: a store in a bucket must be sharded (pack it with shard_size=..., e.g. "
                '"256MB"): its shards are what the cache downloads'
            )
        self.cache = ShardCache(self.fs, root, manifest, folder, parse_size(cache_limit, "cache_limit"), self.url)
        wanted = {name: meta for name, meta in manifest.files.items() if not is_whole(head / name, meta)}
        if wanted:  # the store's own files (labels, shapes, fields of every sample), as a shard's come
            with self.cache.folder_errors():  # the cache folder unusable: a StoreError naming it
                self.cache.fetch.checked(root, wanted, head)
        super().__init__(head, manifest)
        self.path = Where(where)  # type: ignore[assignment]  # what messages name: the URL (without credentials), not the cache
        self._head = head

    def shard_path(self, k: int) -> Path:
        return self.cache.path(k)

    def shard(self, k: int):
        """Shard `k`, downloaded into the cache first if it is not there (or `pinned`'s). Opening one
        lets go of the shards opened before that are evicted and not held here: their maps kept
        their deleted files on the cache disk, every shard of an epoch over a cache of a few (a batch
        in flight keeps its own)."""
        pinned = self._pins.get(k)
        if pinned is not None:
            return pinned
        opened = self._shards.get(k)
        if opened is None or not self.cache.present(k):
            path = self.cache.ensure(k)
            try:
                with self.cache.folder_errors():
                    opened = self._shards[k] = open_shard(path, self.manifest, k)
            except StoreError:
                if not self.cache.present(k):  # removed as it was opened (a rank's hold keeps gpufeed off it)
                    raise StoreError(
                        f"{self.url_shown}: the cache folder {self.cache.folder}: {path} is gone (deleted while "
                        "in use?)"
                    ) from None
                raise
            for j in [j for j in list(self._shards) if j != k and not self.cache.held(j) and not self.cache.present(j)]:
                self._shards.pop(j, None)
        return opened

    def close(self) -> None:
        self.cache.close()

    def __repr__(self) -> str:
        return f"RemoteStore({self.url_shown!r}, mode={self.mode!r}, count={len(self)}, shards={len(self.starts) - 1})"

    @property
    def url_shown(self) -> str:
        return shown(self.url)


def _atomic_write(path: Path, data: bytes) -> None:
    temp = path.with_name(path.name + ".part")
    temp.write_bytes(data)
    os.replace(temp, path)


class Where(str):
    """A remote store's name in messages (its URL without credentials), joined with `/` as a path is."""

    def __truediv__(self, other: object) -> Where:
        return Where(f"{self}/{other}")
