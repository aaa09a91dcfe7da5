"""What crosses between the loader and its CPU decode workers, and how.

Three shared things, made by the loader's process and handed to every worker when it starts:

- the job board (`BOARD`): a table in shared memory with one row per image to decode, which the
  loader fills (its source and byte range, where the pixels go, DCT size or region) and the worker
  completes (size as decoded, region, or why it failed);
- the ticket pipe: the loader writes one `TICKET` record per run of board rows, all of a share's
  in one write; an idle worker reads one ticket at a time (a pipe hands each record to one reader
  whole: a write of at most PIPE_BUF bytes is never split), so the workers balance themselves and
  the loader never writes to a worker of its own;
- the done pipe: a worker writes one `DONE` record per ticket it finished; the loader's thread that
  waits for a share reads them, many in one read.

A worker also writes `Ready` (pickled, behind an 8-byte length) once on its own stdout, and then
nothing: the loader sees that pipe close when the worker is gone. Pixels never cross a pipe: a
worker writes them into a shared `Segment` (a memfd of the loader's process, which the worker opens
through /proc), at the offset its row names. What a row's bytes are read from is named the same
way: a `Source` memfd (a store file's path and range, or a folder's table of files), one per loader,
so the workers serve every loader of their process (`shared`) and learn of a new one from its rows.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from gpufeed.decode.asks import NO_REGION

_HEADER = struct.Struct("<Q")
MAX_MESSAGE = 1 << 20  # only `Ready` is framed: anything larger is a broken pipe
ERROR_BYTES = 160  # a failed image's reason, cut to this many bytes of UTF-8


class Status(IntEnum):
    """A board row's state: the loader posts it PENDING; the worker that takes its ticket leaves it
    DECODED, CUT (decoded whole and cut to the region asked: the region alone was refused, slower) or
    FAILED (its `error` says why). A row nobody answered stays PENDING and counts as failed."""

    PENDING = 0
    DECODED = 1
    FAILED = 2
    CUT = 3


BOARD = np.dtype(
    [
        # the loader's request
        ("source_fd", "<i4"),
        ("source_id", "<i8"),  # its memfd's inode: checked by the worker that opens it
        ("source_size", "<i8"),  # what the bytes are read from (a `Source`), as /proc/PID/fd/FD
        ("begin", "<i8"),
        ("end", "<i8"),  # bytes of the source's store (or of its file `file`, a folder read in place)
        ("file", "<i8"),  # index into the source's file table, or -1
        ("at", "<i8"),
        ("capacity", "<i8"),  # where its pixels go in the segment, and the bytes reserved: as asked
        ("segment_fd", "<i4"),
        ("segment_id", "<i8"),  # its memfd's inode, as source_id
        ("segment_size", "<i8"),  # the segment, as /proc/PID/fd/FD
        ("reduce_to", "<i4", (2,)),  # (w, h) to DCT-reduce towards; (0, 0): no reduction
        ("region", "<i4", (4,)),  # (y0, x0, y1, x1) to decode alone; all -1: the whole image
        # the worker's answer
        ("worker", "<i4"),  # the worker that took the row's ticket (-1 until one did)
        ("status", "<i4"),  # a `Status`
        ("height", "<i4"),
        ("width", "<i4"),  # as written (HWC uint8)
        ("decoded_region", "<i4", (4,)),  # the region the pixels are; all -1: the whole image, maybe DCT-reduced
        ("done", "<f8"),  # the worker's perf_counter when it finished the image (CLOCK_MONOTONIC: one clock)
        ("error", f"S{ERROR_BYTES}"),
    ],
    align=True,
)

# board rows [row, row + count) of the loader's share number `share` (mod 2**32)
TICKET = np.dtype([("row", "<u4"), ("count", "<u4"), ("share", "<u4"), ("spare", "<u4")])
# a ticket finished by worker `worker` in `wall` seconds, `cpu` of them on a CPU (`share` as it came:
# a late answer to a ticket whose rows went on to another share is told apart)
DONE = np.dtype(
    [("row", "<u4"), ("count", "<u4"), ("share", "<u4"), ("worker", "<i4"), ("wall", "<f4"), ("cpu", "<f4")]
)
MAX_TICKETS_PER_WRITE = 4096 // TICKET.itemsize  # one write of at most PIPE_BUF is never split


@dataclass
class WorkerSetup:
    """The worker's command line (JSON)."""

    parent: int  # the loader's pid: the worker exits when its parent is no longer this process
    index: int  # this worker's number, in its DONE records
    board_fd: int  # the job board (a memfd the worker inherits) and its rows
    board_rows: int
    tickets_fd: int  # the ticket pipe's read end
    done_fd: int  # the done pipe's write end


@dataclass
class Ready:
    """A worker has imported its decoders and takes tickets; when (time.perf_counter, one clock for
    every process of the machine) its `main` began, its decoders' modules were imported, and
    nvImageCodec's decoder was made: where a worker's start goes (`DecodeWorkers.start_seconds`)."""

    pid: int
    began: float = 0.0
    imported: float = 0.0
    warmed: float = 0.0


def board(buffer, rows: int) -> np.ndarray:
    """The job board's rows over `buffer` (a shared map of at least `rows * BOARD.itemsize` bytes)."""
    return np.frombuffer(buffer, dtype=BOARD, count=rows)


def decoded(row: np.ndarray, height: int, width: int, region, done: float, cut: bool = False) -> None:
    """Complete board row `row` (a view of one row): its image decoded to `height` x `width`, of
    `region` (None or `NO_REGION`: the whole image), finished at `done`; `cut`: decoded whole and cut
    to `region`."""
    row["height"], row["width"], row["done"] = height, width, done
    row["decoded_region"] = region if region is not None else NO_REGION
    row["status"] = Status.CUT if cut else Status.DECODED


def answer(row: np.ndarray, pixels: np.ndarray, image: np.ndarray, region, done: float, cut: bool = False) -> None:
    """Complete board row `row` with `image` (HWC uint8) written into `pixels` (its segment's bytes)
    where the row says (`decoded`'s other arguments); an image larger than the room the row reserved
    fails the row instead."""
    job = row[0]
    if image.size > job["capacity"]:
        failed(row, f"decoded to {tuple(image.shape[:2])}, larger than the store records it or the region asked")
        return
    at = int(job["at"])
    pixels[at : at + image.size] = image.reshape(-1)
    decoded(row, image.shape[0], image.shape[1], region, done, cut=cut)


def failed(row: np.ndarray, why: str) -> None:
    """Complete board row `row`: its image failed, for `why` (UTF-8, cut short on a character boundary; a
    file name's bytes that are not UTF-8 as backslash escapes)."""
    row["error"] = why.encode(errors="backslashreplace")[:ERROR_BYTES].decode(errors="ignore").encode()
    row["status"] = Status.FAILED


class FileTable:
    """The files a folder read in place decodes from, as one shared buffer: the number of files, their
    start offsets (int64, one more than files) and their paths' bytes back to back."""

    @staticmethod
    def pack(paths) -> bytes:
        """`paths` (str, none with a NUL: no path has one) encoded as `os.fsencode` would, all at once
        (a folder of 200,000 files took 0.17 s a file at a time, in each Loader's constructor)."""
        joined = np.frombuffer(
            "\0".join(paths).encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()), np.uint8
        )
        count = len(paths)
        ends = np.zeros(count + 1, np.int64)
        if count:  # path k ends at its NUL in `joined`, k bytes less without the NULs before it
            ends[1:] = np.append(np.flatnonzero(joined == 0), len(joined)) - np.arange(count)
        return np.int64(count).tobytes() + ends.tobytes() + joined[joined != 0].tobytes()

    def __init__(self, buffer, cwd: str = ""):
        self.cwd = cwd  # where relative paths are (os.path.join keeps an absolute one)
        count = int(np.frombuffer(buffer, np.int64, 1)[0])
        self._ends = np.frombuffer(buffer, np.int64, count + 1, offset=8)
        self._names = memoryview(buffer)[8 * (count + 2) :]

    def __getitem__(self, k: int) -> str:
        return os.path.join(self.cwd, os.fsdecode(bytes(self._names[int(self._ends[k]) : int(self._ends[k + 1])])))


class Source:
    """What one loader's rows read their bytes from, as the bytes of its memfd: an 8-byte kind, then for
    a store its file's offset and size (int64) and its path, for a folder read in place a `FileTable`."""

    STORE, FILES = b"store\0\0\0", b"files\0\0\0"
    _RANGE = struct.Struct("<qq")

    @classmethod
    def of_store(cls, path: str, offset: int, nbytes: int) -> bytes:
        """A store file's bytes (a relative path as this process's working folder resolves it now: the
        workers were started in another, maybe, for an earlier loader)."""
        return cls.STORE + cls._RANGE.pack(offset, nbytes) + os.fsencode(os.path.abspath(path))

    @classmethod
    def of_files(cls, paths) -> bytes:
        """A folder's files, relative paths among them resolved in this process's working folder now."""
        cwd = os.fsencode(os.getcwd())
        return cls.FILES + struct.pack("<q", len(cwd)) + cwd + FileTable.pack(paths)

    @classmethod
    def parse(cls, buffer) -> tuple[str, int, int] | FileTable:
        """(path, offset, nbytes) of a store, or a folder's `FileTable`."""
        kind, rest = bytes(buffer[:8]), memoryview(buffer)[8:]
        if kind == cls.FILES:
            (size,) = struct.unpack("<q", bytes(rest[:8]))
            return FileTable(rest[8 + size :], os.fsdecode(bytes(rest[8 : 8 + size])))
        if kind != cls.STORE:
            raise ValueError(f"not a decode source: its kind is {kind!r}")
        offset, nbytes = cls._RANGE.unpack(bytes(rest[: cls._RANGE.size]))
        return os.fsdecode(bytes(rest[cls._RANGE.size :])), offset, nbytes


def write(fd: int, message) -> None:
    """Send one framed message on the pipe `fd` (blocking until all of it is written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read(fd: int):
    """The next framed message from the pipe `fd`; EOFError once the other end is closed."""
    (size,) = _HEADER.unpack(exactly(fd, _HEADER.size))
    if size > MAX_MESSAGE:
        raise EOFError(f"message of {size} bytes: the pipe is out of step")
    return pickle.loads(exactly(fd, size))


def exactly(fd: int, n: int) -> bytes:
    """`n` bytes from `fd` (EOFError if it closes first)."""
    parts, left = [], n
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("pipe closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
