"""A Python dataset as a packing source: any object with `len()` and `[i]`.

Each sample may be `(image, label)` (torchvision datasets), a dict with an image under "image",
"img", "jpg", "png" or "webp" and a label under "label", "labels", "cls" or "target" (Hugging Face
`datasets.Dataset` rows, WebDataset-style dicts; its other keys become the store's fields), or an
image alone (label -1). An image may be a
PIL image, a uint8 tensor or array (CHW or HWC, 1, 3 or 4 channels), encoded bytes (also a
Hugging Face `{"bytes": ..., "path": ...}` image that was not decoded), or a file's path.

The samples are fetched in the packing process, in order; a PIL image or array is handed to the
workers as uncompressed PPM bytes (cheap to write and to read), encoded bytes as they are, so the
fitting, resizing and JPEG encoding run on every core as for files. A sample that can't be
fetched or isn't an image is skipped with its reason, like a bad file.
"""

from __future__ import annotations

import io
import numbers
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image

from gpufeed.packing.imaging import DEFAULT_MAX_PIXELS, to_rgb
from gpufeed.sources import Entry, Item, Skip, Source, SourceError

IMAGE_KEYS = ("image", "img", "jpg", "jpeg", "png", "webp")
LABEL_KEYS = ("label", "labels", "cls", "target")


def is_dataset(source: object) -> bool:
    """True for an indexable object with a length that is not a path."""
    return hasattr(source, "__getitem__") and hasattr(source, "__len__") and not isinstance(source, (str, bytes))


def dataset_source(dataset: Any, max_pixels: int = DEFAULT_MAX_PIXELS) -> Source:
    """The samples of `dataset` as packing entries, named `Type[i]` in reports and `store.source(i)`."""
    try:
        total = len(dataset)
    except TypeError as e:
        raise SourceError(f"{type(dataset).__name__}: has no length ({e})") from None
    return Source(
        f"dataset {type(dataset).__name__} ({total} samples)",
        _classes(dataset),
        _entries(dataset, total, max_pixels),
        total,
        kind="dataset",
    )


def _classes(dataset: Any) -> list[str]:
    """The class names a dataset gives: torchvision's `classes` (a list or tuple of them; anything
    else there, such as a count of classes, names none: it failed the pack with a TypeError), or a
    Hugging Face ClassLabel feature's names."""
    classes = getattr(dataset, "classes", None)  # torchvision
    if not isinstance(classes, (list, tuple)):
        classes = None
    if classes is None:  # Hugging Face: a ClassLabel feature
        features = getattr(dataset, "features", None) or {}
        for key in LABEL_KEYS:
            names = getattr(features.get(key) if hasattr(features, "get") else None, "names", None)
            if names:
                classes = names
                break
    return [str(c) for c in classes] if classes else []


def _entries(dataset: Any, total: int, max_pixels: int) -> Iterator[Entry]:
    name = type(dataset).__name__
    for i in range(total):
        where = f"{name}[{i}]"
        try:
            sample = dataset[i]
        except Exception as e:  # noqa: BLE001  the dataset's own error: a missing file, a corrupt image, ...
            yield Skip(where, f"the dataset raised {type(e).__name__}: {e}")
            continue
        try:
            image, label, fields = _split(sample)
            if isinstance(image, (str, os.PathLike)):  # a path: read by a worker like a listed file
                yield Item(os.fspath(image), label, path=os.fspath(image), fields=fields)
            else:
                yield Item(where, label, data=_as_bytes(image, max_pixels), fields=fields)
        except ValueError as e:
            yield Skip(where, str(e))


def _split(sample: Any) -> tuple[Any, int, dict | None]:
    """(image, label, the other keys of a dict sample as fields)."""
    fields = None
    if isinstance(sample, dict):
        image_key = next((k for k in IMAGE_KEYS if k in sample), None)
        if image_key is None:
            raise ValueError(f"no image among the sample's keys {sorted(sample)} (expected one of {IMAGE_KEYS})")
        label_key = next((k for k in LABEL_KEYS if k in sample), None)
        image, label = sample[image_key], sample[label_key] if label_key else -1
        fields = {k: v for k, v in sample.items() if k not in (image_key, label_key)} or None
    elif isinstance(sample, (tuple, list)):
        if not sample:
            raise ValueError("an empty sample")
        image, label = sample[0], (sample[1] if len(sample) > 1 else -1)
    else:
        image, label = sample, -1
    if hasattr(label, "item") and getattr(label, "ndim", 0) == 0:
        label = label.item()
    if label is None:
        label = -1
    if isinstance(label, bytes):  # WebDataset's cls
        label = label.decode().strip()
    if isinstance(label, str) and label.lstrip("-").isdigit():
        label = int(label)
    if not isinstance(label, numbers.Integral) or isinstance(label, bool) or label < -1:
        raise ValueError(f"label {label!r} is not a class index (an int, -1 for none)")
    return image, int(label), fields


def _as_bytes(image: Any, max_pixels: int) -> bytes:
    """Encoded bytes as they are; anything else as PPM (RGB) the workers read like a file."""
    if isinstance(image, dict) and image.get("bytes"):  # a Hugging Face Image not decoded
        image = image["bytes"]
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Image.Image):
        w, h = image.size
        if w * h > max_pixels:
            raise ValueError(f"{w}x{h} image exceeds max_pixels={max_pixels}")
        image = to_rgb(image)
    else:
        image = to_rgb(Image.fromarray(_hwc(image)))
    out = io.BytesIO()
    image.save(out, format="PPM")
    return out.getvalue()


def _hwc(image: Any) -> np.ndarray:
    """A uint8 HWC array (3 or 4 channels) of a tensor or array, CHW or HWC, gray, RGB or RGBA."""
    if hasattr(image, "detach"):  # a torch tensor, without importing torch here
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise ValueError(f"a sample's image is a {type(image).__name__}, not a PIL image, array, tensor, bytes or path")
    if image.dtype != np.uint8:
        raise ValueError(f"an image array of {image.dtype}; gpufeed packs uint8 pixels (0-255)")
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[2] not in (1, 3, 4):
        image = image.transpose(1, 2, 0)  # CHW
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise ValueError(f"an image array of shape {image.shape}; expected HW, CHW or HWC with 1, 3 or 4 channels")
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    return np.ascontiguousarray(image)
