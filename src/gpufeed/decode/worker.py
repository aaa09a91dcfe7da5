"""A CPU JPEG decode worker: its own interpreter (`python -m gpufeed.decode.worker SETUP`), started by
`gpufeed.decode.workers.DecodeWorkers`.

Started with exec, not fork or multiprocessing: it never imports the user's `__main__` and shares
no threads or locks with the loader. It has no GPU (CUDA_VISIBLE_DEVICES is empty) and no torch (it starts in a fraction of a second), reads chunks
(`protocol.Chunk`) on stdin, decodes them into the loader's shared segments and answers each with a
`protocol.ChunkDone` on stdout. It ends when stdin closes (the loader closed it or died), or within
`WATCH` seconds of its parent process going away, however that happened (SIGKILL included).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import threading
import time

import numpy as np

WATCH = 0.25  # seconds between looks at whether the parent is still there


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH)
    os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle; it stops us
    from gpufeed.decode import protocol

    setup = protocol.WorkerSetup(**json.loads(sys.argv[1]))
    threading.Thread(target=_watch, args=(setup.parent,), daemon=True).start()
    from gpufeed.decode.pixels import decode

    data = np.zeros(0, np.uint8)
    if setup.store:
        data = np.memmap(setup.store, dtype=np.uint8, mode="r", offset=setup.offset, shape=(setup.nbytes,))
        data = data.view(np.ndarray)
    segments: dict[int, tuple[int, np.ndarray]] = {}  # loader's fd -> (segment id, its pixels)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    protocol.write(stdout, protocol.Ready(os.getpid()))
    while True:
        try:
            chunk = protocol.read(stdin)
        except EOFError:
            return
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            out = _segment(segments, chunk, setup.parent)
        except OSError as e:
            results = [f"cannot open the loader's decode buffer ({e})"] * len(chunk.jobs)
        else:
            results = []
            for job in chunk.jobs:
                try:
                    encoded = data[job.begin : job.end] if job.path is None else _read(job)
                    pixels, region, done = decode(encoded, job.reduce_to, job.region)
                    if pixels.size > job.capacity:
                        raise ValueError(f"decoded to {tuple(pixels.shape[:2])}, larger than the size the store records")
                    out[job.at : job.at + pixels.size] = pixels.reshape(-1)
                    results.append(protocol.Image(pixels.shape[0], pixels.shape[1], done, region))
                except Exception as e:  # any decoder error marks this image, never the chunk
                    results.append(f"{type(e).__name__}: {e}")
        protocol.write(stdout, protocol.ChunkDone(chunk.ticket, chunk.first, results,
                                                  time.perf_counter() - wall, time.process_time() - cpu))


def _read(job) -> np.ndarray:
    """A folder's image, read from its file (the loader indexed where it is)."""
    fd = os.open(job.path, os.O_RDONLY)
    try:
        data = os.pread(fd, job.end - job.begin, job.begin)
    finally:
        os.close(fd)
    if len(data) != job.end - job.begin:
        raise OSError(f"{job.path}: {len(data)} bytes where the index says {job.end - job.begin} (changed since)")
    return np.frombuffer(data, np.uint8)


def _segment(segments: dict, chunk, parent: int):
    """The segment `chunk` writes into, mapped once (again if its fd number now names another)."""
    known = segments.get(chunk.segment_fd)
    if known is None or known[0] != chunk.segment_id:
        fd = os.open(f"/proc/{parent}/fd/{chunk.segment_fd}", os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, chunk.segment_size)
        finally:
            os.close(fd)
        known = segments[chunk.segment_fd] = (chunk.segment_id, np.frombuffer(mapped, dtype=np.uint8))
    return known[1]


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, EOFError):  # the loader is gone or done with us: nothing left to do
        os._exit(0)
