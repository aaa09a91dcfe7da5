"""What crosses the pipes between the loader and its CPU decode workers, and how it is framed.

Each message is one pickled dataclass behind an 8-byte length. The loader writes `Chunk`s to a
worker's stdin; the worker writes `Ready` once, then one `ChunkDone` per chunk, to its stdout.
Pixels never cross a pipe: a worker writes them into a shared `Segment` (a memfd of the loader's
process, which the worker opens through /proc), at the offsets the chunk names.
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field

_HEADER = struct.Struct("<Q")
MAX_MESSAGE = 1 << 30  # a chunk names byte ranges, never pixels: anything larger is a broken pipe


@dataclass
class WorkerSetup:
    """The worker's command line (JSON): the store's encoded bytes and the loader's pid."""

    store: str  # file holding the encoded bytes ("" for a folder read in place: jobs name their files)
    offset: int  # where they start in it
    nbytes: int
    parent: int  # the loader's pid: the worker exits when its parent is no longer this process


@dataclass
class Ready:
    """A worker has imported its decoders and takes chunks."""

    pid: int


@dataclass
class Job:
    """One image to decode: bytes [begin, end) of the store (or of the file `path`, for a folder read
    in place) into the segment at `at` (at most `capacity` bytes), DCT-reduced to `reduce_to` (w, h)
    or only `region` (y0, x0, y1, x1)."""

    begin: int
    end: int
    at: int
    capacity: int
    reduce_to: tuple[int, int] | None = None
    region: tuple[int, int, int, int] | None = None
    path: str | None = None


@dataclass
class Chunk:
    """Part of one batch's CPU share, for one worker."""

    ticket: int  # the batch's job in the loader
    first: int  # position of jobs[0] in that job
    segment_fd: int  # the loader's fd of the memfd segment
    segment_id: int  # tells a reused fd number from the segment it was before
    segment_size: int
    jobs: list[Job] = field(default_factory=list)


@dataclass
class Image:
    """A decoded image: its size as written (HWC uint8), the region it is (None: the whole image,
    maybe DCT-reduced) and when the worker finished it (its perf_counter)."""

    height: int
    width: int
    done: float
    region: tuple[int, int, int, int] | None


@dataclass
class ChunkDone:
    """A chunk's results in job order: an `Image`, or why that image failed."""

    ticket: int
    first: int
    results: list[Image | str]
    wall: float  # seconds the worker spent on it
    cpu: float


def write(fd: int, message) -> None:
    """Send one message on the pipe `fd` (blocking until all of it is written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read(fd: int):
    """The next message from the pipe `fd`; EOFError once the other end is closed."""
    (size,) = _HEADER.unpack(_exactly(fd, _HEADER.size))
    if size > MAX_MESSAGE:
        raise EOFError(f"message of {size} bytes: the pipe is out of step")
    return pickle.loads(_exactly(fd, size))


def _exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("pipe closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
