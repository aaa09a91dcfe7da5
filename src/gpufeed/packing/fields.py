"""Per-sample fields while packing: what each source offers, and the writer of their data files.

Fields come from a CSV list's extra columns (typed over all rows by `csv_column`: numbers, missing
cells NaN; arrays; else text), a JSONL list's extra keys (JSON types as they are: objects and lists
stay JSON, except lists of numbers of one shape in every row, which are arrays), a tar sample's
`.json`, `.txt` and `.npy` members (under those names), and a dataset's dict keys besides its
image and label (numbers, strings, bytes, arrays and tensors, JSON values). A field's first value
fixes its kind (and an array's dtype and shape). Numbers and arrays must be in every sample from
the first one kept; text, bytes and JSON may be missing (stored empty: "", b"", null). A sample
that breaks this is skipped with the reason, like a bad image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.packing.sinks import Appended, write_array
from gpufeed.store import format as fmt
from gpufeed.store.writer import HashingWriter

INT64 = (-(1 << 63), (1 << 63) - 1)
# the bytes of one sample's masks packing holds at once: instances x height x width, of its image or of
# the stored image, the larger. Far above what COCO and LVIS need (about 100 x 640 x 480 = 30 MB), it
# bounds what one sample can make the packing process hold (50,000 instances of 256x256: 3.3 GB, and
# as much again moved and coded); a sample over it is skipped with the reason, a COCO file's before
# its masks are drawn.
MAX_MASK_BYTES = 1 << 30


@dataclass
class Geometry:
    """How packing changed an image's frame: its full upright size, the stored size, and the fit
    (raw) that took one to the other; boxes move with it."""

    source_hw: tuple[int, int] | None
    stored_hw: tuple[int, int] | None
    fit: str = "crop"
    mode: str = "raw"

    def _affine(self) -> tuple[float, float, float, float]:
        """(sx, sy, ox, oy): a source pixel (x, y) is at (x * sx + ox, y * sy + oy) in the stored image."""
        (h0, w0), (h, w) = self.source_hw, self.stored_hw  # type: ignore[misc]  # known for a packed image
        if self.mode == "raw" and self.fit == "crop":
            side = min(w0, h0)
            return w / side, w / side, -(w0 - side) / 2 * w / side, -(h0 - side) / 2 * w / side
        if self.mode == "raw" and self.fit == "pad":
            scale = w / max(w0, h0)
            nw, nh = max(1, round(w0 * scale)), max(1, round(h0 * scale))
            return nw / w0, nh / h0, (w - nw) // 2, (h - nh) // 2
        return w / w0, h / h0, 0.0, 0.0

    def move(self, boxes: np.ndarray) -> np.ndarray:
        """xyxy boxes in the source's pixels to the stored image's, clipped. One cropped away is kept,
        empty: a sample's boxes stay in step with its other per-instance values (a loader drops the
        ones under a pixel and says which it kept, `boxes_kept`)."""
        h, w = self.stored_hw  # type: ignore[misc]  # known for a packed image
        sx, sy, ox, oy = self._affine()
        return np.clip(boxes * [sx, sy, sx, sy] + [ox, oy, ox, oy], 0, [w, h, w, h]).astype(np.float32)

    def move_points(self, points: np.ndarray) -> np.ndarray:
        """(k, K, 3) keypoints in the source's pixels to the stored image's, as `move` moves boxes; a
        point the stored image does not hold (cropped away) becomes not visible (0). No instance
        is dropped: they stay in step with the sample's other per-instance values."""
        h, w = self.stored_hw  # type: ignore[misc]  # known for a packed image
        sx, sy, ox, oy = self._affine()
        out = points.astype(np.float64) * [sx, sy, 1.0] + [ox, oy, 0.0]
        outside = (out[..., 0] < 0) | (out[..., 0] > w) | (out[..., 1] < 0) | (out[..., 1] > h)
        out[..., 2] = np.where(outside, 0, out[..., 2])
        return out.astype(np.float32)

    def move_masks(self, planes: np.ndarray) -> np.ndarray:
        """(k, h, w) masks of the source image (its upright size) to the stored image's pixels, each
        stored pixel taking the source pixel under its centre (nearest); 0 where packing padded."""
        h, w = self.stored_hw  # type: ignore[misc]  # known for a packed image
        sx, sy, ox, oy = self._affine()
        if (h, w) == planes.shape[1:] and (sx, sy, ox, oy) == (1.0, 1.0, 0.0, 0.0):
            return planes
        xs = np.floor((np.arange(w) + 0.5 - ox) / sx).astype(np.int64)
        ys = np.floor((np.arange(h) + 0.5 - oy) / sy).astype(np.int64)
        h0, w0 = planes.shape[1:]
        inside = ((ys >= 0) & (ys < h0))[:, None] & ((xs >= 0) & (xs < w0))[None, :]
        out = planes[:, ys.clip(0, h0 - 1)][:, :, xs.clip(0, w0 - 1)]
        return np.where(inside, out, 0).astype(planes.dtype)


def as_masks(value: Any) -> tuple[bool, np.ndarray]:
    """A sample's masks as (instances, (k, h, w) array): a label map (h, w) of integers (semantic,
    k = 1), or instance masks (k, h, w) of 0 and 1 (bool or integers), from an array, a tensor,
    torchvision's Mask or a list of (h, w) masks; `[]`: no instance."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        if not value:
            return True, np.zeros((0, 0, 0), np.uint8)
        value = [v.detach().cpu().numpy() if hasattr(v, "detach") else v for v in value]
    try:
        masks = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"masks that are not one array ({e})") from None
    if masks.dtype.kind not in "biu" or masks.ndim not in (2, 3) or 0 in masks.shape[-2:]:
        raise ValueError(
            f"masks of {masks.dtype} and shape {masks.shape}; expected an integer label map (h, w) or "
            "instance masks (instances, h, w) of 0 and 1"
        )
    if masks.ndim == 3:
        # min and max: no temporary the size of the masks, as np.isin makes
        if masks.size and masks.dtype.kind != "b" and (int(masks.min()) < 0 or int(masks.max()) > 1):
            raise ValueError("instance masks (instances, h, w) with values other than 0 and 1")
        return True, masks.astype(np.uint8, copy=False)
    return False, masks[None]


def check_mask_planes(shape: tuple[int, ...], geometry: Geometry | None) -> None:
    """ValueError for (k, h, w) masks that are not the size of their image (its full upright size), more
    planes than a store holds for one sample (its reader refuses them), or more than MAX_MASK_BYTES at
    once. Cheap: a COCO file's masks are checked by their shape before they are drawn."""
    k, h, w = shape
    if geometry is not None and geometry.source_hw is not None and (h, w) != tuple(geometry.source_hw):
        h0, w0 = geometry.source_hw
        raise ValueError(f"masks of {h}x{w} pixels for an image of {h0}x{w0}")
    if k > fmt.MAX_MASK_PLANES:
        raise ValueError(f"{k} masks, more than a store holds for one sample ({fmt.MAX_MASK_PLANES})")
    stored = geometry.stored_hw if geometry is not None and geometry.stored_hw is not None else (h, w)
    held = k * max(h * w, stored[0] * stored[1])
    if held > MAX_MASK_BYTES:
        raise ValueError(
            f"{k} masks of {w}x{h} pixels, {held / 2**30:.1f} GiB at once: more than packing holds "
            f"for one sample ({MAX_MASK_BYTES >> 30} GiB)"
        )


def _fits(planes: np.ndarray, dtype: str) -> bool:
    """Whether every value of `planes` is one `dtype` holds."""
    info = np.iinfo(np.dtype(dtype))
    return not planes.size or (info.min <= int(planes.min()) and int(planes.max()) <= info.max)


def _mask_dtype(planes: np.ndarray) -> str:
    """The smallest of the format's mask dtypes that holds a label map's values; ValueError if none."""
    for dtype in fmt.MASK_DTYPES:
        if _fits(planes, dtype) and (dtype != "|i1" or planes.dtype.kind == "i"):
            return dtype
    lo, hi = int(planes.min()), int(planes.max())  # (an empty map fits every dtype)
    raise ValueError(f"a label map with values {lo}..{hi}, outside int32")


def as_boxes(value: Any) -> np.ndarray:
    """A sample's boxes as (k, 4) float: xyxy, from a list of lists, an array, a tensor or torchvision's
    BoundingBoxes (in XYXY format)."""
    form = getattr(value, "format", None)
    if form is not None and getattr(form, "name", str(form)).upper() != "XYXY":
        raise ValueError(f"boxes in {getattr(form, 'name', form)} format; give XYXY (x1, y1, x2, y2) pixels")
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    try:
        boxes = np.asarray(value if len(value) else np.zeros((0, 4)), dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"boxes that are not numbers ({e})") from None
    if boxes.ndim != 2 or boxes.shape[1] != 4 or not np.isfinite(boxes).all():
        raise ValueError(f"boxes of shape {boxes.shape}; expected (k, 4) finite x1, y1, x2, y2")
    return boxes


def as_keypoints(value: Any) -> np.ndarray:
    """A sample's keypoints as (k, K, 3) float: per instance K points of x, y, visibility (0 not
    labelled, 1 labelled but hidden, 2 visible). From (k, K, 3), (k, K, 2) (all visible, as
    torchvision's KeyPoints), or COCO's flat (k, 3K) rows [x1, y1, v1, x2, ...]; a list, an array or
    a tensor."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    try:
        points = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"keypoints that are not numbers ({e})") from None
    if points.size == 0 and points.ndim <= 2:  # no instance, in the list or COCO's form: K unknown here
        return np.zeros((0, 0, 3))
    if points.ndim == 2 and points.shape[1] % 3 == 0 and points.shape[1]:  # COCO's rows
        points = points.reshape(len(points), -1, 3)
    if points.ndim == 3 and points.shape[2] == 2:
        points = np.concatenate([points, np.full(points.shape[:2] + (1,), 2.0)], axis=2)
    if points.ndim != 3 or points.shape[2] != 3 or not 0 < points.shape[1] <= fmt.MAX_KEYPOINTS:
        raise ValueError(
            f"keypoints of shape {points.shape}; expected (instances, points, 3) x, y, visibility, "
            f"(instances, points, 2) or COCO's (instances, 3 * points), with 1 to {fmt.MAX_KEYPOINTS} points"
        )
    if not np.isfinite(points).all() or not np.isin(points[..., 2], (0, 1, 2)).all():
        raise ValueError("keypoints with a coordinate that is not finite or a visibility other than 0, 1 or 2")
    return points


def classify(value: Any) -> tuple[str, Any]:
    """(kind, value to store): "number" (int or float, decided over all samples), "array", "str",
    "bytes" or "json"; ValueError for what no kind holds."""
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        value = int(value)
        if not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{value} does not fit in int64")
        return "number", value
    if isinstance(value, (float, np.floating)):
        return "number", float(value)
    if isinstance(value, str):
        return "str", value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        if dtype.str not in fmt.ARRAY_DTYPES:
            raise ValueError(f"an array of {value.dtype} (gpufeed stores bool, int, uint and float arrays)")
        if value.ndim > 8 or 0 in value.shape:
            raise ValueError(f"an array of shape {value.shape} (up to 8 dimensions, none empty)")
        return "array", np.ascontiguousarray(value, dtype=dtype)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"a {type(value).__name__}, which is neither a number, string, bytes, array nor JSON ({e})"
        ) from None
    return "json", value


class FieldsSink:
    """Checks each kept sample's fields against the first one's and writes them as they come (numbers
    are kept until the end, to choose int64 or float64)."""

    def __init__(self, work: Path):
        self.work = work
        self.kinds: dict[str, str] | None = None  # name -> kind, fixed by the first sample added
        self.arrays: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        self.points: dict[str, int] = {}  # keypoints per instance, fixed by the first sample with any
        self.masks: dict[str, tuple[bool, str]] = {}  # (instance masks, dtype), fixed by the first sample
        self.numbers: dict[str, list] = {}
        self.writers: dict[str, Any] = {}
        self.count = 0

    def check(
        self, fields: dict[str, Any] | None, geometry: Geometry | None = None
    ) -> tuple[str | None, dict[str, tuple[str, Any]]]:
        """(the reason this sample cannot be added, or None; its classified values, boxes moved by
        `geometry` into the stored image's frame)."""
        fields = fields or {}
        bad = [n for n in fields if not fmt.valid_field_name(n)]
        if bad:
            return (f"field name {bad[0]!r} is not an identifier, or is one of {fmt.RESERVED}"), {}
        values: dict[str, tuple[str, Any]] = {}
        for name, value in fields.items():
            try:
                if name == fmt.BOXES:
                    boxes = as_boxes(value)
                    values[name] = ("boxes", geometry.move(boxes) if geometry is not None else boxes.astype(np.float32))
                elif name == fmt.KEYPOINTS:
                    points = as_keypoints(value)
                    if not points.shape[1]:  # no instance, points per instance not said: as if missing
                        continue
                    moved = geometry.move_points(points) if geometry is not None else points.astype(np.float32)
                    values[name] = ("keypoints", moved)
                elif name == fmt.MASKS:
                    values[name] = ("masks", self._masks(value, geometry))
                else:
                    values[name] = classify(value)
            except ValueError as e:
                return f"field {name!r} is {e}", {}
        if self.kinds is None:
            return None, values
        missing = [n for n, kind in self.kinds.items() if n not in values and kind not in fmt.VARIABLE_KINDS]
        extra = [n for n, (kind, _) in values.items() if n not in self.kinds and kind not in fmt.VARIABLE_KINDS]
        if missing or extra:
            return (
                "its fields differ from the first sample's (numbers and arrays must be in every sample; text, "
                "bytes and JSON may be missing): "
                + ", ".join([f"no {n!r}" for n in missing] + [f"an extra {n!r}" for n in extra])
            ), {}
        for name, (kind, value) in values.items():
            known = self.kinds.get(name, kind)
            if kind != known:
                return f"field {name!r} is a {kind}, the first sample's is a {known}", {}
            if kind == "masks" and name in self.masks:
                instances, stored = self.masks[name]
                if instances != value[0]:
                    first, this = ("instance masks", "a label map") if instances else ("a label map", "instance masks")
                    return f"field {name!r} is {this}, the first sample's is {first}", {}
                if not instances and not _fits(value[1], stored):
                    return f"field {name!r} has label values that do not fit the first sample's {stored}", {}
            if kind == "keypoints" and self.points.get(name, value.shape[1]) != value.shape[1]:
                return (
                    f"field {name!r} has {value.shape[1]} points per instance, the first sample's {self.points[name]}"
                ), {}
            if kind == "array" and (value.dtype, value.shape) != self.arrays[name]:
                dtype, shape = self.arrays[name]
                return (
                    f"field {name!r} is a {value.dtype} array of shape {value.shape}, the first sample's is "
                    f"{dtype} of shape {shape}"
                ), {}
        return None, values

    def add(self, values: dict[str, tuple[str, Any]]) -> None:
        """Append a checked sample's values (an empty value for a text, bytes or JSON field it lacks)."""
        if self.kinds is None:
            self.kinds = {}
        for name, (kind, value) in values.items():
            if name not in self.kinds:
                self._start(name, kind, value)
        for name, kind in self.kinds.items():
            if name not in values:
                self.writers[name].add(b"")
                continue
            value = values[name][1]
            if kind == "number":
                self.numbers[name].append(value)
            elif kind == "array":
                self.writers[name].write(value)
            elif kind == "masks":
                self.writers[name].add(fmt.encode_masks(value[1]))
            elif kind in ("boxes", "keypoints"):
                self.writers[name].add(np.ascontiguousarray(value, dtype="<f4").tobytes())
            else:
                data = (
                    value.encode("utf-8")
                    if kind == "str"
                    else (json.dumps(value, allow_nan=False).encode("utf-8") if kind == "json" else value)
                )
                self.writers[name].add(data)
        self.count += 1

    @staticmethod
    def _masks(value: Any, geometry: Geometry | None) -> tuple[bool, np.ndarray]:
        """A sample's masks checked against its image's full size and moved into the stored image's frame."""
        if callable(value):  # drawn now, not when the source was read (a COCO file's `CocoMasks`)
            if isinstance(getattr(value, "shape", None), tuple):  # what drawing takes, checked first
                check_mask_planes(value.shape, geometry)
            value = value()
        instances, planes = as_masks(value)
        if not len(planes) and instances:
            if geometry is None or geometry.source_hw is None:
                return instances, planes
            return instances, np.zeros((0, *geometry.stored_hw), np.uint8)  # type: ignore[misc]
        check_mask_planes(planes.shape, geometry)
        if geometry is None or geometry.source_hw is None:
            return instances, planes
        return instances, geometry.move_masks(planes)

    def _start(self, name: str, kind: str, value: Any) -> None:
        """A field's first value: its writer, with an empty value for each sample before (text, bytes
        and JSON only: `check` refuses numbers and arrays that start late)."""
        self.kinds[name] = kind  # type: ignore[index]  # set by `check` before the first add
        files = fmt.field_files(name, {"kind": "str" if kind in fmt.VARIABLE_KINDS else "int"})
        if kind == "number":
            self.numbers[name] = []
        elif kind == "array":
            self.arrays[name] = (value.dtype, value.shape)
            self.writers[name] = HashingWriter(self.work / files[0])
        else:
            if kind == "keypoints":
                self.points[name] = value.shape[1]
            if kind == "masks":
                self.masks[name] = (value[0], "|u1" if value[0] else _mask_dtype(value[1]))
            self.writers[name] = Appended(self.work, *files)
            for _ in range(self.count):
                self.writers[name].add(b"")

    def finish(self) -> tuple[dict[str, dict], dict[str, dict[str, Any]]]:
        """(manifest entries of the data files, the manifest's field specs)."""
        files: dict[str, dict] = {}
        specs: dict[str, dict[str, Any]] = {}
        for name, kind in (self.kinds or {}).items():
            path = self.work / fmt.field_files(name, {"kind": "int"})[0]
            if kind == "number":
                values = self.numbers[name]
                whole = all(isinstance(v, int) for v in values)
                specs[name] = {"kind": "int" if whole else "float"}
                files[path.name] = write_array(path, np.asarray(values, dtype="<i8" if whole else "<f8"))
            elif kind == "array":
                dtype, shape = self.arrays[name]
                specs[name] = {"kind": "array", "dtype": dtype.str, "shape": list(shape)}
                files[path.name] = self.writers[name].close()
            else:
                specs[name] = {"kind": kind}
                if kind == "keypoints":
                    specs[name]["points"] = self.points[name]
                if kind == "masks":
                    specs[name] |= {"instances": self.masks[name][0], "dtype": self.masks[name][1]}
                files |= self.writers[name].finish()
        return files, specs

    def abandon(self) -> None:
        """Close the field files of a pack that failed (its folder is removed: the space is freed once closed)."""
        for writer in self.writers.values():
            writer.abandon()
