"""Collect packed samples into the data files of a store being written."""

from __future__ import annotations

import errno
import os
from array import array
from pathlib import Path

import numpy as np

from gpufeed.store import format as fmt
from gpufeed.store.format import VideoIndex
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

    def abandon(self) -> None:
        self.data.abandon()

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
    compacts away the slots of skipped images. Slots are allocated on disk as they are handed out, so a
    full disk is an OSError (ENOSPC) here, never a worker killed by SIGBUS writing into its memory map."""

    def __init__(self, work: Path, size: int):
        self.work = work
        self.path = work / fmt.RAW_IMAGES
        self.item = fmt.raw_item_bytes(size)
        self.slots = 0
        self.kept: array = array("q")
        self.labels: array = array("q")
        self.sources = _sources(work)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    @property
    def count(self) -> int:
        return len(self.kept)

    def reserve(self, n: int) -> int:
        """Grow the file by `n` slots, their blocks allocated, and return the first one. OSError ENOSPC if
        the disk can't hold them (a sparse file's hole that a worker's memory map writes into, on a full
        disk, kills the worker with SIGBUS)."""
        start = self.slots
        self.slots += n
        try:
            os.posix_fallocate(self._fd, start * self.item, n * self.item)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (ENOSPC above all)
                raise
            os.ftruncate(self._fd, self.slots * self.item)  # a filesystem that can't allocate ahead: sparse
        return start

    def add(self, slot: int, label: int, pixels: np.ndarray | None, hw: tuple[int, int] | None, source: str) -> None:
        if pixels is not None:
            # (numpy's stubs give an ndarray the buffer protocol from Python 3.12 on)
            os.pwrite(self._fd, memoryview(pixels).cast("B"), slot * self.item)  # type: ignore[arg-type, unused-ignore]
        self.kept.append(slot)
        self.labels.append(label)
        self.sources.add(fmt.encode_source(source))

    def abandon(self) -> None:
        """Close what a pack that failed left open (its folder is removed: the space is freed once closed)."""
        self.sources.abandon()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def finish(self) -> dict[str, dict[str, object]]:
        files = {
            fmt.LABELS: write_array(self.work / fmt.LABELS, np.asarray(self.labels, dtype="<i8")),
            **self.sources.finish(),
        }
        os.close(self._fd)
        self._fd = -1
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

    def abandon(self) -> None:
        """Close what a pack that failed left open (its folder is removed: the space is freed once closed)."""
        self.encoded.abandon()
        self.sources.abandon()

    def finish(self) -> dict[str, dict[str, object]]:
        w = self.work
        return {
            **self.encoded.finish(),
            fmt.JPEG_SHAPES: write_array(w / fmt.JPEG_SHAPES, np.asarray(self.shapes, dtype="<i4")),
            fmt.LABELS: write_array(w / fmt.LABELS, np.asarray(self.labels, dtype="<i8")),
            **self.sources.finish(),
        }


class VideoSink(JpegSink):
    """A jpeg sink whose samples are video files, with their frame index (`store.format`, video mode)."""

    def __init__(self, work: Path):
        super().__init__(work)
        self.frames: array = array("q")
        self.frame_offsets: array = array("q", [0])
        self.timing: array = array("q")
        self.packets: array = array("q")
        self.decoding: array = array("q")
        self.nonref: array = array("q")

    def add_video(self, label: int, encoded: bytes, index: VideoIndex, clip: tuple[int, int], source: str) -> None:
        """Video `encoded` (`index`: its frames), its clips taken from frames [clip[0], clip[1])."""
        self.add(0, label, encoded, (index.height, index.width), source)
        rows = np.stack([index.pts, index.keyframe.astype(np.int64), index.packet_bytes], axis=1)
        self.frames.extend(rows.astype(np.int64).ravel().tolist())
        self.frame_offsets.append(self.frame_offsets[-1] + len(index))
        tb = index.time_base
        self.timing.extend([tb.numerator, tb.denominator, index.stream, clip[0], clip[1]])
        if index.packet_at is None or index.codec not in fmt.VIDEO_DECODERS:
            self.packets.extend([-1] * len(index))
            self.decoding.extend([-1, 0, 0])
        else:
            self.packets.extend(index.packet_at.astype(np.int64).tolist())
            self.decoding.extend([fmt.VIDEO_DECODERS.index(index.codec), *index.extradata])
        self.nonref.append(int(index.nonref_exact))

    def finish(self) -> dict[str, dict[str, object]]:
        w = self.work
        return {
            **super().finish(),
            fmt.VIDEO_FRAMES: write_array(w / fmt.VIDEO_FRAMES, np.asarray(self.frames, dtype="<i8")),
            fmt.VIDEO_FRAME_OFFSETS: write_array(
                w / fmt.VIDEO_FRAME_OFFSETS, np.asarray(self.frame_offsets, dtype="<i8")
            ),
            fmt.VIDEO_TIMING: write_array(w / fmt.VIDEO_TIMING, np.asarray(self.timing, dtype="<i8")),
            fmt.VIDEO_PACKETS: write_array(w / fmt.VIDEO_PACKETS, np.asarray(self.packets, dtype="<i8")),
            fmt.VIDEO_DECODING: write_array(w / fmt.VIDEO_DECODING, np.asarray(self.decoding, dtype="<i8")),
            fmt.VIDEO_NONREF: write_array(w / fmt.VIDEO_NONREF, np.asarray(self.nonref, dtype="<i8")),
        }
