"""Collect packed samples into the data files of a store being written."""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import numpy as np

from gpufeed.store import format as fmt
from gpufeed.store.writer import HashingWriter, file_digest


def write_array(path: Path, values: np.ndarray) -> dict[str, object]:
    w = HashingWriter(path)
    w.write(np.ascontiguousarray(values))
    return w.close()


class Appended:
    """Variable-length values back to back in one file, with an int64[N + 1] offsets file beside it:
    the encoded images of a jpeg store (data.bin, offsets.i64) and every store's sources."""

    def __init__(self, work: Path, data_name: str, offsets_name: str):
        self.data = HashingWriter(work / data_name)
        self.offsets: array = array("q", [0])
        self.names, self.work = (data_name, offsets_name), work

    def add(self, value: bytes) -> None:
        self.data.write(value)
        self.offsets.append(self.data.bytes)

    def finish(self) -> dict[str, dict[str, object]]:
        data_name, offsets_name = self.names
        return {
            data_name: self.data.close(),
            offsets_name: write_array(self.work / offsets_name, np.asarray(self.offsets, dtype="<i8")),
        }


def _sources(work: Path) -> Appended:
    return Appended(work, fmt.SOURCES, fmt.SOURCE_OFFSETS)


class RawSink:
    """Hands out slots of images.u8 to workers (or writes the pixels remote workers send back);
    compacts away the slots of skipped images."""

    def __init__(self, work: Path, size: int):
        self.work = work
        self.path = work / fmt.RAW_IMAGES
        self.item = fmt.raw_item_bytes(size)
        self.path.touch()
        self.slots = 0
        self.kept: array = array("q")
        self.labels: array = array("q")
        self.sources = _sources(work)
        self._fd: int | None = None

    @property
    def count(self) -> int:
        return len(self.kept)

    def reserve(self, n: int) -> int:
        """Grow the (sparse) file by `n` slots and return the first one."""
        start = self.slots
        self.slots += n
        os.truncate(self.path, self.slots * self.item)
        return start

    def add(self, slot: int, label: int, pixels: np.ndarray | None, hw: tuple[int, int] | None, source: str) -> None:
        if pixels is not None:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR)
            # (numpy's stubs give an ndarray the buffer protocol from Python 3.12 on)
            os.pwrite(self._fd, memoryview(pixels).cast("B"), slot * self.item)  # type: ignore[arg-type]
        self.kept.append(slot)
        self.labels.append(label)
        self.sources.add(fmt.encode_source(source))

    def finish(self) -> dict[str, dict[str, object]]:
        files = {
            fmt.LABELS: write_array(self.work / fmt.LABELS, np.asarray(self.labels, dtype="<i8")),
            **self.sources.finish(),
        }
        if self._fd is not None:
            os.close(self._fd)
        if list(self.kept) != list(range(self.slots)):
            self._compact()
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        files[fmt.RAW_IMAGES] = file_digest(self.path)
        return files

    def _compact(self) -> None:
        """Move the kept slots down over the holes left by skipped images, then truncate."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            for k, slot in enumerate(self.kept):
                if slot != k:
                    os.pwrite(fd, os.pread(fd, self.item, slot * self.item), k * self.item)
            os.ftruncate(fd, len(self.kept) * self.item)
        finally:
            os.close(fd)


class JpegSink:
    """Appends encoded images to data.bin and keeps the offsets and shapes index."""

    def __init__(self, work: Path):
        self.work = work
        self.encoded = Appended(work, fmt.JPEG_DATA, fmt.JPEG_OFFSETS)
        self.shapes: array = array("i")
        self.labels: array = array("q")
        self.sources = _sources(work)

    @property
    def count(self) -> int:
        return len(self.labels)

    def reserve(self, n: int) -> int:
        return 0

    def add(self, slot: int, label: int, encoded: bytes | None, hw: tuple[int, int] | None, source: str) -> None:
        # (a jpeg sink is given every kept image's bytes and size: None is the raw sink's)
        self.encoded.add(encoded)  # type: ignore[arg-type]
        self.shapes.extend(hw)  # type: ignore[arg-type]
        self.labels.append(label)
        self.sources.add(fmt.encode_source(source))

    def finish(self) -> dict[str, dict[str, object]]:
        w = self.work
        return {
            **self.encoded.finish(),
            fmt.JPEG_SHAPES: write_array(w / fmt.JPEG_SHAPES, np.asarray(self.shapes, dtype="<i4")),
            fmt.LABELS: write_array(w / fmt.LABELS, np.asarray(self.labels, dtype="<i8")),
            **self.sources.finish(),
        }
