"""What a folder's index says of each image, from its header: its size and bytes where it is read as
it is, or it re-encoded once (`sources.images.upright_jpeg`), or why it can't be read
(`loader.folder` caches these). Torch-free: the index processes run it too (`sources.indexer`).
"""

from __future__ import annotations

import hashlib
import io
import os
import stat as stat_module
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from gpufeed.sources.entries import MAX_FILE_BYTES
from gpufeed.sources.images import (
    DEFAULT_MAX_PIXELS,
    JPEG_QUALITY,
    BadImage,
    kept_as_is,
    plain_jpeg_header,
    scan_data_start,
    truncated_jpeg,
    upright_jpeg,
)

JPEG_MAX_SIDE = 65535  # a JPEG frame header's limit
UNIDENTIFIED = "not an image Pillow can identify"
# a JPEG's markers up to its scan: most fit the first read (a cold page cache reads no more of the file);
# an EXIF thumbnail, an ICC profile may take the second; longer ones are read whole
HEADER_BYTES = 1 << 14
LONG_HEADER_BYTES = 1 << 18
TAIL_BYTES = 1 << 12  # a JPEG's last bytes, where its end-of-image marker is (else read whole: a long trailer)


MISSING_LOOK = (-1, -1, -1, -1, -1)  # a file that can't be looked at (its key: "missing")
_WRAP = 1 << 64  # a device or inode number above int64's (dev_t and ino_t are unsigned) wraps, losing nothing


def _signed(v: int) -> int:
    """`v` as int64 holds it (a device or inode number of 2^63 or more wrapped; `look_key` undoes it)."""
    return v - _WRAP if v >= _WRAP >> 1 else v


def file_looks(paths) -> np.ndarray:
    """Each file's look (what `look_key` writes, as int64: bytes, modification and change times in ns,
    device, inode; `MISSING_LOOK` where it can't be looked at), [len(paths), 5], in one pass: a folder
    read in place looks at every file at each open (threads took longer: each stat hands the GIL over
    twice; a key string a file took a third of the time again)."""
    rows: list[tuple[int, int, int, int, int]] = []
    add = rows.append
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            add(MISSING_LOOK)
        else:
            add((st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino))
    try:
        return np.array(rows, np.int64).reshape(len(rows), 5)
    except OverflowError:  # (a device or inode number of 2^63 or more)
        return np.array([[_signed(v) for v in row] for row in rows], np.int64)


def index_key(name: str, look: Sequence[int]) -> str:
    """What a cached entry is for: the image's name and its file's look (`look_key`)."""
    return f"{name}|{look_key(look)}"


def look_key(look: Sequence[int]) -> str:
    """A file's look as text: its size, modification and change times, device and inode (an index
    copied from elsewhere, or made before the file was replaced, matches none of it); "missing" for
    `MISSING_LOOK`. `look`: Python ints (a row of `file_looks(...).tolist()`, or `look_of`)."""
    size, mtime, ctime, dev, ino = look
    return "missing" if size < 0 else f"{size}:{mtime}:{ctime}:{dev % _WRAP}:{ino % _WRAP}"


def upright_path(upright: str, key: str) -> str:
    """Where the image of index key `key` is kept re-encoded: in the folder `upright`, named by its key."""
    return os.path.join(upright, upright_name(key))


def upright_name(key: str) -> str:
    """The file an image re-encoded is kept in, named by its index key (its name and file's stat). A name
    need not be UTF-8 (Python keeps its other bytes as surrogates): hashed as the bytes it is."""
    return hashlib.sha1(os.fsencode(key)).hexdigest()[:24] + ".jpg"


class Job(NamedTuple):
    """One image to index: `size` bytes at `begin` of `file` (-1: the whole file), named `name`; its
    re-encoded copy, if it needs one, goes into the folder `upright` named by its key (`key`: its name
    and its file's stat, where the caller looked already; else from the file as it is opened). (A
    tuple: a frozen dataclass took a tenth of a folder's cold index to make, one a file.)"""

    file: str
    begin: int
    size: int
    name: str
    upright: str
    key: str | None = None


Look = tuple[int, int, int, int, int]  # a file's look, a row of `file_looks`


class Indexed(NamedTuple):
    """An image's index entry (`entry`), the key it is kept under, and the look of the file its key was
    made from (`look`: None where the caller gave the key)."""

    entry: list[int] | str
    key: str
    look: Look | None = None


def look_of(st: os.stat_result) -> Look:
    """A file's look (`file_looks`' row) from its stat."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, _signed(st.st_dev), _signed(st.st_ino)


def entry(job: Job) -> Indexed:
    """The image's index entry and key: [height, width, bytes] of an upright RGB baseline JPEG, read as
    it is; else [height, width, bytes, 1] once it is re-encoded; else why it can't be read. Reads its
    head (and tail) alone where the header says enough (`plain_jpeg_header`), with a call each, no file
    object: this runs per file of a folder of a million."""
    key, look = job.key, None

    def failed(why: str) -> Indexed:  # where the file could not be opened or looked at: keyed by its stat now
        if key is not None:
            return Indexed(why, key, look)
        try:
            now = look_of(os.stat(job.file))
        except OSError:
            now = MISSING_LOOK
        return Indexed(why, index_key(job.name, now), now)

    try:
        fd = os.open(job.file, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO named like an image would block
    except OSError as e:
        return failed(f"unreadable: {e}")
    try:
        st = os.fstat(fd)
        if key is None:
            look = look_of(st)
            key = index_key(job.name, look)
        if not stat_module.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            return Indexed(f"unreadable: {job.file}: not a regular file (a FIFO, device or socket)", key, look)
        # only its head and tail are read: the kernel's read-ahead would fetch the rest from disk too
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return Indexed(_entry(fd, job.size if job.size >= 0 else st.st_size, job.begin, job.upright, key), key, look)
    except Image.UnidentifiedImageError:
        return failed(UNIDENTIFIED)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return failed(f"unreadable: {e}")
    finally:
        os.close(fd)


def _entry(fd: int, size: int, begin: int, upright: str, key: str) -> list[int] | str:
    """`entry` for the image of `size` bytes at `begin` of the open file `fd` (re-encoded into the folder
    `upright`, named by its `key`, where it must be: its path made only then, a fifth of an entry's
    time where it was made for every file)."""
    if size > MAX_FILE_BYTES:
        return f"{size} bytes, more than any image gpufeed reads ({MAX_FILE_BYTES})"
    head = os.pread(fd, min(size, HEADER_BYTES), begin)
    plain = plain_jpeg_header(head, JPEG_MAX_SIDE)  # most photos: no Pillow needed
    if plain is None and len(head) < size:  # maybe markers longer than the head (an EXIF thumbnail)
        head = os.pread(fd, min(size, LONG_HEADER_BYTES), begin)
        plain = plain_jpeg_header(head, JPEG_MAX_SIDE)
    if plain is not None:
        h, w, scan = plain
        return _cut_short(fd, begin, size, head, scan) or [h, w, size]
    try:
        img = Image.open(io.BytesIO(head))
    except (OSError, SyntaxError):
        if size <= len(head):
            raise
        head = os.pread(fd, size, begin)  # markers (an ICC profile, XMP) longer than the head: read it all
        img = Image.open(io.BytesIO(head))
    w, h = img.size
    if kept_as_is(img, JPEG_MAX_SIDE):
        return _cut_short(fd, begin, size, head) or [h, w, size]
    if len(head) < size:
        head = os.pread(fd, size, begin)
    return reencode(head, Path(upright_path(upright, key)))


def _cut_short(fd: int, begin: int, size: int, head: bytes, scan: int | str | None = None) -> str | None:
    """Why a JPEG read as it is (`size` bytes at `begin` of the open file `fd`, the first of them in
    `head`) ends before its image does, or None, as `gpufeed pack` checks it (`truncated_jpeg`). A
    file longer than its head is looked for the end-of-image marker in its last TAIL_BYTES first (one
    more read), where they lie after its image data starts (`scan`, where the caller knows it; before
    it, the marker could be an EXIF thumbnail's); only one with none there (cut short, or a long
    trailer after its image) is read whole."""
    if len(head) < size:
        start = scan_data_start(head) if scan is None else scan  # (where the header walk found it)
        after = isinstance(start, int) and start <= size - TAIL_BYTES
        if after and b"\xff\xd9" in os.pread(fd, TAIL_BYTES, begin + size - TAIL_BYTES):
            return None
        head = os.pread(fd, size, begin)
    return truncated_jpeg(head)


def reencode(data: bytes, made: Path) -> list[int] | str:
    """Re-encode an image as `gpufeed pack` does (upright, RGB, baseline, its default quality) into
    `made`, written whole or not at all; its entry, or why not."""
    try:
        encoded, (h, w), _ = upright_jpeg(data, JPEG_QUALITY, JPEG_MAX_SIDE, DEFAULT_MAX_PIXELS)
    except BadImage as e:
        return str(e)
    written = None
    try:
        made.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=made.parent, prefix=".gpufeed-", suffix=".part", delete=False) as f:
            written = f.name
            f.write(encoded)
        os.replace(written, made)
    except OSError as e:
        if written is not None:
            Path(written).unlink(missing_ok=True)
        return f"needs re-encoding (not an upright RGB baseline JPEG), and {made.parent} can't be written ({e})"
    return [h, w, len(encoded), 1]
