"""What one packing process does with one chunk of items (runs in worker processes).

Raw chunks are written by a local worker straight into their slots of the memory-mapped
output file, so pixels never cross a pipe; a remote worker (no `raw_path`) returns the pixels
instead. Jpeg chunks return their encoded bytes to the writer.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import numpy as np

from gpufeed.packing import imaging
from gpufeed.packing.imaging import BadImage
from gpufeed.sources import MAX_FILE_BYTES, Item
from gpufeed.sources.images import upright_jpeg
from gpufeed.sources.videos import MAX_VIDEO_BYTES, VideoError, index_video, reencode_video
from gpufeed.store.format import VideoIndex, raw_item_bytes


@dataclass(frozen=True)
class Settings:
    mode: str
    size: int
    fit: str
    quality: int
    max_side: int
    reencode: bool
    max_pixels: int
    # video: the re-encoding asked for (None each: kept as it is), see `sources.videos.reencode_video`
    short_side: int | None = None
    gop: int | None = None
    fps: float | None = None


@dataclass
class Chunk:
    start: int  # slot of the first item in the raw output file
    items: list[Item]
    raw_path: str | None = None  # raw: the output file, when this worker can write it


@dataclass
class Packed:
    """What a worker made of one item: the reason it failed, or what the writer stores."""

    error: str | None = None
    payload: bytes | np.ndarray | None = None  # jpeg: encoded bytes; raw: pixels a remote worker returns
    hw: tuple[int, int] | None = None  # jpeg: the stored image's (h, w)
    source_hw: tuple[int, int] | None = None  # the full image's (h, w) upright: the frame of its boxes
    video: VideoIndex | None = None  # video: the stored file's frame index


def _read(item: Item, limit: int = MAX_FILE_BYTES) -> bytes:
    """The file's bytes: a regular file only (a FIFO would block forever, /dev/zero never end), at
    most `limit` of it."""
    if item.data is not None:
        return item.data
    try:
        # opening a FIFO must not wait for a writer (an item without data has a path)
        fd = os.open(item.path, os.O_RDONLY | os.O_NONBLOCK)  # type: ignore[arg-type]
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BadImage("not a regular file (a FIFO, device or socket)")
            if info.st_size > limit:
                raise BadImage(f"{info.st_size} bytes, more than gpufeed packs ({limit})")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(limit + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise BadImage(f"unreadable: {e.strerror or e}") from None
    if len(data) > limit:
        raise BadImage(f"grew past {limit} bytes while being read")
    if not data:
        raise BadImage("empty file (0 bytes)")
    return data


def _jpeg(data: bytes, s: Settings) -> Packed:
    if not s.reencode:
        kept = imaging.is_plain_jpeg(data, s.max_side)
        if kept is not None:
            problem = imaging.truncated_jpeg(data)  # only the header was read: the rest must be there too
            if problem is not None:
                raise BadImage(problem)
            return Packed(payload=data, hw=kept, source_hw=kept)
    encoded, hw, source_hw = upright_jpeg(data, s.quality, s.max_side, s.max_pixels)  # as a folder read in place
    return Packed(payload=encoded, hw=hw, source_hw=source_hw)


def _video(data: bytes, s: Settings) -> Packed:
    """The video as stored (re-encoded where asked) and its frame index, from decoding it once."""
    try:
        if s.short_side is not None or s.gop is not None or s.fps is not None:
            data = reencode_video(data, s.short_side, s.gop, s.fps)
        index = index_video(data)
    except VideoError as e:
        raise BadImage(str(e)) from None
    hw = (index.height, index.width)
    return Packed(payload=data, hw=hw, source_hw=hw, video=index)


def process(chunk: Chunk, s: Settings) -> list[Packed]:
    """Pack every item of `chunk`; a bad item yields its reason instead of raising."""
    out: np.memmap | None = None
    if s.mode == "raw" and chunk.raw_path is not None:
        item_bytes = raw_item_bytes(s.size)
        out = np.memmap(
            chunk.raw_path,
            dtype=np.uint8,
            mode="r+",
            offset=chunk.start * item_bytes,
            shape=(len(chunk.items), s.size, s.size, 3),
        )
    results: list[Packed] = []
    with imaging.own_bomb_guard():
        for k, item in enumerate(chunk.items):
            try:
                if s.mode == "video":
                    results.append(_video(_read(item, MAX_VIDEO_BYTES), s))
                    continue
                data = _read(item)
                if s.mode == "raw":
                    img, source_hw = imaging.decode_sized(data, "raw", s.size, s.fit, s.max_side, s.max_pixels)
                    square = imaging.fit_square(img, s.size, s.fit)
                    if out is None:
                        results.append(Packed(payload=np.ascontiguousarray(square), source_hw=source_hw))
                        continue
                    out[k] = square
                    results.append(Packed(source_hw=source_hw))
                else:
                    results.append(_jpeg(data, s))
            except BadImage as e:
                results.append(Packed(error=str(e)))
    del out  # pages stay in the shared page cache; the writer fsyncs once at the end
    return results
