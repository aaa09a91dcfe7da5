"""Read images where they are, without packing: `Loader("folder/")` for a one-off inference or
evaluation pass.

The source is what `gpufeed.pack` takes (an ImageFolder tree or a flat folder, a CSV/JSONL list),
or uncompressed tar shards, whose members are read at their offsets. An index says where each
image's bytes are, its size (from its header) and its label; it is built once and cached in the
user's cache (~/.cache/gpufeed, never inside the source, where a later `gpufeed pack` of the folder
would meet it), and a later open reads only the headers of files that changed. A cached entry is
used only for the very file it was made from (its size, times and inode) and only where its values
fit that file (its byte count, sides a JPEG can have, pixels its bytes can hold); else the header
is read again. Where no file changed (every image's name and stat as the last open found them), the
columns that open served are taken as they are (`_Served`, checked against the files the same way),
and no entry is read. A large folder (`WALK_PROCESSES_FROM` files) is listed by processes, a part of
its class folders each (`sources.indexer.walk`), which also look at its files where an index exists.
Each batch's bytes are then read into one buffer on threads and go to the same decoders as a jpeg
store's (decode workers read their share from the files themselves).

Every image packing reads is served, with the pixels a jpeg store packed from the folder with its
JPEGs' bytes kept (`reencode=False`, a `max_side` above the largest) gives: an upright RGB baseline
JPEG is read as it is; anything else (PNG, WebP, progressive, CMYK or gray JPEGs, 16-bit images,
photos with an EXIF rotation) is re-encoded once, as packing re-encodes it (`sources.images.
upright_jpeg`), into a folder beside the index, and read from there; later opens reuse it. A file
no decoder can read is reported by path (`store.skipped`, one warning).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import glob
import hashlib
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from gpufeed.decode.base import Encoded
from gpufeed.loader.bytes import WorkerView
from gpufeed.loader.cores import rank_cores
from gpufeed.logs import logger
from gpufeed.sources import (
    TAR_IMAGE_EXTS,
    TAR_SUFFIXES,
    Item,
    Skip,
    SourceError,
    headers,
    indexer,
    open_source,
    tar_key,
    tar_label,
)
from gpufeed.sources.folders import IMAGE_EXTS, IMAGE_WORDS, Run, walk_folder
from gpufeed.sources.headers import JPEG_MAX_SIDE
from gpufeed.store.format import MANIFEST
from gpufeed.user_cache import user_cache

log = logger(__name__)
# an entry: [height, width, bytes] of an image read as it is, [height, width, bytes, 1] of one re-encoded
# into the folder beside the index, or the reason an image can't be read (4: JPEGs cut short are found
# when indexed, as packing finds them; a version 3 index served them, and they failed at each load)
INDEX_VERSION = 4
# the fewest bytes a baseline JPEG of this many pixels can take is above pixels / 256 (each 8x8 block
# costs at least two bits); an entry claiming more pixels than that for its bytes is read again
PIXELS_PER_BYTE = 256
INDEX_RUN = 64  # files a thread indexes per task
PROCESSES_FROM = 20_000  # headers to read from which processes read them (`sources.indexer`; 0.2 s to start)
WALK_PROCESSES_FROM = 100_000  # files from which processes list a folder and look at them (`_apart`)
MAX_INDEX_PROCESSES = 16


@dataclass
class _Listed:
    """One image of the source: its name (path, or shard:key), the file holding it, where in it."""

    name: str
    file: str
    begin: int
    size: int
    label: int


@dataclass
class _Listing:
    """A source's images as columns (a `_Listed` each would be 50,000 objects more to make): their names,
    the files holding them, where each begins there and its bytes (-1: the whole file), their labels;
    the source's classes; what it skipped, by path and reason."""

    names: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    begins: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    unique_files: bool = False  # each image a file of its own (a walked folder; a list may name one twice)
    looks: np.ndarray | None = None  # each image's file's look (`headers.file_looks`), where the listing took them

    def add(self, name: str, file: str, begin: int, size: int, label: int) -> None:
        self.names.append(name)
        self.files.append(file)
        self.begins.append(begin)
        self.sizes.append(size)
        self.labels.append(label)

    def item(self, k: int) -> _Listed:
        return _Listed(self.names[k], self.files[k], self.begins[k], self.sizes[k], self.labels[k])


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def index_cached(source: str | os.PathLike) -> bool:
    """Whether an index of the folder, list or tar shards `source` is cached (an open reads no header
    but those of files changed since)."""
    return _cache_path(Path(os.fspath(source))).exists()


def is_folder_source(path: str | os.PathLike) -> bool:
    """Whether `path` names something to read in place rather than a store."""
    text = os.fspath(path)
    p = Path(text)
    if glob.has_magic(text) or text.lower().endswith((".csv", ".jsonl", *TAR_SUFFIXES)):
        return True
    return p.is_dir() and not (p / MANIFEST).exists()


class FolderStore:
    """The images of a folder, list or tar shards, read in place: what a `Loader` needs of a jpeg
    store (len, labels, classes, shapes, sources, and `read` for a batch's bytes)."""

    mode = "jpeg"
    image_shape = None
    fields: dict = {}
    reads_ahead = True  # a `ByteSource` whose batches are read from files: worth starting a batch early
    reads_in_part = True  # only what the loader's own decoders likely take is read ahead (`read_later`)

    def __init__(self, source: str | os.PathLike, threads: int | None = None):
        self.path = Path(os.fspath(source))
        self._threads = threads or min(16, 4 * (os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gpufeed-folder")
        # 50,000 files make a few hundred thousand objects here: the collector's passes over them took a
        # fifth of an open from the cached index (paused for the listing and the arranging alone: not
        # while headers are read and images re-encoded on threads, which can take a cold build's 20 s)
        with _collector_paused():
            cache_path = _cache_path(self.path)
            warm = cache_path.exists()  # the entries are for files as they were: look at each file first
            listing = _list(os.fspath(source), look=warm)
            self.classes = listing.classes
            self.upright = cache_path.with_suffix(".upright")  # the images re-encoded, as packing would
            served_path = cache_path.with_suffix(".served.npz")
            upright = os.fspath(self.upright)
            sizes, files = listing.sizes, listing.files
            keys: list[str | None] = [None] * len(files)
            looks = np.empty((len(files), 5), np.int64)  # each image's file's look, as its key says
            if warm:
                looks = listing.looks if listing.looks is not None else _looks(listing)
                served = _load_served(served_path, listing, looks, upright)
                if served is not None:  # nothing changed since it was kept: served as it was
                    self._serve(listing, served, functools.partial(_key, listing, looks), upright, newly=0)
                    return
                keys[:] = [headers.index_key(name, look) for name, look in zip(listing.names, looks.tolist())]
            # (an index another rank wrote while this open listed the folder is not taken: its files
            # were not looked at)
            cached = _load(cache_path) if warm else {}

            def made_now(k: int) -> str:
                return headers.upright_path(upright, keys[k])  # type: ignore[arg-type]

            # a cold build (no entries): each file's stat is taken as it is opened
            fresh = (
                [k for k, key in enumerate(keys) if not _fits(cached.get(key), sizes[k], int(looks[k, 0]), made_now, k)]
                if cached
                else list(range(len(files)))
            )
            if not cached:
                keys = [None] * len(files)
        jobs = [headers.Job(files[k], listing.begins[k], sizes[k], listing.names[k], upright, keys[k]) for k in fresh]
        for k, (entry, key, look) in zip(fresh, self._entries(jobs)):
            keys[k] = key
            cached[key] = entry
            if look is not None:  # (a key made as its header was read: from this look)
                looks[k] = look
        known: list[str] = keys  # type: ignore[assignment]  # every image's, now

        if fresh or len(cached) != len(known):  # new entries, or ones of files gone
            _save(cache_path, {key: cached[key] for key in known})
            _prune(self.upright, {headers.upright_name(key) for key in known if _reencoded(cached[key])})
        with _collector_paused():
            served = _Served.of([cached[key] for key in known], listing.names, looks)
            newly = sum(_reencoded(cached[known[k]]) for k in fresh)
            self._serve(listing, served, known.__getitem__, upright, newly)
        _save_served(served_path, served)

    def _entries(self, jobs: list[headers.Job]) -> list[headers.Indexed]:
        """The index entries and keys of `jobs`: by processes where there are many and this rank has
        the cores (`sources.indexer`; what Pillow there can't identify, maybe a format a plugin of this
        process reads, again here), else on the folder's threads, a run of files per task."""
        processes = min(MAX_INDEX_PROCESSES, rank_cores().usable)
        if len(jobs) >= PROCESSES_FROM and processes > 1:
            try:
                found = indexer.entries(jobs, processes)
            except (indexer.IndexFailed, OSError) as e:
                log.warning("gpufeed: %s: index processes failed (%s); indexed on threads (slower)", self.path, e)
            else:
                again = [k for k, f in enumerate(found) if f.entry == headers.UNIDENTIFIED]
                redone = self._on_threads([jobs[k]._replace(key=found[k].key) for k in again])
                for k, f in zip(again, redone):
                    found[k] = f._replace(look=found[k].look)  # (the key's, from the process)
                return found
        return self._on_threads(jobs)

    def _on_threads(self, jobs: list[headers.Job]) -> list[headers.Indexed]:
        def index(run: list[headers.Job]) -> list[headers.Indexed]:
            return [_index(job) for job in run]

        runs = [jobs[a : a + INDEX_RUN] for a in range(0, len(jobs), INDEX_RUN)]  # a task per file cost more
        return [found for part in self._pool.map(index, runs) for found in part]

    def _serve(self, listing: _Listing, served: _Served, key: Callable[[int], str], upright: str, newly: int) -> None:
        """The served images' columns (`served`: which of the listing's images, their sizes and bytes,
        which are read re-encoded from `upright`, named by their keys, `key(k)` image k's), the skipped
        ones named, each said once; `newly`: images re-encoded by this open."""
        listed = listing.names
        kept, again = served.kept.tolist(), served.again.tolist()
        self.reencoded = sum(again)
        if newly:
            log.warning(
                "gpufeed: %s: %d image(s) the JPEG decoders can't read as they are (PNG, WebP, progressive, "
                "CMYK or gray JPEGs, EXIF-rotated photos) re-encoded once into %s, as `gpufeed pack` would; "
                "later opens reuse them",
                self.path,
                newly,
                self.upright,
            )
        self.skipped = listing.skipped + [
            {"path": listed[k], "reason": reason} for k, reason in zip(served.dropped.tolist(), served.reasons)
        ]
        if self.skipped:
            shown = "; ".join(f"{s['path']}: {s['reason']}" for s in self.skipped[:3])
            log.warning(
                "gpufeed: %s: %d file(s) not read (%s%s); `loader.store.skipped` lists them",
                self.path,
                len(self.skipped),
                shown,
                " ..." if len(self.skipped) > 3 else "",
            )
        if not kept:
            raise SourceError(f"{self.path}: no image this loader can read (and not a gpufeed store)")
        everything = len(kept) == len(listed)
        self._names = listed if everything else [listed[k] for k in kept]
        if any(again):
            where_read = [headers.upright_path(upright, key(k)) if a else listing.files[k] for k, a in zip(kept, again)]
        else:
            where_read = listing.files if everything else [listing.files[k] for k in kept]
        # (in the listing's order; a tar shard holds many images, a walked folder's files one each, and
        # their re-encoded copies are named by their keys)
        n = len(kept)
        if listing.unique_files:  # a file an image: each its own
            files, self._file_of = where_read, np.arange(n, dtype=np.int64)
        else:
            files, self._file_of = _numbered(where_read)
        self._files = np.array(files, dtype=object)
        self._begins = np.where(served.again, 0, np.asarray(listing.begins, np.int64)[served.kept])
        self.shapes, self._sizes = served.hwb[:, :2], served.hwb[:, 2].copy()
        self._labels = np.asarray(listing.labels, np.int64)[served.kept]

    @property
    def labels(self) -> torch.Tensor:
        return torch.from_numpy(self._labels)

    @property
    def files(self) -> list[str]:
        """The files images are read from (tar shards hold several), as `Encoded.file_index` numbers them."""
        return self._files.tolist()

    @property
    def nbytes(self) -> int:
        return int(self._sizes.sum())

    @functools.cached_property
    def digest(self) -> str:
        """The identity of what is served (SHA-256, hex), as a store's `digest`: each image's name, label,
        size and byte count, in order. A Loader's `state_dict` keeps it: a resume on a folder whose
        images changed (added, removed, renamed or relabelled) is refused."""
        h = hashlib.sha256()
        for part in (self._labels, self.shapes, self._sizes):
            h.update(np.ascontiguousarray(part, "<i8").tobytes())
        if self._names:  # (each name and a NUL after it, in one update: 1.28M of them took 0.5 s one by one)
            h.update(("\0".join(self._names) + "\0").encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self._names)

    def opened(self, indices: np.ndarray) -> None:
        """None: a folder has no shards (`ByteSource.opened`)."""
        return None

    def ready(self, indices: np.ndarray) -> bool:
        return True  # (files on a disk: read when asked)

    def source(self, i: int) -> str:
        """Where sample `i` is: its path, or `shard.tar:key`."""
        return self._names[i]

    def for_workers(self) -> WorkerView:
        """Decode workers read their images from these files themselves (board rows name them by number)."""
        return WorkerView(files=self.files)

    def column(self, name: str):
        raise KeyError(f"{self.path}: no field {name!r} (a folder read in place has: label, source)")

    def read(self, indices: np.ndarray) -> Encoded:
        """The bytes of images `indices` back to back in one buffer, read on threads, with each image's
        file and where it starts there (for decode workers). An image whose file can't be read is left
        empty: its decoder then fails, and the loader replaces it (training) or leaves it out and names
        it (evaluation), as for a damaged store."""
        return self.read_later(indices)()

    def read_later(self, indices: np.ndarray, first: np.ndarray | None = None) -> Callable[[], Encoded]:
        """Start `read(indices)` on the threads and return at once; the returned call waits for it.
        `first`: only the images at these positions are read now (those this process decodes: the GPU
        decoders' likely share), the others when a decoder here asks (`Encoded.readable`); the decode
        workers read theirs from the files themselves."""
        sizes = self._sizes[indices]
        ends = np.cumsum(sizes)
        begins = ends - sizes
        buffer = np.empty(int(ends[-1]) if len(ends) else 0, np.uint8)
        file_index = self._file_of[indices]
        files = self._files[file_index]
        at = self._begins[indices]
        read = np.zeros(len(indices), bool)  # per position: its bytes are in `buffer`

        def some(ks: list[int]) -> None:
            for k in ks:
                # (numpy's stubs give an ndarray the buffer protocol from Python 3.12 on)
                view = memoryview(buffer)[int(begins[k]) : int(ends[k])]  # type: ignore[arg-type, unused-ignore]
                try:
                    # never blocks: a FIFO put in a file's place fails (no seek), a device gives at
                    # most the bytes asked for; either is then undecodable, as a damaged file
                    fd = os.open(files[k], os.O_RDONLY | os.O_NONBLOCK)
                    try:
                        got = os.preadv(fd, [view], int(at[k]))
                    finally:
                        os.close(fd)
                except OSError:
                    got = 0
                if got < len(view):
                    view[:] = b"\0" * len(view)  # changed since indexed: undecodable, replaced
                read[k] = True

        def fill(part: Encoded) -> None:  # the images of this batch in `part` not read yet, read now
            # (each image with bytes is the last position at its `begins`; an empty one needs none)
            ks = np.searchsorted(begins, part.begins[part.ends > part.begins], side="right") - 1
            some(ks[~read[ks]].tolist())

        # a run of files per thread, not a task per file: each task's hand-over takes the GIL from the
        # training thread, and per file that made a folder's pass half as fast as its packed store's
        # (85ef19c; docs/benchmarks.md, "Reading a folder in place": 8.7k img/s against 5.8k; fewer runs
        # than threads were tried: one call favoured 4 on page-cached photos, another did not, and files
        # read from a network filesystem or a cold disk want reads in flight)
        now = list(range(len(indices))) if first is None else np.sort(first).tolist()
        n, runs = len(now), self._threads
        step = max(1, -(-n // runs))
        pending = [self._pool.submit(some, now[a : a + step]) for a in range(0, n, step)]

        def done() -> Encoded:
            for job in pending:
                job.result()
            later = None if first is None or read.all() else fill
            return Encoded(torch.from_numpy(buffer), buffer, begins, ends, file_index, at, later)

        return done

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"FolderStore({str(self.path)!r}, count={len(self)})"


def _list(source: str, look: bool) -> _Listing:
    """The source's images (tar members at their offsets), its classes, and what it skipped; `look`: a
    large folder's files looked at as they are listed, by the processes that list them (`_apart`)."""
    lower = source.lower()
    if glob.has_magic(source) or lower.endswith(".tar"):
        return _list_tars(sorted(glob.glob(source)) if glob.has_magic(source) else [source])
    if lower.endswith(TAR_SUFFIXES):  # .tar was taken above: a compressed one
        raise SourceError(f"{source}: a compressed tar can't be read in place; `gpufeed pack` it")
    if os.path.isdir(source):  # listed at every open: as plain paths, a run a class folder
        walked = walk_folder(Path(source), apart=functools.partial(_apart, source, look))
        listing = _Listing(classes=walked.classes)
        names, labels, skipped = listing.names, listing.labels, listing.skipped
        paths = [run.paths() for run in walked.runs]
        for run, found in zip(walked.runs, paths):
            if len(found) < len(run.found):
                skipped += [{"path": f.name, "reason": f.reason} for f in run.found if isinstance(f, Skip) and f.fatal]
            names += found
            labels += [run.label] * len(found)
        listing.files, listing.unique_files = list(names), True  # (a file an image, named by its path)
        if look and any(run.looks is not None for run in walked.runs):  # (runs walked here: looked at here)
            looks = [
                run.looks if run.looks is not None else headers.file_looks(p) for run, p in zip(walked.runs, paths)
            ]
            listing.looks = np.concatenate(looks)
    else:
        src = open_source(source)
        listing = _Listing(classes=src.classes)
        names, labels, skipped = listing.names, listing.labels, listing.skipped
        for entry in src.entries:
            if isinstance(entry, Skip):
                if entry.fatal:
                    skipped.append({"path": entry.name, "reason": entry.reason})
            elif isinstance(entry, Item) and entry.path is not None:
                names.append(entry.name)
                listing.files.append(entry.path)
                labels.append(entry.label)
    n = len(listing.files)
    listing.begins, listing.sizes = [0] * n, [-1] * n
    return listing


def _apart(source: str, look: bool, folders: list[str]) -> list[Run] | None:
    """A large folder's class `folders` walked (and, where `look`, their files looked at) by processes
    (`sources.indexer.walk`), or None: a folder of fewer than `WALK_PROCESSES_FROM` files by the
    count of its first, middle and last class folders (processes take ~0.2 s to start), one core, or
    processes that failed (said in a warning; walked here then)."""
    processes = min(MAX_INDEX_PROCESSES, rank_cores().usable, len(folders))
    if processes < 2:
        return None
    sampled = [folders[0], folders[len(folders) // 2], folders[-1]]
    try:
        likely = len(folders) * sum(len(os.listdir(f)) for f in sampled) / len(sampled)
    except OSError:
        return None
    if likely < WALK_PROCESSES_FROM:
        return None
    try:
        return indexer.walk(folders, IMAGE_EXTS, IMAGE_WORDS, processes, look)
    except (indexer.IndexFailed, OSError) as e:
        log.warning("gpufeed: %s: listing processes failed (%s); listed here (slower)", source, e)
        return None


def _list_tars(shards: list[str]) -> _Listing:
    listing = _Listing()
    skipped = listing.skipped
    for shard in shards:
        try:
            with tarfile.open(shard, mode="r:") as tar:
                members: dict[str, dict[str, tarfile.TarInfo]] = {}
                for m in tar:
                    named = tar_key(m.name) if m.isfile() else None
                    if named is not None:
                        members.setdefault(named[0], {})[named[1]] = m
                for key, parts in members.items():
                    image = next((parts[e] for e in TAR_IMAGE_EXTS if e in parts), None)
                    name = f"{shard}:{key}"
                    if image is None:
                        skipped.append({"path": name, "reason": f"no image member ({', '.join(TAR_IMAGE_EXTS)})"})
                        continue
                    try:
                        # a regular file's member (extractfile gives None for others)
                        cls = tar.extractfile(parts["cls"]).read() if "cls" in parts else None  # type: ignore[union-attr]
                        label = tar_label(cls)
                    except ValueError as e:  # as packing skips it
                        skipped.append({"path": name, "reason": str(e)})
                        continue
                    listing.add(name, shard, image.offset_data, image.size, label)
        except (OSError, tarfile.TarError) as e:
            raise SourceError(f"{shard}: not an uncompressed tar this loader can read in place ({e})") from None
    return listing


@dataclass
class _Served:
    """What an open serves of a listing, kept beside the index (`_save_served`) so that the next open
    of an unchanged source takes it as it is: the listing's images served (`kept`, in order) with
    their height, width and bytes (`hwb`) and whether each is read re-encoded (`again`); those not
    served (`dropped`) and why (`reasons`); the fingerprint of the keys (each image's name and its
    file's stat) it was made for."""

    kept: np.ndarray
    hwb: np.ndarray
    again: np.ndarray
    dropped: np.ndarray
    reasons: list[str]
    fingerprint: bytes

    @staticmethod
    def of(entries: list, names: list[str], looks: np.ndarray) -> _Served:
        """From each listed image's index entry, under its name and its file's look."""
        kept = [k for k, e in enumerate(entries) if isinstance(e, list)]
        dropped = [k for k, e in enumerate(entries) if not isinstance(e, list)]
        n = len(kept)
        hwb = np.fromiter(chain.from_iterable(entries[k][:3] for k in kept), np.int64, 3 * n).reshape(n, 3)
        again = np.fromiter((_reencoded(entries[k]) for k in kept), bool, n)
        reasons = [entries[k] for k in dropped]
        return _Served(
            np.asarray(kept, np.int64),
            hwb,
            again,
            np.asarray(dropped, np.int64),
            reasons,
            _fingerprint(names, looks),
        )


SERVED_VERSION = 2  # 1: the fingerprint of the keys' text


def _fingerprint(names: list[str], looks: np.ndarray) -> bytes:
    """SHA-256 of the index's version, every image's name and its file's look (`headers.file_looks`),
    in order: the same only for the same listing of the same files, each as it was (its size, times
    and inode). From the looks as numbers: a key's text a file took a third of a warm open."""
    digest = hashlib.sha256(f"{INDEX_VERSION}\0{len(names)}\0".encode())
    digest.update("\0".join(names).encode("utf-8", "surrogatepass"))
    digest.update(np.ascontiguousarray(looks, np.int64).tobytes())
    return digest.digest()


def _key(listing: _Listing, looks: np.ndarray, k: int) -> str:
    """Image `k`'s index key (`headers.index_key`)."""
    return headers.index_key(listing.names[k], looks[k].tolist())


def _save_served(path: Path, served: _Served) -> None:
    """Write `served` atomically beside the index (`np.savez`, no pickles); one that can't be written
    only makes the next open take the longer way."""
    written = None
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".gpufeed-served-", suffix=".npz", delete=False) as f:
            written = f.name
            np.savez(
                f,
                version=np.array([SERVED_VERSION], np.int64),
                fingerprint=np.frombuffer(served.fingerprint, np.uint8),
                kept=served.kept,
                hwb=served.hwb,
                again=served.again,
                dropped=served.dropped,
                reasons=np.frombuffer(json.dumps(served.reasons).encode("utf-8", "surrogatepass"), np.uint8),
            )
        os.replace(written, path)
    except OSError as e:
        if written is not None:
            Path(written).unlink(missing_ok=True)
        log.info("gpufeed: no served-images cache written for a folder read in place (%s)", e)


def _looks(listing: _Listing) -> np.ndarray:
    """Each listed image's file's look (`headers.file_looks`), each file looked at once (a tar shard
    holds many images; a file a walked folder lists is its only image's)."""
    if listing.unique_files:
        return headers.file_looks(listing.files)
    unique, number = _numbered(listing.files)
    return headers.file_looks(unique)[number]


def _numbered(items: list[str]) -> tuple[list[str], np.ndarray]:
    """The distinct `items` in the order they first come, and each item's number among them."""
    where: dict[str, int] = {}
    number = np.fromiter((where.setdefault(x, len(where)) for x in items), np.int64, len(items))
    return list(where), number


def _load_served(path: Path, listing: _Listing, looks: np.ndarray, upright: str) -> _Served | None:
    """The served images an earlier open kept for exactly this listing as it is now, each file as
    `looks` found it, or None: none kept, another listing or file changed, or anything in it not what
    an open of this listing could have made (an image's sides a JPEG can't have, pixels its bytes
    can't hold, bytes other than its file's or re-encoded copy's): it is untrusted, as the index is."""
    try:
        with np.load(path, allow_pickle=False) as z:
            version, fingerprint = z["version"], z["fingerprint"].tobytes()
            kept, hwb, again, dropped = z["kept"], z["hwb"], z["again"], z["dropped"]
            reasons = json.loads(z["reasons"].tobytes().decode("utf-8", "surrogatepass"))
    except Exception:  # noqa: BLE001  missing, cut short, not an npz of these arrays: the longer way
        return None
    n = len(listing.names)
    if not (
        version.shape == (1,)
        and int(version[0]) == SERVED_VERSION
        and fingerprint == _fingerprint(listing.names, looks)
        and kept.dtype == dropped.dtype == hwb.dtype == np.int64
        and again.dtype == np.bool_
        and kept.ndim == dropped.ndim == again.ndim == 1
        and hwb.shape == (len(kept), 3)
        and again.shape == kept.shape
        and isinstance(reasons, list)
        and len(reasons) == len(dropped)
        and all(isinstance(r, str) for r in reasons)
        and len(kept) + len(dropped) == n
        and np.array_equal(np.sort(np.concatenate([kept, dropped])), np.arange(n))
        and not (np.diff(kept) <= 0).any()
    ):
        return None
    h, w, got = hwb[:, 0], hwb[:, 1], hwb[:, 2]
    sides = (h >= 1) & (h <= JPEG_MAX_SIDE) & (w >= 1) & (w <= JPEG_MAX_SIDE)
    if not (sides & (got >= 1) & (got <= 1 << 40) & (h * w <= PIXELS_PER_BYTE * got)).all():
        return None
    # each image's bytes: its tar member's, its file's (the size its stat key begins with), or its
    # re-encoded copy's
    member = np.asarray(listing.sizes, np.int64)[kept]
    whole = np.flatnonzero((member < 0) & ~again)
    try:
        member[whole] = looks[kept[whole], 0]  # (-1 for a file gone: no image has that many bytes)
        for j in np.flatnonzero(again).tolist():
            member[j] = os.stat(headers.upright_path(upright, _key(listing, looks, int(kept[j])))).st_size
    except (OSError, ValueError):
        return None
    if not np.array_equal(member, got):
        return None
    return _Served(kept, hwb, again, dropped, reasons, fingerprint)


def _reencoded(entry: list[int] | str) -> bool:
    return isinstance(entry, list) and len(entry) == 4


def _fits(entry: object, size: int, file_bytes: int, made: Callable[[int], str], k: int) -> bool:
    """Whether a cached entry can stand for image `k` (`size` bytes at its place in a tar shard, -1: a
    whole file of `file_bytes`; the file missing: -1) without reading its header again: a reason it was not served, or
    [height, width, bytes] of ints (a 1 after them if re-encoded) with the bytes the file or member has
    (or its re-encoded copy, at `made(k)`, has), sides a JPEG can have, and no more pixels than those
    bytes can encode. Anything else in the cache is read again from the image, not trusted."""
    if isinstance(entry, str):
        return True
    if type(entry) is not list or file_bytes < 0:
        return False
    if len(entry) == 3:
        h, w, got = entry
        again = False
    elif len(entry) == 4:
        h, w, got, flag = entry
        again = True
        if type(flag) is not int or flag != 1:
            return False
    else:
        return False
    if type(h) is not int or type(w) is not int or type(got) is not int:  # (not bool, float or str)
        return False
    if again:
        try:
            expected = os.stat(made(k)).st_size
        except OSError:
            return False
    else:
        expected = size if size >= 0 else file_bytes
    return got == expected and 1 <= h <= JPEG_MAX_SIDE and 1 <= w <= JPEG_MAX_SIDE and h * w <= PIXELS_PER_BYTE * got


def _index(job: headers.Job) -> headers.Indexed:
    """`job`'s index entry and key (`headers.entry`), on one of the folder's threads."""
    return headers.entry(job)


def _prune(folder: Path, kept: set[str]) -> None:
    """Remove the re-encoded images no entry names any more (their file changed or went), and copies a
    killed index left half-written over an hour ago (a newer one may be another process's, writing)."""
    try:
        gone = [p for p in folder.glob("*.jpg") if p.name not in kept]
        old = time.time() - 3600
        gone += [p for p in folder.glob(".gpufeed-*.part") if p.stat().st_mtime < old]
    except OSError:
        return
    for p in gone:
        p.unlink(missing_ok=True)


def _cache_path(source: Path) -> Path:
    """In the user's cache ($XDG_CACHE_HOME or ~/.cache, then gpufeed/), named by the source's absolute
    path: never inside the source, which may be read-only, shared or packed later."""
    return user_cache() / f"index-{hashlib.sha1(os.fsencode(source.absolute())).hexdigest()[:16]}.json"


def _load(path: Path) -> dict:
    """The cached entries by key, {} for a cache of another version or form; each entry is checked
    where it is used (`_fits`)."""
    try:
        data = json.loads(path.read_text())
        entries = data["entries"] if data.get("version") == INDEX_VERSION else {}
        return dict(entries) if isinstance(entries, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _save(path: Path, entries: dict) -> None:
    """Write the index atomically; a cache that can't be written is only slower next time."""
    written = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".gpufeed-index-", delete=False) as f:
            written = f.name
            f.write(json.dumps({"version": INDEX_VERSION, "entries": entries}))  # (json.dump: no C encoder)
        os.replace(written, path)
    except OSError as e:
        if written is not None:  # a half-written file is not left beside the images
            Path(written).unlink(missing_ok=True)
        log.info("gpufeed: no index cache written for a folder read in place (%s)", e)
