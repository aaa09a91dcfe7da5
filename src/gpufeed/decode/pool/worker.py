"""A CPU JPEG decode worker: its own interpreter (`python -m gpufeed.decode.pool.worker SETUP`), started by
`gpufeed.decode.pool.workers.DecodeWorkers`.

Started with exec, not fork or multiprocessing: it never imports the user's `__main__` and shares
no threads or locks with the loader. It has no GPU (CUDA_VISIBLE_DEVICES is empty) and no torch (it
starts in a fraction of a second), and loads nvImageCodec's region decoder before it says it is
ready. It takes tickets from the pipe all workers share, decodes the job board's rows each names
(from the source each row names: any loader of the process) into the loader's shared segments,
completes the rows and writes a DONE record (`protocol`). It
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
    rows = protocol.board(mmap.mmap(setup.board_fd, setup.board_rows * protocol.BOARD.itemsize), setup.board_rows)
    maps = Maps(setup.parent)
    pixels.warm()  # ready means decoding at full pace from the first image
    protocol.write(sys.stdout.fileno(), protocol.Ready(os.getpid(), began, imported, time.perf_counter()))
    while True:
        ticket = os.read(setup.tickets_fd, protocol.TICKET.itemsize)
        if len(ticket) != protocol.TICKET.itemsize:  # closed: the loader is done with us
            return
        first, count, share, _ = np.frombuffer(ticket, protocol.TICKET)[0].tolist()
        rows[first : first + count]["worker"] = setup.index  # taken: the loader knows whose it is if we die
        wall, cpu = time.perf_counter(), time.process_time()
        maps.prune()
        for r in range(first, first + count):
            _one(rows[r : r + 1], maps, pixels)
        done = np.array(
            [(first, count, share, setup.index, time.perf_counter() - wall, time.process_time() - cpu)], protocol.DONE
        )
        os.write(setup.done_fd, done.tobytes())


class Maps:
    """The loader's memfds this worker has mapped (sources and segments), by their fd in the loader and
    checked by their inode (a row's id); one the loader has closed since is let go within `PRUNE`
    seconds of the next ticket, so a loader gone from the process holds no memory here."""

    PRUNE = 1.0

    def __init__(self, parent: int):
        self.parent = parent
        self._mapped: dict[int, tuple[int, object]] = {}  # fd -> (its inode, what it holds)
        self._pruned = time.monotonic()

    def get(self, fd: int, inode: int, size: int, make):
        """What `make(map)` made of the loader's memfd `fd` whose inode the row says (mapped once; again
        if `fd` now names another)."""
        known = self._mapped.get(fd)
        if known is None or known[0] != inode:
            handle = os.open(f"/proc/{self.parent}/fd/{fd}", os.O_RDWR)
            try:
                if os.fstat(handle).st_ino != inode:  # the loader closed the row's, and gave its fd to another
                    raise OSError(f"the loader's fd {fd} names another file than this row's")
                mapped = mmap.mmap(handle, size)
            finally:
                os.close(handle)
            known = self._mapped[fd] = (inode, make(mapped))
        return known[1]

    def prune(self) -> None:
        """Let go of what the loader closed (its fd gone or naming another file)."""
        now = time.monotonic()
        if now - self._pruned < self.PRUNE:
            return
        self._pruned = now
        for fd, (inode, _) in list(self._mapped.items()):
            try:
                gone = os.stat(f"/proc/{self.parent}/fd/{fd}").st_ino != inode
            except OSError:
                gone = True
            if gone:
                del self._mapped[fd]

    def segment(self, row) -> np.ndarray:
        """The pixels' segment a row writes into."""
        return self.get(int(row["segment_fd"]), int(row["segment_id"]), int(row["segment_size"]), _pixels)

    def source(self, row):
        """What a row's bytes are read from: a store's bytes (a numpy view of its file), or a folder's
        `FileTable`."""
        return self.get(int(row["source_fd"]), int(row["source_id"]), int(row["source_size"]), _source)


def _pixels(mapped: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mapped, dtype=np.uint8)


def _source(mapped: mmap.mmap):
    parsed = protocol.Source.parse(mapped)
    if isinstance(parsed, protocol.FileTable):
        return parsed
    path, offset, nbytes = parsed
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,)).view(np.ndarray)


def _one(row: np.ndarray, maps: Maps, codec) -> None:
    """Decode the image of one board row (a view of length 1) with `codec` (`decode.codecs.pixels`) and
    complete the row. Its pixels take no more than the room the row reserved: a region asked for
    and refused alone is decoded whole and cut to it (the row says so)."""
    job = row[0]
    try:
        begin, end = int(job["begin"]), int(job["end"])
        source = maps.source(job)
        if isinstance(source, protocol.FileTable):
            encoded = _read(source[int(job["file"])], begin, end)
        else:
            encoded = source[begin:end]
        out = maps.segment(job)
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


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, EOFError):  # the loader is gone or done with us: nothing left to do
        os._exit(0)
