"""A COCO annotation file (instances or person_keypoints) with its folder of images, as a source.

Each image of the file's "images" is a sample, read from the `images` folder by its "file_name",
with its annotations as per-sample fields, in one order per image: "boxes" (xyxy pixels, clipped
to the image; an annotation whose box is empty there is left out, as detectron2 leaves it out),
"category" (a JSON list of category ids, as in the file: gaps kept), "iscrowd" (a JSON list of 0
and 1: a Loader leaves the crowd ones out of what it yields unless `keep_crowd`), "keypoints" where
the file has them (K points of x, y, visibility per annotation), and "image_id". Labels are -1
(a detection sample has no one class); `classes` names the categories by id order, and the store
records their ids (`Store.categories`; a category id listed twice is an error). COCO's
keypoints are pixel indices: a labelled one gets 0.5 added, as detectron2 adds it, so that it is
where boxes are (continuous pixels) and mirrors onto its own pixel; an object of a category without
keypoints (a car where persons have them) gets as many points, none labelled (visibility 0). "masks"
where the file has segmentations: one 0/1 mask per kept annotation, from its polygons or run-length
mask (`sources.coco_masks`). An image whose file is not the size its entry declares is skipped with
the reason before anything is drawn (`Item.hw`); an image id listed twice is an error.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.sources.coco_masks import CocoMasks
from gpufeed.sources.entries import Entry, Item, Skip, Source, SourceError

MAX_ANNOTATION_BYTES = 4 << 30  # COCO's instances_train2017.json is 448 MB


def is_coco(path: Path) -> bool:
    """Whether `path` is named like an annotation file (a .json file)."""
    return path.suffix.lower() == ".json"


def _load(path: Path) -> dict:
    if path.stat().st_size > MAX_ANNOTATION_BYTES:
        raise SourceError(f"{path}: over {MAX_ANNOTATION_BYTES >> 30} GiB, more than an annotation file this reads")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e})") from None
    except RecursionError:
        raise SourceError(f"{path}: not JSON (nested too deeply)") from None
    except ValueError as e:
        raise SourceError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise SourceError(f'{path}: not a COCO annotation file (no "images" list)')
    for key in ("annotations", "categories"):
        if not isinstance(data.get(key, []), list):
            raise SourceError(f'{path}: not a COCO annotation file ("{key}" is not a list)')
    return data


def _number(value: Any) -> bool:
    """A finite int or float (not a bool, not an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) < 2**53 if isinstance(value, int) else math.isfinite(value)


def _id(value: Any) -> bool:
    """An id COCO's entries can be matched by: an int or a string."""
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _box(ann: dict, w: float, h: float) -> list[float] | None:
    """An annotation's xywh box as xyxy clipped to the image; None if empty there or malformed."""
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(_number(v) for v in box)):
        return None
    x0, y0 = max(0.0, float(box[0])), max(0.0, float(box[1]))
    x1, y1 = min(w, float(box[0]) + float(box[2])), min(h, float(box[1]) + float(box[3]))
    return [x0, y0, x1, y1] if x1 > x0 and y1 > y0 else None


def coco_source(path: Path, images: str | os.PathLike | None) -> Source:
    """The samples of the annotation file `path`, their images in the folder `images`."""
    if images is None:
        raise SourceError(f"{path}: a COCO annotation file needs its images folder: pack(..., images='train2017/')")
    root = Path(images)
    if not root.is_dir():
        raise SourceError(f"{root}: no such folder (the images of {path})")
    data = _load(path)
    categories = [c for c in data.get("categories", []) if isinstance(c, dict) and _whole(c.get("id"))]
    _check_category_ids(path, categories)
    classes = [str(c.get("name", c["id"])) for c in sorted(categories, key=lambda c: c["id"])]
    by_image: dict[Any, list[dict]] = {}
    for ann in data.get("annotations", []):
        if isinstance(ann, dict) and _id(ann.get("image_id")):
            by_image.setdefault(ann["image_id"], []).append(ann)
    # keypoints per instance: the categories' names of them (COCO's person), else the first annotation's;
    # the categories whose objects have them: those naming them, else those with annotated ones
    named = [c for c in categories if isinstance(c.get("keypoints"), list) and c["keypoints"]]
    annotated = [
        a
        for a in data.get("annotations", [])
        if isinstance(a, dict) and isinstance(a.get("keypoints"), list) and a["keypoints"]
    ]
    points = len(named[0]["keypoints"]) if named else len(annotated[0]["keypoints"]) // 3 if annotated else 0
    keyed = {c["id"] for c in named} if named else {a["category_id"] for a in annotated if _id(a.get("category_id"))}
    masks = any(isinstance(a, dict) and "segmentation" in a for a in data.get("annotations", []))
    _check_ids(path, data["images"])
    entries: list[Entry] = [_entry(image, root, by_image, points, keyed, masks) for image in data["images"]]
    total = sum(isinstance(e, Item) for e in entries)
    description = f"COCO annotations {path} ({len(data['images'])} images listed)"
    names = {c["id"]: name for c, name in zip(sorted(categories, key=lambda c: c["id"]), classes)}
    return Source(description, classes, iter(entries), total, kind="list", categories=names)


def _whole(value: Any) -> bool:
    """A category id: an int (not a bool), as COCO's are."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_category_ids(path: Path, categories: list[dict]) -> None:
    """SourceError naming a category id listed twice: its objects would have two names, and the ids
    would no longer map one to one onto `classes` (`Store.categories`, `loader.category_labels`)."""
    seen: dict[int, str] = {}
    for c in categories:
        name = str(c.get("name", c["id"]))
        if c["id"] in seen:
            raise SourceError(
                f'{path}: category id {c["id"]} is listed twice in "categories" ({seen[c["id"]]}, {name}); '
                "each object's category is found by its id"
            )
        seen[c["id"]] = name


def _check_ids(path: Path, images: list) -> None:
    """SourceError naming an image id listed twice: its annotations would go to both images."""
    seen: dict[Any, str] = {}
    for image in images:
        if isinstance(image, dict) and _id(image.get("id")):
            name = str(image.get("file_name"))
            if image["id"] in seen:
                raise SourceError(
                    f'{path}: image id {image["id"]!r} is listed twice in "images" ({seen[image["id"]]}, {name}); '
                    "each image's annotations are found by its id"
                )
            seen[image["id"]] = name


def _entry(image: Any, root: Path, by_image: dict, points: int, keyed: set, masks: bool) -> Entry:
    """One image's sample, or why it is skipped."""
    if not isinstance(image, dict) or not isinstance(image.get("file_name"), str):
        return Skip(str(image)[:200], 'an "images" entry without a file_name')
    name = image["file_name"]
    if "\0" in name:
        return Skip(repr(name), "a file_name with a NUL character")
    file = root / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return Skip(name, "a file_name outside the images folder")
    if not _id(image.get("id")):
        return Skip(str(file), "an images entry whose id is not a number or string")
    sides: tuple[Any, ...] = (image.get("width"), image.get("height"))
    if not all(_number(v) and v > 0 for v in sides):
        return Skip(str(file), "no width and height in its images entry")
    w, h = (float(v) for v in sides)
    boxes, category, crowd, keypoints, segmentations = [], [], [], [], []
    for ann in by_image.get(image.get("id"), []):
        box = _box(ann, w, h)
        if box is None:
            continue
        if points:
            kp = ann.get("keypoints")
            kind = ann.get("category_id")
            if isinstance(kp, list) and len(kp) == 3 * points and all(_number(v) for v in kp):
                # pixel indices to continuous pixels, for the labelled ones
                keypoints.append(
                    [[x + 0.5, y + 0.5, v] if v else [x, y, v] for x, y, v in zip(kp[::3], kp[1::3], kp[2::3])]
                )
            elif ann.get("keypoints", []) == [] and not (_id(kind) and kind in keyed):  # none, or an empty list
                # an object of a category without keypoints (a car among persons): points, none labelled,
                # as the store holds the same number of points for every instance
                keypoints.append([[0.0, 0.0, 0]] * points)
            else:
                return Skip(str(file), f"an annotation without {points} keypoints (x, y, visibility)")
        boxes.append(box)
        segmentations.append(ann.get("segmentation"))
        category.append(ann.get("category_id"))
        crowd.append(1 if ann.get("iscrowd") else 0)
    fields: dict[str, Any] = {"boxes": boxes, "category": category, "iscrowd": crowd, "image_id": image.get("id")}
    if points:  # an array, so that an image without annotations says its points per instance too
        fields["keypoints"] = np.asarray(keypoints, np.float64).reshape(-1, points, 3)
    if masks:  # drawn when packing takes the sample (`sources.coco_masks`)
        fields["masks"] = CocoMasks(tuple(segmentations), int(h), int(w))
    return Item(str(file), -1, path=str(file), fields=fields, hw=(int(h), int(w)))
