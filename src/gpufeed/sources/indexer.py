"""A large folder's index made by processes: `entries` splits the images among `processes` fresh
interpreters (`python -m gpufeed.sources.indexer`), each reading its run of headers
(`headers.entry`).

Why processes: reading a header is mostly Python (the marker walk, the entry), which holds the GIL,
so threads of one process index no faster than one thread with the page cache warm
(docs/benchmarks.md, "Indexing a folder"); ImageNet's 1.28M files on one core take over a minute.
Why exec and not multiprocessing: as the decode workers (`decode.pool.spawn`), a process started
with exec shares no threads or locks with the loader's and never imports the user's `__main__`. It
imports no torch (0.2 s to start). It reads its `Request` (pickled: Pillow's settings, its run of
`headers.Job`s) from stdin, writes its `Answer` (their entries and keys), pickled, to stdout, and
exits; it
also exits within a quarter second of its parent going away.
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
from pathlib import Path

from PIL import Image, ImageFile

from gpufeed.processes import watch_parent
from gpufeed.sources import headers
from gpufeed.sources.headers import Indexed, Job

SRC = Path(__file__).resolve().parents[2]  # the folder gpufeed is imported from, for the processes' path


class IndexFailed(Exception):
    """An index process ended without its entries (it was killed, or could not start)."""


IN_FLIGHT = 16  # headers read at once over all the processes: a cold page cache waits on the disk


def entries(jobs: Sequence[Job], processes: int) -> list[Indexed]:
    """Each job's index entry (`headers.entry`), made by `processes` processes at once, in the jobs'
    order, each reading on `IN_FLIGHT // processes` threads (one: the GIL's, with the page cache warm;
    more overlap a cold cache's reads). Raises IndexFailed, naming the process, where one ends
    without its entries."""
    threads = max(1, IN_FLIGHT // max(1, processes))
    step = -(-len(jobs) // max(1, processes))
    runs = [list(jobs[a : a + step]) for a in range(0, len(jobs), step)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    # what of Pillow's state decides an entry goes with the request (its plugins can't: the caller
    # indexes again what the processes' Pillow did not identify)
    pillow: dict[str, object] = {
        "MAX_IMAGE_PIXELS": Image.MAX_IMAGE_PIXELS,
        "LOAD_TRUNCATED_IMAGES": ImageFile.LOAD_TRUNCATED_IMAGES,
    }
    procs: list[subprocess.Popen] = []
    pool = ThreadPoolExecutor(len(runs), thread_name_prefix="gpufeed-index")
    try:
        for _ in runs:
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
        asked = [pool.submit(_ask, proc, Request.of(pillow, run)) for proc, run in zip(procs, runs)]
        found = [f.result() for f in asked]
    finally:  # (Ctrl-C, or one failed or did not start: the others are stopped, not waited for)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        pool.shutdown(wait=True)
        for proc in procs:
            proc.wait()
    return [e for part in found for e in part]


@dataclass
class Request:
    """What an index process is asked: Pillow's settings to take, and its run of images as columns of
    `headers.Job`'s fields (a pipe carries a few lists faster than an object per image)."""

    pillow: dict[str, object]
    files: list[str]
    begins: list[int]
    sizes: list[int]
    names: list[str]
    uprights: list[str]
    keys: list[str | None]

    @classmethod
    def of(cls, pillow: dict[str, object], jobs: list[Job]) -> Request:
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


@dataclass
class Answer:
    """An index process's entries and keys (`headers.Indexed`'s fields), as columns in its run's order."""

    entries: list[list[int] | str]
    keys: list[str]


def _ask(proc: subprocess.Popen, request: Request) -> list[Indexed]:
    """Send `request` to `proc` and read back its entries."""
    out, err = proc.communicate(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
    if proc.returncode != 0:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise IndexFailed(f"index process {proc.pid} ended without its entries ({why[0]})")
    try:
        got = pickle.loads(out)
    except Exception as e:  # noqa: BLE001  whatever a broken pipe's bytes unpickle to
        raise IndexFailed(f"index process {proc.pid} answered unreadably ({type(e).__name__})") from None
    if not isinstance(got, Answer) or not len(got.entries) == len(got.keys) == len(request.files):
        raise IndexFailed(
            f"index process {proc.pid} answered {type(got).__name__}, not the entries of {len(request.files)} images"
        )
    return [Indexed(e, k) for e, k in zip(got.entries, got.keys)]


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle
    watch_parent(int(sys.argv[1]))
    request = pickle.load(sys.stdin.buffer)
    Image.MAX_IMAGE_PIXELS = request.pillow["MAX_IMAGE_PIXELS"]
    ImageFile.LOAD_TRUNCATED_IMAGES = request.pillow["LOAD_TRUNCATED_IMAGES"]
    run = request.jobs()

    def some(part: list[Job]) -> list[Indexed]:
        return [headers.entry(job) for job in part]

    with ThreadPoolExecutor(int(sys.argv[2])) as pool:
        found = [e for part in pool.map(some, [run[a : a + 64] for a in range(0, len(run), 64)]) for e in part]
    # (this module runs as __main__ here: the answer is pickled as the class the caller imported)
    from gpufeed.sources.indexer import Answer as Named

    answer = Named([f.entry for f in found], [f.key for f in found])
    sys.stdout.buffer.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
