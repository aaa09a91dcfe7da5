"""The gpufeed store format, versions 3 and 4: the one place that says what is on disk.

A store is a directory::

    manifest.json     what the store holds (written last: its presence marks a complete store)
    labels.i64        int64[N]            label per sample (-1 = unlabelled)
    sources.bin       uint8[...]          where each sample came from (file path, or shard:key of a
                                          tar member), UTF-8 back to back (undecodable bytes of a
                                          path as surrogate escapes)
    sources.i64       int64[N + 1]        sample i's source is sources.bin[s[i]:s[i + 1]]
    field.NAME.bin    per-sample values of the field NAME (the manifest's "fields" says its kind):
                        int: int64[N]; float: float64[N]; array: DTYPE[N, *SHAPE];
                        str, bytes, json: UTF-8 / raw / JSON text back to back, with
                        boxes (the field "boxes"): float32 [x1, y1, x2, y2] rows back to back;
                        keypoints (the field "keypoints"): float32 [x, y, visibility] for each of
                        the spec's "points" per instance, instances back to back;
                        masks (the field "masks"): per sample, run-length coded planes (below); with
    field.NAME.i64    int64[N + 1]        byte offsets, as sources.i64 (variable kinds only)
    raw mode:
      images.u8       uint8[N, S, S, 3]   HWC pixels, sample i is one contiguous slice
    jpeg mode:
      data.bin        uint8[...]          encoded JPEG bytes, back to back
      offsets.i64     int64[N + 1]        sample i is data.bin[offsets[i]:offsets[i + 1]]
      shapes.i32      int32[N, 2]         (height, width) of each encoded image
    video mode (clips are sampled and decoded by the Loader; a video's rows read as `VideoIndex`):
      data.bin        uint8[...]          each video's container file (MP4, MKV, WebM) as it was, or
                                          as `pack` re-encoded it, back to back
      offsets.i64     int64[N + 1]        video i is data.bin[offsets[i]:offsets[i + 1]]
      shapes.i32      int32[N, 2]         (height, width) of its frames
      frames.i64      int64[F, 3]         every frame of every video in presentation order: its pts
                                          (in the stream's time base), 1 for a keyframe else 0, its
                                          packet's bytes; what random access needs without demuxing
      frame_offsets.i64 int64[N + 1]      video i's frames are frames.i64 rows [f[i], f[i + 1])
      timing.i64      int64[N, 5]         the time base (numerator, denominator), the video stream's
                                          index in its container, and the frames clips are taken
                                          from, [first, end) (a list's start/end bounds; else all)
    and optionally (both or neither; stores packed before they existed lack them, and a gpufeed from
    before refuses a store that holds them as files it does not know), what decoding a
    clip without opening its container needs (`decode.codecs.video`: a clip's packets are read where
    they lie and fed to a decoder of their own; opening an MP4 cost about a tenth of a clip's decode):
      packets.i64     int64[F]            each frame's packet: its byte offset in its video's file,
                                          rows in step with frames.i64 (-1: see decoding.i64)
      decoding.i64    int64[N, 3]         the decoder (an index into VIDEO_DECODERS) and the codec's
                                          extradata, its byte offset and length in the video's file
                                          (0, 0: none); a decoder of -1: the video is decoded through
                                          its container (its packets' offsets are -1)
    and optionally (alone; stores packed before it lack it: none is skipped), which videos' frames may
    be skipped where a clip does not hold them and H.264 marks them unreferenced (`Tuning.skip_nonref`):
      nonref.i64      int64[N]            1 where pack decoded the video again without those frames and
                                          every other frame came out the same (`VideoIndex.nonref_exact`),
                                          else 0

A sample's masks are k planes of the stored image's h x w pixels: one label map (k = 1, the spec's
"instances" false) or one 0/1 mask per instance (instances true, any k, in step with the sample's
boxes). Each plane, read row after row, is cut into runs of equal values. The value is int32
[k, h, w, runs of plane 0, ..., runs of plane k-1, then every run's end (the index of the pixel
after it, increasing within a plane, a plane's last one h * w), then every run's value]. Run-length
coding, not PNG: a loader resamples a mask straight from its runs on the device (on a GPU a binary
search over a plane's runs per pixel of its rows of changes, `augment.fused_masks`), so nothing is
decoded on the CPU, and COCO's own masks are runs already.

Every data file is little-endian, headerless and memory-mappable; the manifest records its
byte size and digest so a damaged store is detected. The digest (CHECKSUM) is the SHA-256 of
the concatenated SHA-256 digests of the file's consecutive 64 MiB blocks, so it is computed
on all cores and in one streaming pass alike. Everything else asks this module.

A version 4 store is **sharded**: its samples lie in self-contained shards, each a version 3 store
of its own (a directory with its manifest and data files), so a shard is one unit to download,
verify and cache. At the top::

    manifest.json     as above, with "shards": [{"name": "shards/00000", "count": samples,
                      "bytes": the shard's bytes, "digest": SHA-256 of its manifest.json}, ...],
                      in sample order; a shard's manifest holds the digests of its data files
    labels.i64        int64[N]            every sample's label (to plan without the shards)
    shapes.i32        int32[N, 2]         jpeg mode: every image's (height, width), the same
    shards/NNNNN/     the shards

Version 1 stores (gpufeed 0.1, without the sources files) still open; they cannot say where a
sample came from. Version 2 stores (gpufeed 0.2) hold no fields.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

FORMAT_NAME = "gpufeed-store"
FORMAT_VERSION = 4  # the newest this gpufeed reads; a store is written as 3, or 4 when sharded
UNSHARDED_VERSION = 3
SHARDED_SINCE = 4  # the format version whose stores lie in shards
SHARDS = "shards"  # the folder of a sharded store's shards
SOURCES_SINCE = 2  # the format version that added sources.bin and sources.i64
FIELDS_SINCE = 3  # the format version that added per-sample fields
MANIFEST = "manifest.json"
MODES = ("raw", "jpeg", "video")
ENCODED_MODES = ("jpeg", "video")  # data.bin, offsets.i64 and shapes.i32: encoded bytes per sample
CHECKSUM = "sha256-tree-64MiB"
CHECKSUM_BLOCK = 64 << 20
FITS = ("crop", "stretch", "pad")

LABELS = "labels.i64"
RAW_IMAGES = "images.u8"
JPEG_DATA = "data.bin"
JPEG_OFFSETS = "offsets.i64"
JPEG_SHAPES = "shapes.i32"
SOURCES = "sources.bin"
SOURCE_OFFSETS = "sources.i64"
VIDEO_FRAMES = "frames.i64"
VIDEO_FRAME_OFFSETS = "frame_offsets.i64"
VIDEO_TIMING = "timing.i64"
VIDEO_PACKETS = "packets.i64"
VIDEO_DECODING = "decoding.i64"
VIDEO_NONREF = "nonref.i64"
VIDEO_FRAME_COLUMNS = 3  # pts, keyframe, packet bytes
VIDEO_TIMING_COLUMNS = 5  # time base numerator, denominator, stream index, first frame, end frame
VIDEO_DECODING_COLUMNS = 3  # decoder, extradata offset, extradata bytes
# FFmpeg decoders a video is decoded with from its packets alone (a decoding.i64 row's decoder indexes
# this: append only). Each gave the frames its container's decode gives, pixel for pixel, from MP4
# and Matroska; MPEG-4 part 2 did not, so it and those not listed decode through their container.
VIDEO_DECODERS = ("h264", "hevc", "vp9", "libdav1d")

DTYPES: dict[str, np.dtype] = {
    LABELS: np.dtype("<i8"),
    RAW_IMAGES: np.dtype("u1"),
    JPEG_DATA: np.dtype("u1"),
    JPEG_OFFSETS: np.dtype("<i8"),
    JPEG_SHAPES: np.dtype("<i4"),
    SOURCES: np.dtype("u1"),
    SOURCE_OFFSETS: np.dtype("<i8"),
    VIDEO_FRAMES: np.dtype("<i8"),
    VIDEO_FRAME_OFFSETS: np.dtype("<i8"),
    VIDEO_TIMING: np.dtype("<i8"),
    VIDEO_PACKETS: np.dtype("<i8"),
    VIDEO_DECODING: np.dtype("<i8"),
    VIDEO_NONREF: np.dtype("<i8"),
}


# per-sample fields: a name (an identifier, none of RESERVED) -> {"kind": one of FIELD_KINDS, and for
# arrays "dtype": one of ARRAY_DTYPES and "shape": [positive ints]}
FIELD_KINDS = ("int", "float", "array", "str", "bytes", "json", "boxes", "keypoints", "masks")
VARIABLE_KINDS = ("str", "bytes", "json", "boxes", "keypoints", "masks")
BOXES = "boxes"  # the field whose values are boxes (xyxy pixels of the stored image, any count per sample)
# the field whose values are keypoints: per instance (any count per sample) the spec's "points" of
# [x, y, visibility], x and y in the stored image's pixels, visibility 0 (not labelled or not in
# the image), 1 (labelled, hidden) or 2 (visible), as COCO's
KEYPOINTS = "keypoints"
MAX_KEYPOINTS = 1024  # points per instance a manifest may declare
# the field whose values are masks: {"kind": "masks", "instances": bool, "dtype": one of MASK_DTYPES}
# (the dtype of a label map's values; instance masks are "|u1" 0/1)
MASKS = "masks"
MASK_DTYPES = ("|u1", "|i1", "<i2", "<i4")
MAX_MASK_PIXELS = (1 << 31) - 1  # a plane's h * w: its run ends are int32
MAX_MASK_PLANES = 1 << 16
RESERVED = ("image", "label", "source")
ARRAY_DTYPES = ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")
_SCALAR_DTYPES = {"int": "<i8", "float": "<f8"}


class StoreError(Exception):
    """A directory is not a usable gpufeed store; the message names the path and the reason."""


def open_own(path: Path) -> int:
    """Open one of a store's files read-only and return its descriptor. A store's files must be its
    own regular files: a symbolic link (to a file outside the store, which the manifest's digest then
    vouches for without owning) and a FIFO or device (opening or reading one may block or never end)
    raise StoreError naming the file; a missing one raises FileNotFoundError. The store directory
    itself may be a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO opens at once
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise StoreError(f"{path}: is a symbolic link (a store's files must be its own)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{path}: not a regular file (a store's files must be its own regular files)")
    return fd


def field_files(name: str, spec: dict[str, Any]) -> tuple[str, ...]:
    """The data files of field `name`: values, and offsets for variable-length kinds."""
    return (f"field.{name}.bin", f"field.{name}.i64") if spec["kind"] in VARIABLE_KINDS else (f"field.{name}.bin",)


def field_dtype(spec: dict[str, Any]) -> np.dtype:
    """The dtype of a field's values file (bytes for variable-length kinds)."""
    if spec["kind"] in VARIABLE_KINDS:
        return np.dtype("u1")
    return np.dtype(spec["dtype"] if spec["kind"] == "array" else _SCALAR_DTYPES[spec["kind"]])


def field_shape(spec: dict[str, Any]) -> tuple[int, ...]:
    """The shape of one sample's value of a fixed-size field (() for scalars)."""
    return tuple(spec["shape"]) if spec["kind"] == "array" else ()


def file_dtype(name: str, fields: dict[str, dict[str, Any]]) -> np.dtype:
    """The dtype of any data file of a store with these fields."""
    if name in DTYPES:
        return DTYPES[name]
    field_name, ext = name[len("field.") :].rsplit(".", 1)
    return np.dtype("<i8") if ext == "i64" else field_dtype(fields[field_name])


def data_files(
    mode: str, version: int = UNSHARDED_VERSION, fields: dict[str, dict[str, Any]] | None = None
) -> tuple[str, ...]:
    """Names of the data files a store of `mode`, format `version` and `fields` holds (a sharded store:
    those at its top, beside its shards)."""
    if version >= SHARDED_SINCE:
        return (LABELS, JPEG_SHAPES) if mode == "jpeg" else (LABELS,)
    sources = (SOURCES, SOURCE_OFFSETS) if version >= SOURCES_SINCE else ()
    extra = tuple(f for name, spec in (fields or {}).items() for f in field_files(name, spec))
    if mode == "raw":
        return (RAW_IMAGES, LABELS, *sources, *extra)
    video = (VIDEO_FRAMES, VIDEO_FRAME_OFFSETS, VIDEO_TIMING) if mode == "video" else ()
    return (JPEG_DATA, JPEG_OFFSETS, JPEG_SHAPES, LABELS, *video, *sources, *extra)


def shard_name(k: int) -> str:
    """The relative path of a sharded store's shard number `k`."""
    return f"{SHARDS}/{k:05d}"


def encode_source(name: str) -> bytes:
    """A source name as stored (a path's undecodable bytes survive as surrogate escapes)."""
    return name.encode("utf-8", "surrogateescape")


def decode_source(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def raw_item_bytes(size: int) -> int:
    """Bytes of one raw sample of side `size`."""
    return size * size * 3


@dataclass
class Manifest:
    """Everything about a store except its pixels."""

    mode: str
    count: int
    image_shape: list[int] | None  # [S, S, 3] for raw, None for jpeg (sizes vary)
    classes: list[str]
    files: dict[str, dict[str, Any]]  # name -> {"bytes": int, "digest": str} (see CHECKSUM)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}
    settings: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-sample fields (version 3)
    shards: list[dict[str, Any]] = field(default_factory=list)  # version 4: {"name", "count", "bytes", "digest"}
    gpufeed_version: str = ""
    created: str = ""
    checksum: str = CHECKSUM
    layout: str = "HWC"
    dtype: str = "uint8"
    format: str = FORMAT_NAME
    version: int = UNSHARDED_VERSION

    def write(self, directory: Path) -> None:
        """Write manifest.json into `directory` (flushed to disk)."""
        path = Path(directory) / MANIFEST
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """Read and validate the manifest of the store at `directory`."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not directory.is_dir():
            raise StoreError(f"{directory}: not a directory")
        try:
            with os.fdopen(open_own(path), "r", encoding="utf-8") as f:
                raw = json.loads(f.read())
        except FileNotFoundError:
            raise StoreError(f"{directory}: not a gpufeed store (no {MANIFEST})") from None
        except RecursionError:  # a hostile manifest of many nested brackets
            raise StoreError(f"{path}: not a valid manifest (nested too deeply)") from None
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: unreadable manifest ({e})") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise StoreError(f"{path}: not a gpufeed store manifest")
        version = raw.get("version")
        if not _is_int(version) or version < 1:
            raise StoreError(f"{path}: store format version {version!r} is not a version (an integer, 1 or more)")
        if version > FORMAT_VERSION:
            raise StoreError(
                f"{path}: store format version {version} is newer than this gpufeed reads "
                f"(up to {FORMAT_VERSION}); upgrade gpufeed"
            )
        try:
            manifest = cls(**raw)
        except TypeError as e:
            raise StoreError(f"{path}: malformed manifest ({e})") from e
        _check_types(manifest, path)
        if manifest.checksum != CHECKSUM:
            raise StoreError(f"{path}: unknown checksum scheme {manifest.checksum!r}")
        manifest._validate(path)
        return manifest

    def _validate(self, path: Path) -> None:
        if self.mode not in MODES:
            raise StoreError(f"{path}: unknown mode {self.mode!r}")
        if not _is_int(self.count) or self.count < 0:
            raise StoreError(f"{path}: bad sample count {self.count!r}")
        if self.mode == "video" and (self.version >= SHARDED_SINCE or self.version < FIELDS_SINCE):
            raise StoreError(f"{path}: a video store is of format version {UNSHARDED_VERSION}, not {self.version}")
        if self.fields and self.version < FIELDS_SINCE:
            raise StoreError(
                f"{path}: store format version {self.version} holds no fields, yet the manifest lists some"
            )
        if self.version >= SHARDED_SINCE:
            self._validate_shards(path)
        elif self.shards:
            raise StoreError(
                f"{path}: store format version {self.version} is not sharded, yet the manifest lists shards"
            )
        expected = data_files(self.mode, self.version, self.fields)
        if self.mode == "video" and (VIDEO_PACKETS in self.files or VIDEO_DECODING in self.files):
            expected += (VIDEO_PACKETS, VIDEO_DECODING)  # (optional, both or neither: the module's docstring)
        if self.mode == "video" and VIDEO_NONREF in self.files:
            expected += (VIDEO_NONREF,)  # (optional, alone)
        missing = [n for n in expected if n not in self.files]
        if missing:
            raise StoreError(f"{path}: manifest lists no entry for {', '.join(missing)}")
        foreign = sorted(set(self.files) - set(expected))
        if foreign:  # e.g. "../x": verify would hash files outside the store
            raise StoreError(f"{path}: manifest lists files a {self.mode} store does not hold: {foreign}")
        shape = self.image_shape  # a list of 3 ints in a raw store (checked by `_check_types`)
        if self.mode == "raw" and not (shape[0] == shape[1] and shape[2] == 3):  # type: ignore[index]
            raise StoreError(f"{path}: a raw store's image_shape is [S, S, 3], got {self.image_shape}")
        for name, size in self.expected_bytes().items():
            if size is not None and self.files[name]["bytes"] != size:
                raise StoreError(
                    f"{path}: {name} recorded as {self.files[name]['bytes']} bytes, "
                    f"expected {size} for {self.count} samples"
                )

    def _validate_shards(self, path: Path) -> None:
        """A sharded manifest's shards: named shards/NNNNN in order (no path leads elsewhere), counts that
        add up to the store's, sizes and digests of the right types."""
        if not isinstance(self.shards, list) or not self.shards:
            raise StoreError(f"{path}: a sharded store's manifest lists no shards")
        for k, shard in enumerate(self.shards):
            if not (
                isinstance(shard, dict)
                and set(shard) == {"name", "count", "bytes", "digest"}
                and shard["name"] == shard_name(k)
                and _is_int(shard["count"])
                and shard["count"] >= 0
                and _is_int(shard["bytes"])
                and shard["bytes"] >= 0
                and isinstance(shard["digest"], str)
                and re.fullmatch(r"[0-9a-f]{64}", shard["digest"])
            ):
                raise StoreError(
                    f"{path}: manifest field shards[{k}] is {shard!r}, not "
                    f'{{"name": "{shard_name(k)}", "count": int, "bytes": int, "digest": sha256 hex}}'
                )
        total = sum(shard["count"] for shard in self.shards)
        if total != self.count:
            raise StoreError(f"{path}: the shards hold {total} samples, the manifest says {self.count}")

    def expected_bytes(self) -> dict[str, int | None]:
        """Size each data file must have, or None where only the manifest knows (jpeg data)."""
        n = self.count
        if self.version >= SHARDED_SINCE:
            return {LABELS: n * 8, **({JPEG_SHAPES: n * 8} if self.mode == "jpeg" else {})}
        sources = {SOURCES: None, SOURCE_OFFSETS: (n + 1) * 8} if self.version >= SOURCES_SINCE else {}
        for name, spec in self.fields.items():
            files = field_files(name, spec)
            if spec["kind"] in VARIABLE_KINDS:
                sources |= {files[0]: None, files[1]: (n + 1) * 8}
            else:
                sources[files[0]] = n * field_dtype(spec).itemsize * int(np.prod(field_shape(spec), dtype=np.int64))
        if self.mode == "raw":
            side = self.image_shape[0]  # type: ignore[index]  # (raw: [S, S, 3])
            return {RAW_IMAGES: n * raw_item_bytes(side), LABELS: n * 8, **sources}
        if self.mode == "video":
            sources |= {
                VIDEO_FRAMES: None,
                VIDEO_FRAME_OFFSETS: (n + 1) * 8,
                VIDEO_TIMING: n * VIDEO_TIMING_COLUMNS * 8,
            }
            if VIDEO_DECODING in self.files:
                sources |= {VIDEO_PACKETS: None, VIDEO_DECODING: n * VIDEO_DECODING_COLUMNS * 8}
            if VIDEO_NONREF in self.files:
                sources[VIDEO_NONREF] = n * 8
        return {JPEG_DATA: None, JPEG_OFFSETS: (n + 1) * 8, JPEG_SHAPES: n * 8, LABELS: n * 8, **sources}


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(m: Manifest, path: Path) -> None:
    """Raise StoreError naming the first field of `m` whose type or range is wrong: a manifest is
    untrusted input, and every later step relies on these."""

    def bad(what: str, value) -> StoreError:
        return StoreError(f"{path}: manifest field {what} is {value!r}, not {_EXPECTED[what.split('[')[0]]}")

    if not isinstance(m.mode, str):
        raise bad("mode", m.mode)
    shape = m.image_shape
    if m.mode == "raw" and not (
        isinstance(shape, list) and len(shape) == 3 and all(_is_int(x) and x > 0 for x in shape)
    ):
        raise bad("image_shape", shape)
    if m.mode != "raw" and shape is not None:
        raise bad("image_shape", shape)
    if not isinstance(m.classes, list) or not all(isinstance(c, str) for c in m.classes):
        raise bad("classes", m.classes)
    if not isinstance(m.files, dict):
        raise bad("files", m.files)
    for name, entry in m.files.items():
        if not (
            isinstance(entry, dict)
            and _is_int(entry.get("bytes"))
            and entry["bytes"] >= 0
            and isinstance(entry.get("digest"), str)
        ):
            raise bad(f"files[{name!r}]", entry)
    if not isinstance(m.skipped, list) or not all(isinstance(x, dict) for x in m.skipped):
        raise bad("skipped", m.skipped)
    if not isinstance(m.settings, dict):
        raise bad("settings", m.settings)
    if not isinstance(m.fields, dict):
        raise bad("fields", m.fields)
    for name, spec in m.fields.items():
        if not valid_field(name, spec):
            raise bad(f"fields[{name!r}]", spec)


def valid_field_name(name: object) -> bool:
    return isinstance(name, str) and name.isidentifier() and name.isascii() and name not in RESERVED


def valid_field(name: object, spec: object) -> bool:
    """Whether a manifest's field entry is one this format defines (it names files and dtypes: untrusted)."""
    if not valid_field_name(name) or not isinstance(spec, dict) or spec.get("kind") not in FIELD_KINDS:
        return False
    if any((name == field) != (spec["kind"] == field) for field in (BOXES, KEYPOINTS, MASKS)):
        return False
    if spec["kind"] == "masks":
        return (
            set(spec) == {"kind", "instances", "dtype"}
            and isinstance(spec["instances"], bool)
            and spec["dtype"] in MASK_DTYPES
            and (not spec["instances"] or spec["dtype"] == "|u1")
        )
    if spec["kind"] == "keypoints":
        points = spec.get("points")
        return set(spec) == {"kind", "points"} and _is_int(points) and 0 < points <= MAX_KEYPOINTS
    if spec["kind"] != "array":
        return set(spec) == {"kind"}
    shape = spec.get("shape")
    return (
        set(spec) == {"kind", "dtype", "shape"}
        and spec.get("dtype") in ARRAY_DTYPES
        and isinstance(shape, list)
        and len(shape) <= 8
        and all(_is_int(x) and 0 < x <= 1 << 24 for x in shape)
    )


_EXPECTED = {
    "mode": "a string",
    "image_shape": "[S, S, 3] for raw stores and null for jpeg stores",
    "classes": "a list of strings",
    "files": 'an object of {"bytes": int >= 0, "digest": str}',
    "skipped": "a list of objects",
    "settings": "an object",
    "fields": 'an object of {name: {"kind": int|float|array|str|bytes|json, arrays also "dtype" '
    'and "shape"}} with identifier names other than image, label and source, and '
    '{"boxes": {"kind": "boxes"}}, {"keypoints": {"kind": "keypoints", "points": 1..1024}}, '
    '{"masks": {"kind": "masks", "instances": bool, "dtype": "|u1", "|i1", "<i2" or "<i4"}}',
}


@dataclass(frozen=True)
class VideoIndex:
    """One video's frames in presentation order: `pts` (int64, in `time_base` seconds), `keyframe`
    (bool) and `packet_bytes`; the frame size, the codec and the stream's index in its container;
    where its packets can be decoded without the container (`codec` one of VIDEO_DECODERS), each
    frame's packet's byte offset in the file (`packet_at`) and the codec's `extradata` (offset,
    length; (0, 0): none), else None; whether its unreferenced frames can be skipped (`nonref_exact`).
    What packing finds in a video file (`sources.videos.index_video`) and a video store's rows of it
    give back (`store.reader.Store.video`)."""

    pts: np.ndarray
    keyframe: np.ndarray
    packet_bytes: np.ndarray
    time_base: Fraction
    height: int
    width: int
    codec: str
    stream: int
    packet_at: np.ndarray | None = None
    extradata: tuple[int, int] = (0, 0)
    # H.264 whose frames marked unreferenced were skipped in a second decode at pack time, every other
    # frame then as the whole decode gave it: a clip's decode may skip those it does not hold
    # (`sources.videos._skips_exactly`, `Tuning.skip_nonref`)
    nonref_exact: bool = False

    def __len__(self) -> int:
        return len(self.pts)

    @property
    def seconds(self) -> np.ndarray:
        """Each frame's presentation time in seconds from the first frame's."""
        return (self.pts - self.pts[0]).astype(np.float64) * float(self.time_base)


@dataclass
class MaskRuns:
    """One sample's masks as stored: k planes of h x w pixels, plane j's runs `counts[j]` of them, in
    order in `ends` (int32, the pixel after each run, row after row) and `values` (int32)."""

    h: int
    w: int
    counts: np.ndarray
    ends: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.counts)

    def planes(self, keep: np.ndarray) -> MaskRuns:
        """Only the planes where `keep` (bool, one per plane) is set."""
        runs = np.repeat(np.asarray(keep, bool), self.counts)
        return MaskRuns(self.h, self.w, self.counts[keep], self.ends[runs], self.values[runs])

    def lengths(self) -> np.ndarray:
        """Each run's length: its end less the run's before, a plane's first from pixel 0 (in the ends'
        dtype: int32 ends are at most MAX_MASK_PIXELS, so their differences fit)."""
        lengths = np.diff(self.ends, prepend=0)
        first = (np.cumsum(self.counts) - self.counts)[1:]  # (plane 0's first starts at 0 already)
        lengths[first] = self.ends[first]
        return lengths

    def decode(self) -> np.ndarray:
        """The planes as a (k, h, w) int32 array."""
        return np.repeat(self.values, self.lengths()).reshape(len(self.counts), self.h, self.w)


def encode_masks(planes: np.ndarray) -> bytes:
    """(k, h, w) integer planes as their runs (the layout the module's docstring gives)."""
    k, h, w = planes.shape
    if not k:
        return np.array([0, h, w], "<i4").tobytes()
    flat = planes.reshape(k, h * w)
    change = np.ones((k, h * w), bool)
    change[:, 1:] = flat[:, 1:] != flat[:, :-1]  # a run starts here
    plane, start = np.nonzero(change)
    ends = np.empty_like(start)
    ends[:-1], ends[-1:] = start[1:], h * w
    last = np.r_[plane[1:] != plane[:-1], True]  # a plane's last run ends at h * w
    ends[last] = h * w
    counts = np.bincount(plane, minlength=k)
    head = np.array([k, h, w], np.int64)
    parts = (head, counts, ends, flat[plane, start])
    return b"".join(np.asarray(a).astype("<i4").tobytes() for a in parts)


def parse_masks(raw: bytes, where: str) -> MaskRuns:
    """A sample's stored masks, checked: StoreError naming `where` for bytes that are not whole,
    consistent runs (a damaged or hostile store)."""
    a = np.frombuffer(raw, "<i4")
    bad = lambda why: StoreError(f"{where}: {why} (damaged store)")  # noqa: E731
    if len(raw) % 4 or len(a) < 3:
        raise bad("masks shorter than their header")
    k, h, w = (int(x) for x in a[:3])
    if not (0 <= k <= MAX_MASK_PLANES and h > 0 and w > 0 and h * w <= MAX_MASK_PIXELS) or len(a) < 3 + k:
        raise bad(f"masks of {k} planes of {h}x{w} pixels")
    counts = a[3 : 3 + k].astype(np.int64)
    runs = int(counts.sum())
    if (counts < 1).any() or len(a) != 3 + k + 2 * runs:
        raise bad("masks whose run counts do not match their bytes")
    masks = MaskRuns(h, w, counts, a[3 + k : 3 + k + runs], a[3 + k + runs :])
    if runs and ((masks.lengths() < 1).any() or (masks.ends[np.cumsum(counts) - 1] != h * w).any()):
        raise bad("masks whose runs are not in order or do not cover the image")
    return masks
