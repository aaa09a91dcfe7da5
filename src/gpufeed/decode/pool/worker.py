"""A CPU JPEG decode worker: its own interpreter (`python -m gpufeed.decode.pool.worker SETUP`), started by
`gpufeed.decode.pool.workers.DecodeWorkers`.

Started with exec, not fork or multiprocessing: it never imports the user's `__main__` and shares
no threads or locks with the loader. It has no GPU (CUDA_VISIBLE_DEVICES is empty) and no torch (it
starts in a fraction of a second), and loads nvImageCodec's region decoder before it says it is
ready. It takes tickets from the pipe all workers share, decodes the job board's rows each names
into the loader's shared segments, completes the rows and writes a DONE record (`protocol`). It
ends when the ticket pipe closes (the loader stopped the workers or died), or within `WATCH`
seconds of its parent process going away, however that happened (SIGKILL included).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import stat
import sys
import threading
import time

import numpy as np

from gpufeed.decode.asks import asked
from gpufeed.decode.pool import protocol

WATCH = 0.25  # seconds between looks at whether the parent is still there


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH)
    os._exit(0)


def main() -> None:
    began = time.perf_counter()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle; it stops us
    setup = protocol.WorkerSetup(**json.loads(sys.argv[1]))
    threading.Thread(target=_watch, args=(setup.parent,), daemon=True).start()
    from gpufeed.decode.codecs import pixels

    imported = time.perf_counter()
    data = np.zeros(0, np.uint8)
    if setup.store:
        data = np.memmap(setup.store, dtype=np.uint8, mode="r", offset=setup.offset, shape=(setup.nbytes,))
        data = data.view(np.ndarray)
    rows = protocol.board(mmap.mmap(setup.board_fd, setup.board_rows * protocol.BOARD.itemsize), setup.board_rows)
    files = protocol.FileTable(mmap.mmap(setup.files_fd, setup.files_size)) if setup.files_fd >= 0 else None
    segments: dict[int, tuple[int, np.ndarray]] = {}  # loader's fd -> (segment id, its pixels)
    pixels.warm()  # ready means decoding at full pace from the first image
    protocol.write(sys.stdout.fileno(), protocol.Ready(os.getpid(), began, imported, time.perf_counter()))
    while True:
        ticket = os.read(setup.tickets_fd, protocol.TICKET.itemsize)
        if len(ticket) != protocol.TICKET.itemsize:  # closed: the loader is done with us
            return
        first, count, share, _ = np.frombuffer(ticket, protocol.TICKET)[0].tolist()
        rows[first : first + count]["worker"] = setup.index  # taken: the loader knows whose it is if we die
        wall, cpu = time.perf_counter(), time.process_time()
        for r in range(first, first + count):
            _one(rows[r : r + 1], data, files, segments, setup.parent, pixels)
        done = np.array(
            [(first, count, share, setup.index, time.perf_counter() - wall, time.process_time() - cpu)], protocol.DONE
        )
        os.write(setup.done_fd, done.tobytes())


def _one(row: np.ndarray, data: np.ndarray, files, segments: dict, parent: int, codec) -> None:
    """Decode the image of one board row (a view of length 1) with `codec` (`decode.codecs.pixels`) and
    complete the row. Its pixels take no more than the room the row reserved: a region asked for
    and refused alone is decoded whole and cut to it (the row says so)."""
    job = row[0]
    try:
        begin, end = int(job["begin"]), int(job["end"])
        encoded = data[begin:end] if job["file"] < 0 else _read(files[int(job["file"])], begin, end)
        out = _segment(segments, int(job["segment_fd"]), int(job["segment_id"]), int(job["segment_size"]), parent)
        reduce_to, box = asked(job["reduce_to"].tolist(), job["region"].tolist())
        image, region, done = codec.decode(encoded, reduce_to, box)
        image, region, cut = codec.as_asked(image, region, reduce_to, box)
        protocol.answer(row, out, image, region, done, cut)
    except Exception as e:  # noqa: BLE001  any decoder error marks this image, never the ticket
        protocol.failed(row, f"{type(e).__name__}: {e}")


def _read(path: str, begin: int, end: int) -> np.ndarray:
    """A folder's image, read from its file (the loader indexed where it is). Opened without blocking and
    read only if it is still a regular file: a FIFO put in its place since would block the open until
    a writer came (the worker hung, and the pass with it), a device could block the read; either is
    this image's failure, with the reason."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file any more (a FIFO, device or socket put in its place)")
        data = os.pread(fd, end - begin, begin)
    finally:
        os.close(fd)
    if len(data) != end - begin:
        raise OSError(f"{path}: {len(data)} bytes where the index says {end - begin} (changed since)")
    return np.frombuffer(data, np.uint8)


def _segment(segments: dict, segment_fd: int, segment_id: int, size: int, parent: int) -> np.ndarray:
    """The segment a row writes into, mapped once (again if its fd number now names another)."""
    known = segments.get(segment_fd)
    if known is None or known[0] != segment_id:
        fd = os.open(f"/proc/{parent}/fd/{segment_fd}", os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        known = segments[segment_fd] = (segment_id, np.frombuffer(mapped, dtype=np.uint8))
    return known[1]


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, EOFError):  # the loader is gone or done with us: nothing left to do
        os._exit(0)
