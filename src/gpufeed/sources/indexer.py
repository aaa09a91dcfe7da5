"""A large folder's index made by processes: `entries` splits the images among `processes` fresh
interpreters (`python -m gpufeed.sources.indexer`), each reading its run of headers
(`headers.entry`); `walk` splits a large folder's class folders among them, each listing its part
and looking at each file found (`headers.file_looks`), for an open from the cached index.

Why processes: reading a header is mostly Python (the marker walk, the entry), which holds the GIL,
so threads of one process index no faster than one thread with the page cache warm
(docs/benchmarks.md, "Reading a folder in place"); ImageNet's 1.28M files on one core take over a minute,
and their listing and stats alone ~6 s. Why exec and not multiprocessing: as the decode workers
(`decode.pool.spawn`), a process started with exec shares no threads or locks with the loader's and
never imports the user's `__main__`. It imports no torch (0.2 s to start). It reads its `Request`
(pickled: Pillow's settings, its run of `headers.Job`s) or `Walk` from stdin, writes its `Answer`
(their entries and keys) or `WalkedRuns`, pickled, to stdout, and exits; it also exits within a
quarter second of its parent going away.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageFile

from gpufeed.processes import child_env, watch_parent
from gpufeed.sources import headers
from gpufeed.sources.entries import Skip
from gpufeed.sources.folders import Run, walk_run
from gpufeed.sources.headers import Indexed, Job


class IndexFailed(Exception):
    """An index process ended without its entries or listing (it was killed, or could not start)."""


IN_FLIGHT = 16  # headers read at once over all the processes: a cold page cache waits on the disk


def entries(jobs: Sequence[Job], processes: int) -> list[Indexed]:
    """Each job's index entry (`headers.entry`), made by `processes` processes at once, in the jobs'
    order, each reading on `IN_FLIGHT // processes` threads (one: the GIL's, with the page cache warm;
    more overlap a cold cache's reads). Raises IndexFailed, naming the process, where one ends
    without its entries."""
    threads = max(1, IN_FLIGHT // max(1, processes))
    # what of Pillow's state decides an entry goes with the request (its plugins can't: the caller
    # indexes again what the processes' Pillow did not identify)
    pillow: dict[str, Any] = {
        "MAX_IMAGE_PIXELS": Image.MAX_IMAGE_PIXELS,
        "LOAD_TRUNCATED_IMAGES": ImageFile.LOAD_TRUNCATED_IMAGES,
    }
    answers = _answered([Request.of(pillow, run) for run in _parts(list(jobs), processes)], threads)
    return [Indexed(e, k, look) for got in answers for e, k, look in zip(got.entries, got.keys, got.looks)]


def walk(folders: list[str], exts: frozenset[str], skipped_as: str, processes: int, look: bool) -> list[Run]:
    """Each of `folders` (a large folder's class folders) walked on its own (`folders.walk_run`) by
    `processes` processes at once, a contiguous part each, and where `look`, each path's look
    (`headers.file_looks`): the walk and the looks of ImageNet's 1.28M files are Python a file, on
    one core ~6 s. Raises IndexFailed as `entries` does."""
    answers = _answered([Walk(part, sorted(exts), skipped_as, look) for part in _parts(folders, processes)], 1)
    return [run for got in answers for run in got.runs]


def _parts(items: list, processes: int) -> list[list]:
    """`items` in at most `processes` contiguous parts of the same length (the last shorter)."""
    step = -(-len(items) // max(1, processes))
    return [items[a : a + step] for a in range(0, len(items), step)]


def _answered(requests: list, threads: int) -> list:
    """Each request's answer, from a process of its own, all at once; the processes are stopped on any
    error (Ctrl-C, or one failed or did not start), not waited for."""
    env = child_env()
    procs: list[subprocess.Popen] = []
    pool = ThreadPoolExecutor(len(requests), thread_name_prefix="gpufeed-index")
    try:
        for _ in requests:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gpufeed.sources.indexer", str(os.getpid()), str(threads)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    close_fds=True,
                )
            )
        asked = [pool.submit(_ask, proc, request) for proc, request in zip(procs, requests)]
        return [f.result() for f in asked]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        pool.shutdown(wait=True)
        for proc in procs:
            proc.wait()


@dataclass
class Request:
    """What an index process is asked: Pillow's settings to take, and its run of images as columns of
    `headers.Job`'s fields (a pipe carries a few lists faster than an object per image)."""

    what = "entries"  # (what a process that failed did not give, for its message)
    pillow: dict[str, Any]  # (Image.MAX_IMAGE_PIXELS: int | None; ImageFile.LOAD_TRUNCATED_IMAGES: bool)
    files: list[str]
    begins: list[int]
    sizes: list[int]
    names: list[str]
    uprights: list[str]
    keys: list[str | None]

    @classmethod
    def of(cls, pillow: dict[str, Any], jobs: list[Job]) -> Request:
        return cls(
            pillow,
            [j.file for j in jobs],
            [j.begin for j in jobs],
            [j.size for j in jobs],
            [j.name for j in jobs],
            [j.upright for j in jobs],
            [j.key for j in jobs],
        )

    def jobs(self) -> list[Job]:
        columns = zip(self.files, self.begins, self.sizes, self.names, self.uprights, self.keys)
        return [Job(*fields) for fields in columns]

    def fits(self, got: object) -> bool:
        return isinstance(got, Answer) and len(got.entries) == len(got.keys) == len(got.looks) == len(self.files)


@dataclass
class Answer:
    """An index process's entries, keys and looks (`headers.Indexed`'s fields), as columns in its run's
    order."""

    entries: list[list[int] | str]
    keys: list[str]
    looks: list[headers.Look | None]


@dataclass
class Walk:
    """What a walking process is asked: its class folders, the extensions taken, whether to look at
    each file found (`headers.file_looks`)."""

    what = "listing"
    folders: list[str]
    exts: list[str]
    skipped_as: str  # what a file of other extensions is not (`folders.IMAGE_WORDS`)
    look: bool

    def fits(self, got: object) -> bool:
        return (
            isinstance(got, WalkedRuns)
            and len(got.runs) == len(self.folders)
            and all(
                isinstance(run, Run)
                and isinstance(run.found, list)
                and all(type(f) is str or type(f) is Skip for f in run.found)
                and isinstance(run.dirs, list)
                and all(type(d) is tuple and len(d) == 2 and type(d[0]) is type(d[1]) is int for d in run.dirs)
                and (
                    run.looks is None
                    if not self.look
                    else isinstance(run.looks, np.ndarray)
                    and run.looks.dtype == np.int64
                    and run.looks.shape == (len(run.paths()), 5)
                )
                for run in got.runs
            )
        )


@dataclass
class WalkedRuns:
    """A walking process's runs, one a class folder, in its request's order."""

    runs: list[Run]


def _ask(proc: subprocess.Popen, request: Request | Walk) -> Answer | WalkedRuns:
    """Send `request` to `proc` and read back its answer."""
    out, err = proc.communicate(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
    if proc.returncode != 0:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise IndexFailed(f"index process {proc.pid} ended without its {request.what} ({why[0]})")
    try:
        got = pickle.loads(out)
    except Exception as e:  # noqa: BLE001  whatever a broken pipe's bytes unpickle to
        raise IndexFailed(f"index process {proc.pid} answered unreadably ({type(e).__name__})") from None
    if not request.fits(got):
        raise IndexFailed(f"index process {proc.pid} answered {type(got).__name__}, not what it was asked")
    return got


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle
    watch_parent(int(sys.argv[1]))
    request = pickle.load(sys.stdin.buffer)
    # (this module runs as __main__ here: the request came, and the answer goes, as the classes the
    # caller imported)
    from gpufeed.sources import indexer as named

    if isinstance(request, named.Walk):
        exts = frozenset(request.exts)
        runs = [walk_run(folder, exts, request.skipped_as) for folder in request.folders]
        if request.look:
            for run in runs:
                run.looks = headers.file_looks(run.paths())
        answer: object = named.WalkedRuns(runs)
    else:
        answer = _entries(request, named)
    sys.stdout.buffer.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()


def _entries(request: Request, named) -> Answer:
    """An index process's answer: its run's entries."""
    Image.MAX_IMAGE_PIXELS = request.pillow["MAX_IMAGE_PIXELS"]
    ImageFile.LOAD_TRUNCATED_IMAGES = request.pillow["LOAD_TRUNCATED_IMAGES"]
    run = request.jobs()

    def some(part: list[Job]) -> list[Indexed]:
        return [headers.entry(job) for job in part]

    with ThreadPoolExecutor(int(sys.argv[2])) as pool:
        found = [e for part in pool.map(some, [run[a : a + 64] for a in range(0, len(run), 64)]) for e in part]
    return named.Answer([f.entry for f in found], [f.key for f in found], [f.look for f in found])


if __name__ == "__main__":
    main()
