"""The gpufeed store format, version 1: the one place that says what is on disk.

A store is a directory::

    manifest.json     what the store holds (written last: its presence marks a complete store)
    labels.i64        int64[N]            label per sample (-1 = unlabelled)
    raw mode:
      images.u8       uint8[N, S, S, 3]   HWC pixels, sample i is one contiguous slice
    jpeg mode:
      data.bin        uint8[...]          encoded JPEG bytes, back to back
      offsets.i64     int64[N + 1]        sample i is data.bin[offsets[i]:offsets[i + 1]]
      shapes.i32      int32[N, 2]         (height, width) of each encoded image

Every data file is little-endian, headerless and memory-mappable; the manifest records its
byte size and digest so a damaged store is detected. The digest (CHECKSUM) is the SHA-256 of
the concatenated SHA-256 digests of the file's consecutive 64 MiB blocks, so it is computed
on all cores and in one streaming pass alike. Everything else asks this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "gpufeed-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODES = ("raw", "jpeg")
CHECKSUM = "sha256-tree-64MiB"
CHECKSUM_BLOCK = 64 << 20
FITS = ("crop", "stretch", "pad")

LABELS = "labels.i64"
RAW_IMAGES = "images.u8"
JPEG_DATA = "data.bin"
JPEG_OFFSETS = "offsets.i64"
JPEG_SHAPES = "shapes.i32"

DTYPES = {
    LABELS: np.dtype("<i8"),
    RAW_IMAGES: np.dtype("u1"),
    JPEG_DATA: np.dtype("u1"),
    JPEG_OFFSETS: np.dtype("<i8"),
    JPEG_SHAPES: np.dtype("<i4"),
}


class StoreError(Exception):
    """A directory is not a usable gpufeed store; the message names the path and the reason."""


def data_files(mode: str) -> tuple[str, ...]:
    """Names of the data files a store of `mode` holds."""
    if mode == "raw":
        return (RAW_IMAGES, LABELS)
    return (JPEG_DATA, JPEG_OFFSETS, JPEG_SHAPES, LABELS)


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
    gpufeed_version: str = ""
    created: str = ""
    checksum: str = CHECKSUM
    layout: str = "HWC"
    dtype: str = "uint8"
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

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
        if not path.is_file():
            raise StoreError(f"{directory}: not a gpufeed store (no {MANIFEST})")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: unreadable manifest ({e})") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise StoreError(f"{path}: not a gpufeed store manifest")
        version = raw.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise StoreError(
                f"{path}: store format version {version} is newer than this gpufeed reads "
                f"(up to {FORMAT_VERSION}); upgrade gpufeed"
            )
        try:
            manifest = cls(**raw)
        except TypeError as e:
            raise StoreError(f"{path}: malformed manifest ({e})") from e
        if manifest.checksum != CHECKSUM:
            raise StoreError(f"{path}: unknown checksum scheme {manifest.checksum!r}")
        manifest._validate(path)
        return manifest

    def _validate(self, path: Path) -> None:
        if self.mode not in MODES:
            raise StoreError(f"{path}: unknown mode {self.mode!r}")
        if not isinstance(self.count, int) or self.count < 0:
            raise StoreError(f"{path}: bad sample count {self.count!r}")
        missing = [n for n in data_files(self.mode) if n not in self.files]
        if missing:
            raise StoreError(f"{path}: manifest lists no entry for {', '.join(missing)}")
        for name, expected in self.expected_bytes().items():
            if expected is not None and self.files[name]["bytes"] != expected:
                raise StoreError(
                    f"{path}: {name} recorded as {self.files[name]['bytes']} bytes, "
                    f"expected {expected} for {self.count} samples"
                )

    def expected_bytes(self) -> dict[str, int | None]:
        """Size each data file must have, or None where only the manifest knows (jpeg data)."""
        n = self.count
        if self.mode == "raw":
            side = self.image_shape[0]
            return {RAW_IMAGES: n * raw_item_bytes(side), LABELS: n * 8}
        return {JPEG_DATA: None, JPEG_OFFSETS: (n + 1) * 8, JPEG_SHAPES: n * 8, LABELS: n * 8}
