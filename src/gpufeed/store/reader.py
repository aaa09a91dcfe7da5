"""Open a store in O(1): read the manifest, check file sizes, memory-map the data files."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gpufeed.decode.base import as_tensor
from gpufeed.store import format as fmt
from gpufeed.store.fields import FieldColumn
from gpufeed.store.format import Manifest, StoreError, VideoIndex


def map_checked(
    directory: Path, manifest: Manifest, name: str, shape: tuple[int, ...], mapped: dict[str, np.ndarray] | None = None
) -> np.ndarray:
    """Memory-map one data file read-only (private writable maps of huge files exhaust commit), the
    file opened once (`fmt.open_own`: no symbolic link, FIFO or device) and its size checked on
    that descriptor, so what is checked is what is mapped. `mapped`: where the map is kept by name
    (for `Store.check_unchanged`)."""
    array = _map(directory, manifest, name, shape)
    if mapped is not None:
        mapped[name] = array
    return array


def _map(directory: Path, manifest: Manifest, name: str, shape: tuple[int, ...]) -> np.ndarray:
    path = directory / name
    try:
        fd = fmt.open_own(path)
    except FileNotFoundError:
        raise StoreError(f"{path}: data file missing") from None
    with io.FileIO(fd, "rb") as f:
        actual = os.fstat(fd).st_size
        recorded = manifest.files[name]["bytes"]
        if actual != recorded:
            raise StoreError(f"{path}: {actual} bytes on disk, manifest says {recorded} (damaged store)")
        dtype = fmt.file_dtype(name, manifest.fields)
        if actual == 0:
            return np.zeros(shape, dtype=dtype)
        f.name = str(path.resolve())  # the memmap's filename, which decode worker processes map
        return np.memmap(f, dtype=dtype, mode="r", shape=shape)


def _check_entries(path: Path, bad: np.ndarray, what: str) -> None:
    """Raise StoreError naming the first entry of `path` where `bad` is true (a damaged or hostile
    store: later steps index memory with these values)."""
    if bad.any():
        raise StoreError(f"{path}: entry {int(np.argmax(bad))} {what} (damaged store)")


class Described:
    """What a store's manifest and labels say, for a store packed in one piece (`Store`) and one in
    shards (`store.sharded.ShardedStore`) alike: they set `manifest` and `_labels`."""

    manifest: fmt.Manifest
    _labels: np.ndarray
    path: Path

    def __len__(self) -> int:
        """Samples in the store."""
        return self.manifest.count

    @property
    def mode(self) -> str:
        """The kind: "raw" (fixed-size pixels) or "jpeg" (encoded bytes)."""
        return self.manifest.mode

    @property
    def classes(self) -> list[str]:
        """Class names; label i is classes[i] (empty for an unlabelled store)."""
        return list(self.manifest.classes)

    @property
    def categories(self) -> dict[int, str]:
        """A store packed from a COCO annotation file: its categories, id -> name, in id order. Its
        objects' ids (the field "category") are these, gaps kept (COCO's 80 run from 1 to 90);
        `classes` holds the same names in the same order, and `loader.category_labels` maps the ids
        onto 1..C. Empty for a store packed from anything else, or by a gpufeed that did not record
        them.

        Raises:
            StoreError: the manifest's record of them is malformed (it names the manifest).
        """
        pairs = self.manifest.settings.get("categories", [])
        if not (
            isinstance(pairs, list)
            and all(isinstance(p, list) and len(p) == 2 and fmt._is_int(p[0]) and isinstance(p[1], str) for p in pairs)
            and len({p[0] for p in pairs}) == len(pairs)
        ):
            raise StoreError(
                f"{self.path}/{fmt.MANIFEST}: manifest field settings.categories is not a list of [id, name] "
                "with ids unique"
            )
        return {p[0]: p[1] for p in sorted(pairs)}

    @property
    def labels(self) -> torch.Tensor:
        """int64 labels of all samples (a view of the memory map)."""
        return as_tensor(self._labels)

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) of every raw sample; None for jpeg stores, whose sizes vary."""
        shape = self.manifest.image_shape
        return tuple(shape) if shape else None  # type: ignore[return-value]  # (raw: [S, S, 3])

    @property
    def fields(self) -> dict[str, dict]:
        """The per-sample fields besides image, label and source: name -> {"kind", and for arrays
        "dtype" and "shape"}."""
        return {name: dict(spec) for name, spec in self.manifest.fields.items()}

    @functools.cached_property
    def digest(self) -> str:
        """The store's identity (SHA-256, hex): of its mode, count and the digests its manifest records of
        its contents (each data file's; a sharded store's top files' and each shard's manifest's), not of
        when or by which gpufeed it was packed. The same store read from a bucket or a copy on disk has
        the same one; a store packed again from other images, or in another order, has another. A
        Loader's `state_dict` keeps it, so a resume on another store is refused."""
        m = self.manifest
        contents = {
            "mode": m.mode,
            "count": m.count,
            "files": {name: entry["digest"] for name, entry in m.files.items()},
            "shards": [shard["digest"] for shard in m.shards],
        }
        return hashlib.sha256(json.dumps(contents, sort_keys=True).encode()).hexdigest()


class Store(Described):
    """A packed dataset: `len(store)`, `store[i] -> (CHW uint8 tensor, label)`.

    The arrays are read-only memory maps: nothing is read until it is used, so a store of
    any size opens without reading its pixels or encoded bytes. Opening range-checks the small
    per-sample arrays (labels, sources; offsets and shapes of a jpeg store), which later steps index
    memory with: a vectorised pass, milliseconds per million samples
    (docs/benchmarks.md, "Packing and opening a store"). Tensors it returns are views: don't write.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = Manifest.read(self.path)
        if self.manifest.version >= fmt.SHARDED_SINCE:
            raise StoreError(
                f"{self.path}: a sharded store (format version {self.manifest.version}): open it with "
                "gpufeed.open, which reads its shards"
            )
        self._mapped: dict[str, np.ndarray] = {}  # data file name -> its memory map (`check_unchanged`)
        m = self.manifest
        self._labels = self._open(fmt.LABELS, (m.count,))
        if m.mode == "raw":
            side = m.image_shape[0]  # type: ignore[index]  # (raw: [S, S, 3])
            self.images = self._open(fmt.RAW_IMAGES, (m.count, side, side, 3))
        else:
            self.data = self._open(fmt.JPEG_DATA, (m.files[fmt.JPEG_DATA]["bytes"],))
            self.offsets = self._open(fmt.JPEG_OFFSETS, (m.count + 1,))
            self.shapes = self._open(fmt.JPEG_SHAPES, (m.count, 2))
            if m.count and int(self.offsets[-1]) != self.data.shape[0]:
                raise StoreError(
                    f"{self.path / fmt.JPEG_OFFSETS}: last offset {int(self.offsets[-1])} "
                    f"!= {self.data.shape[0]} bytes of {fmt.JPEG_DATA} (damaged store)"
                )
            if int(self.offsets[0]) != 0:
                raise StoreError(
                    f"{self.path / fmt.JPEG_OFFSETS}: entry 0 is {int(self.offsets[0])}, not 0 (damaged store)"
                )
            _check_entries(
                self.path / fmt.JPEG_OFFSETS, np.diff(self.offsets, prepend=0) < 0, "is smaller than the one before"
            )
            not_positive = (self.shapes <= 0).any(axis=1)  # (an array: numpy's stubs allow a scalar)
            _check_entries(self.path / fmt.JPEG_SHAPES, not_positive, "is not a positive size")  # type: ignore[arg-type, unused-ignore]
            if m.mode == "video":
                self._open_video_index()
        self._sources = self._source_offsets = None
        if m.version >= fmt.SOURCES_SINCE:
            self._sources = self._open(fmt.SOURCES, (m.files[fmt.SOURCES]["bytes"],))
            self._source_offsets = self._open(fmt.SOURCE_OFFSETS, (m.count + 1,))
            ends = self._source_offsets
            _check_entries(
                self.path / fmt.SOURCE_OFFSETS,
                (np.diff(ends, prepend=0) < 0) | (ends > self._sources.shape[0]),
                "is out of order or past the end of " + fmt.SOURCES,
            )
        self._fields = {
            name: FieldColumn(
                name, spec, self._open, self.path, m.count, m.files[fmt.field_files(name, spec)[0]]["bytes"]
            )
            for name, spec in m.fields.items()
        }
        bad = (self._labels < -1) | (self._labels >= len(m.classes)) if m.classes else self._labels < -1
        _check_entries(
            self.path / fmt.LABELS, bad, f"is not -1 or a class of {len(m.classes)}" if m.classes else "is below -1"
        )

    def _open_video_index(self) -> None:
        """A video store's frame index (`frames`, `frame_offsets`, `timing`), range-checked as the
        offsets are: the loader seeks with it."""
        m = self.manifest
        n_frames = m.files[fmt.VIDEO_FRAMES]["bytes"] // (8 * fmt.VIDEO_FRAME_COLUMNS)
        self.frames = self._open(fmt.VIDEO_FRAMES, (n_frames, fmt.VIDEO_FRAME_COLUMNS))
        self.frame_offsets = self._open(fmt.VIDEO_FRAME_OFFSETS, (m.count + 1,))
        self.timing = self._open(fmt.VIDEO_TIMING, (m.count, fmt.VIDEO_TIMING_COLUMNS))
        ends = self.frame_offsets
        _check_entries(
            self.path / fmt.VIDEO_FRAME_OFFSETS,
            np.concatenate([ends[:1] != 0, np.diff(ends) <= 0]) | (ends > n_frames),
            f"is out of order or past the {n_frames} frames of " + fmt.VIDEO_FRAMES,
        )
        counts = np.diff(ends)
        rows = self.frames
        later = np.diff(rows[:, 0]) > 0  # within a video, each frame after the one before it
        later[ends[1:-1] - 1] = True  # (across two videos: anything)
        _check_entries(
            self.path / fmt.VIDEO_FRAMES, ~np.concatenate([[True], later]), "is not later than the frame before it"
        )
        starts = np.zeros(n_frames, bool)
        starts[ends[:-1]] = True
        _check_entries(self.path / fmt.VIDEO_FRAMES, starts & (rows[:, 1] != 1), "begins a video but is no keyframe")
        t = self.timing
        _check_entries(
            self.path / fmt.VIDEO_TIMING,
            (t[:, 0] <= 0) | (t[:, 1] <= 0) | (t[:, 2] < 0) | (t[:, 3] < 0) | (t[:, 4] <= t[:, 3]) | (t[:, 4] > counts),
            "is not a time base, a stream and a frame range [first, end) within the video",
        )
        # (a store packed before they existed: every video decodes through its container)
        self.packets: np.ndarray | None = None
        self.decoding: np.ndarray | None = None
        if fmt.VIDEO_DECODING in m.files:
            self._open_packets(n_frames, counts)
        self.nonref: np.ndarray | None = None  # (a store packed before it: no video's frames skipped)
        if fmt.VIDEO_NONREF in m.files:
            nonref = self._open(fmt.VIDEO_NONREF, (m.count,))
            _check_entries(self.path / fmt.VIDEO_NONREF, (nonref != 0) & (nonref != 1), "is not 0 or 1")
            self.nonref = nonref

    def _open_packets(self, n_frames: int, counts: np.ndarray) -> None:
        """The packets' offsets and each video's decoder and extradata (`store.format`), checked to lie
        within their video's bytes: a decode reads them where they say."""
        m = self.manifest
        recorded = m.files[fmt.VIDEO_PACKETS]["bytes"]
        if recorded != n_frames * 8:
            raise StoreError(
                f"{self.path / fmt.VIDEO_PACKETS}: recorded as {recorded} bytes, expected {n_frames * 8} "
                f"for the {n_frames} frames of {fmt.VIDEO_FRAMES}"
            )
        packets = self._open(fmt.VIDEO_PACKETS, (n_frames,))
        d = self._open(fmt.VIDEO_DECODING, (m.count, fmt.VIDEO_DECODING_COLUMNS))
        sizes = np.diff(np.asarray(self.offsets))
        direct = d[:, 0] >= 0
        _check_entries(
            self.path / fmt.VIDEO_DECODING,
            (d[:, 0] < -1)
            | (d[:, 0] >= len(fmt.VIDEO_DECODERS))
            | (direct & ((d[:, 1] < 0) | (d[:, 1] > sizes) | (d[:, 2] < 0) | (d[:, 2] > sizes - d[:, 1]))),
            f"is not a decoder of {len(fmt.VIDEO_DECODERS)} (or -1) and extradata within the video",
        )
        used = int(counts.sum())  # (rows of frames.i64 past the last video's are no frame's)
        at = np.asarray(packets)[:used]
        size = np.repeat(sizes, counts)
        nbytes = self.frames[:used, 2]  # (compared as differences: no sum of two hostile values overflows)
        outside = (at < 0) | (at >= size) | (nbytes <= 0) | (nbytes > size - at)
        _check_entries(
            self.path / fmt.VIDEO_PACKETS,
            np.where(np.repeat(direct, counts), outside, at != -1),
            "is not within its video's bytes (or -1 where the video decodes through its container)",
        )
        self.packets, self.decoding = packets, d

    def video(self, i: int) -> VideoIndex:
        """Video `i`'s frame index (video stores): pts, keyframes, packet bytes, time base, frame size, and
        where its packets lie where it decodes without its container."""
        if self.mode != "video":
            raise TypeError(f"{self.path}: video() needs a video store, this one is {self.mode}")
        i = self._index(i)
        a, b = int(self.frame_offsets[i]), int(self.frame_offsets[i + 1])
        rows = np.asarray(self.frames[a:b])
        num, den, stream = (int(v) for v in self.timing[i, :3])
        h, w = (int(v) for v in self.shapes[i])
        decoder, extra_at, extra_bytes = (int(v) for v in self.decoding[i]) if self.decoding is not None else (-1, 0, 0)
        alone = decoder >= 0  # (else through its container)
        return VideoIndex(
            rows[:, 0],
            rows[:, 1] != 0,
            rows[:, 2],
            Fraction(num, den),
            h,
            w,
            fmt.VIDEO_DECODERS[decoder] if alone else "",
            stream,
            np.asarray(self.packets[a:b]) if alone else None,  # type: ignore[index]
            (extra_at, extra_bytes) if alone else (0, 0),
            self.nonref is not None and bool(self.nonref[i]),
        )

    def through_container(self) -> int:
        """How many videos (video stores) decode through their containers, not from their packets
        alone: every one where the store was packed before packets were indexed."""
        if self.decoding is None:
            return len(self)
        return int((np.asarray(self.decoding[:, 0]) < 0).sum())

    def frame(self, i: int, t: int | None = None) -> torch.Tensor:
        """Frame `t` of video `i` (default: the middle of its clip range) as a uint8 CHW tensor."""
        i = self._index(i)
        first, end = self.clip_range(i)
        t = (first + end) // 2 if t is None else t
        count = int(self.frame_offsets[i + 1] - self.frame_offsets[i])
        if not 0 <= t < count:
            raise IndexError(f"frame {t} out of range for video {i} of {count} frames")
        return self._frames(i, np.array([t]))[0]

    def _frames(self, i: int, frames: np.ndarray) -> torch.Tensor:
        """Frames `frames` (within the video) of video `i` (0 <= i < len), decoded by PyAV, as a uint8
        TCHW tensor."""
        from gpufeed.decode.codecs.video import ClipRequest, decode_clip

        index = self.video(i)
        request = ClipRequest(self.encoded(i).numpy().data, index.pts, index.keyframe, index.stream, frames)
        return torch.from_numpy(decode_clip(request)).permute(0, 3, 1, 2)

    def clip_range(self, i: int) -> tuple[int, int]:
        """The frames [first, end) of video `i` its clips are taken from (a list's start/end bounds)."""
        i = self._index(i)
        return int(self.timing[i, 3]), int(self.timing[i, 4])

    def _open(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self._mapped[name] = array = _map(self.path, self.manifest, name, shape)
        return array

    def check_unchanged(self) -> None:
        """Raise StoreError naming a data file whose size changed since the store opened. A file
        truncated under its memory map kills the process with SIGBUS (exit 135, "Bus error") at the
        first read past its new end, which no handler can turn into an error; checking the mapped
        files' sizes (one fstat each, through the maps' own descriptors) before reading lets a
        reader say so instead. A store replaced by a new one (a pack with overwrite, a renamed
        directory) passes: the old files stay mapped and whole until the store is closed."""
        for name, array in self._mapped.items():
            mm = getattr(array, "_mmap", None)  # None for an empty file, which maps nothing
            now, then = (mm.size(), array.nbytes) if mm is not None else (0, 0)
            if now != then:
                raise StoreError(
                    f"{self.path / name}: {now} bytes now, {then} when opened: changed while "
                    "read (a store must not change while it is read; pack to a new path and "
                    "swap it in)"
                )

    @property
    def nbytes(self) -> int:
        """Size of the data files on disk."""
        return sum(f["bytes"] for f in self.manifest.files.values())

    def encoded(self, i: int) -> torch.Tensor:
        """The stored bytes of sample `i` (a jpeg store's JPEG, a video store's container file), as a uint8
        tensor."""
        if self.mode == "raw":
            raise TypeError(f"{self.path}: encoded() needs a jpeg or video store, this one is {self.mode}")
        i = self._index(i)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return as_tensor(self.data[start:end])

    def source(self, i: int) -> str:
        """Where sample `i` came from: the file's path as packed, or `shard.tar:key` for a tar member."""
        if self._sources is None:
            raise StoreError(
                f"{self.path}: packed by gpufeed {self.manifest.gpufeed_version or '< 0.2'} "
                f"(store format v{self.manifest.version}), which did not record sources; "
                "pack it again to have them"
            )
        i = self._index(i)
        offsets = self._source_offsets  # (opened with the sources)
        start, end = int(offsets[i]), int(offsets[i + 1])  # type: ignore[index]
        return fmt.decode_source(bytes(self._sources[start:end]))

    def field(self, name: str, i: int):
        """Sample `i`'s value of field `name`: an int, float, numpy array, str, bytes or parsed JSON
        ("label" and "source" work too)."""
        i = self._index(i)
        if name == "label":
            return int(self._labels[i])
        if name == "source":
            return self.source(i)
        return self.column(name).value(i)

    def column(self, name: str) -> FieldColumn:
        """Field `name` of every sample (see `FieldColumn`)."""
        if name not in self._fields:
            known = ", ".join(["label", "source", *self._fields]) or "none"
            raise KeyError(f"{self.path}: no field {name!r} (this store has: {known})")
        return self._fields[name]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """(uint8 CHW image, label) of sample `i`: a read-only view for raw stores, decoded for jpeg (by
        Pillow, RGB, into a tensor of its own); for a video store, (uint8 TCHW frames, label), every frame
        of the video's clip range, decoded by PyAV."""
        i = self._index(i)
        label = int(self._labels[i])
        if self.mode == "video":  # every frame of its clip range: (T, C, H, W)
            return self._frames(i, np.arange(*self.clip_range(i))), label
        if self.mode == "raw":
            return as_tensor(self.images[i]).permute(2, 0, 1), label
        # (numpy's stubs give an ndarray the buffer protocol from Python 3.12 on)
        with Image.open(io.BytesIO(self.encoded(i).numpy())) as img:  # type: ignore[arg-type, unused-ignore]
            rgb = np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
        return torch.from_numpy(rgb.transpose(2, 0, 1).copy()), label

    def _index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a store of {n}")
        return i % n

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, mode={self.mode!r}, count={len(self)})"
