"""A batch as a dict of its image tensor and the per-sample fields a `Loader(fields=...)` asks for."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpufeed.augment.boxes import padded, transform_boxes_kept
from gpufeed.augment.keypoints import check_flip_index, transform_keypoints
from gpufeed.augment.masks import DTYPES, transform_masks
from gpufeed.augment.params import Params
from gpufeed.loader.stats import Stats
from gpufeed.logs import logger
from gpufeed.store.format import MaskRuns, StoreError
from gpufeed.transfer.upload import upload

log = logger(__name__)

CROWD = "iscrowd"  # the field that marks a sample's crowd instances (1), as a COCO file packs it
PER_INSTANCE = {"boxes", "keypoints", "masks"}  # the fields a sample's crowd instances are left out of


@dataclass(frozen=True)
class FieldRequest:
    """The fields a `Loader(fields=...)` yields, of which store, on which device, and what a damaged
    value becomes (`on_error`: "skip", None; "raise", the StoreError)."""

    names: tuple[str, ...]
    store: Any  # a Store (or a folder read in place: label and source only)
    device: torch.device
    on_error: str
    keypoint_flip: np.ndarray | None = None  # the point each keypoint becomes when mirrored (`augment.keypoints`)
    mask_fill: int = 0  # a label map's value where its image takes a fill (`augment.masks`)
    keep_crowd: bool = False  # yield the instances the store's "iscrowd" marks too (else left out: `_crowd`)

    @staticmethod
    def check(
        names: tuple[str, ...] | None, store, keypoint_flip, mask_fill: int, keep_crowd: bool
    ) -> np.ndarray | None:
        """Refuse, naming the store, a `Loader`'s field arguments that don't fit `names` or `store`:
        each name is a field of the store (or "label", "source", "image"), `keypoint_flip` is a
        permutation of its keypoints (returned as an array), `mask_fill` a value its label maps hold,
        `keep_crowd` a bool for instance fields."""
        asked = set(names or ())
        if keypoint_flip is not None and "keypoints" not in asked:
            raise ValueError(f"{store.path}: keypoint_flip is for fields=(..., 'keypoints', ...)")
        if mask_fill != 0 and "masks" not in asked:
            raise ValueError(f"{store.path}: mask_fill is for fields=(..., 'masks', ...)")
        if not isinstance(keep_crowd, bool):
            raise ValueError(f"{store.path}: keep_crowd must be True or False, got {keep_crowd!r}")
        if keep_crowd and not PER_INSTANCE & asked:
            raise ValueError(f"{store.path}: keep_crowd is for fields=(..., 'boxes', 'keypoints' or 'masks', ...)")
        for name in names or ():
            if name not in ("label", "source", "image"):
                try:
                    store.column(name)
                except KeyError as e:
                    raise ValueError(e.args[0]) from None
        if "masks" in asked:
            spec = store.fields["masks"]
            info = torch.iinfo(DTYPES[spec["dtype"]])
            if isinstance(mask_fill, bool) or not isinstance(mask_fill, int) or not info.min <= mask_fill <= info.max:
                raise ValueError(
                    f"{store.path}: mask_fill={mask_fill!r} is not an int a {spec['dtype']} label map holds "
                    f"({info.min}..{info.max})"
                )
        if keypoint_flip is None:
            return None
        return check_flip_index(keypoint_flip, store.fields["keypoints"]["points"], str(store.path))


class FieldBatch(dict):
    """A `Loader(fields=...)` batch: a dict, which also keeps on the host what it knew there before
    the copies to the device ("boxes_count", "image_size" as lists, in `host`), so that `per_image`
    and the user need not wait for the device to read them back (a read-back waits for all queued
    work: in a training loop, the step before)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.host: dict[str, list] = {}


def batch_dict(
    request: FieldRequest,
    images: torch.Tensor,
    labels: torch.Tensor,
    samples,
    counters: Stats,
    geometry: Callable[[], tuple[torch.Tensor, Params | None]],
) -> dict:
    """Keys: "image", then each field of `request`: "label" (or mixed targets), "source" (a list),
    "boxes" (moved with the images; plus "boxes_count", and "boxes_kept": (N, M) the stored index of
    each box yielded, -1 after the count, to pick a sample's other per-instance values), "keypoints"
    (moved with them too, (N, M, K, 3); plus "keypoints_count"; where boxes are asked for as well
    and a sample has as many of each, the instances whose boxes are dropped are dropped from its
    keypoints), "masks" (moved with them too, nearest: instance masks (N, M, H, W) uint8 with
    "masks_count", dropped with their boxes as keypoints are, or label maps (N, H, W)), the store's
    other fields (numbers and arrays as tensors on the device, text, bytes
    and JSON as lists), and "image_size" (N, 2) where the batch is padded to one shape (each image's
    (h, w) at the top left). A store's crowd instances (those its JSON field "iscrowd" marks 1, as a
    COCO file packs) are left out of the boxes, keypoints and masks, as torchvision's reference scripts
    and detectron2 leave them out of training targets, unless `request.keep_crowd`; "boxes_kept" then
    skips their indices. `geometry()`: the batch's planned sample indices and augment parameters,
    which the boxes and keypoints follow."""
    idx = samples.cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples)
    out = FieldBatch(image=images)
    store = request.store
    planned = geometry()
    by_aspect = planned[1] is not None and planned[1].content is not None  # batches padded to one shape
    params = _params(store, idx, *planned) if by_aspect or PER_INSTANCE & set(request.names) else None
    if params is not None and params.content is not None:
        out["image_size"] = upload(params.content, request.device, torch.int64)
        out.host["image_size"] = params.content.tolist()
    crowd = _crowd(request, idx, counters)
    # per sample, which of its stored instances are yielded (None: all): not crowd, boxes not under a pixel
    kept: Sequence[np.ndarray | None] | None = _not_crowd(store, idx, crowd) if crowd is not None else None
    if "boxes" in request.names:
        boxes = store.column("boxes").rows(idx)
        yielded: list[np.ndarray] | None = None
        if kept is not None:
            yielded = [_each(store, i, m, len(b)) for b, m, i in zip(boxes, kept, idx, strict=True)]
            boxes = [b[m] for b, m in zip(boxes, yielded, strict=True)]
        if params is not None:
            boxes, moved = transform_boxes_kept(boxes, params)
            yielded = moved if yielded is None else [_within(m, k) for m, k in zip(yielded, moved, strict=True)]
        kept = yielded
        out["boxes"], out["boxes_count"] = padded(boxes, request.device)
        out.host["boxes_count"] = [len(b) for b in boxes]
        which = yielded if yielded is not None else [np.ones(len(b), bool) for b in boxes]
        which = [np.flatnonzero(m) for m in which]
        out["boxes_kept"] = padded(which, request.device, (), fill=-1, dtype=np.int64)[0]
    for name in request.names:
        if name == "label":
            out[name] = labels
        elif name == "source":
            out[name] = [store.source(int(i)) for i in idx]
        elif name == "keypoints":
            column = store.column("keypoints")
            points = column.rows(idx)
            if params is not None:
                points = transform_keypoints(points, params, request.keypoint_flip)
            if kept is not None:
                points = [p[m] if m is not None and len(p) == len(m) else p for p, m in zip(points, kept, strict=True)]
            rest = (store.fields["keypoints"]["points"], 3)
            out["keypoints"], out["keypoints_count"] = padded(points, request.device, rest)
        elif name == "masks":
            out["masks"], counts = _masks(request, idx, params, kept)
            if store.fields["masks"]["instances"]:
                out["masks_count"] = counts
        elif name == "iscrowd" and crowd is not None:
            out[name] = crowd
        elif name not in ("image", "boxes"):
            column = store.column(name)
            out[name] = (
                upload(torch.from_numpy(np.ascontiguousarray(column.rows(idx))), request.device)
                if column.fixed
                else _values(request, column, idx, counters)
            )
    return out


def per_image(batch: dict, labels: str | None = None, label_map: Mapping[int, int] | None = None) -> list[dict]:
    """A batch with "boxes" (a `Loader(fields=("boxes", ...))` batch) as torchvision's detection
    models take their targets: per image a dict of its "boxes" (those the augment kept; a loader has
    left crowd instances out, see `Loader(keep_crowd=...)`), "labels" (the per-instance list field
    `labels`, e.g. COCO's "category", each kept box's entry picked with "boxes_kept"; without it,
    ones), and its "masks" and "keypoints" where the batch has them. An image without instances has
    boxes (0, 4), labels (0,), masks (0, H, W) and keypoints (0, K, 3). `label_map` turns the
    entries into the labels the model takes: COCO's category ids, gaps and all, into 1..C with
    `category_labels(store)` (ValueError naming an entry it lacks); without it they are as stored.
    Views of the batch's tensors, not copies; the labels go to the device in one copy, and the counts
    are the host's (a batch not from a Loader: read back in one sync)."""
    boxes = batch["boxes"]
    host = getattr(batch, "host", {})
    counts = host["boxes_count"] if "boxes_count" in host else batch["boxes_count"].tolist()
    if label_map is not None and labels is None:
        raise ValueError('per_image: label_map maps the entries of a labels field (e.g. "category"); name it')
    if labels is None:
        table = torch.ones(boxes.shape[:2], dtype=torch.int64, device=boxes.device)
    else:
        values = batch[labels]
        wide = np.zeros((len(values), max([len(v) for v in values], default=0) + 1), np.int64)
        for k, v in enumerate(values):
            wide[k, : len(v)] = v if label_map is None else _mapped(label_map, v, labels)
        table = upload(torch.from_numpy(wide), boxes.device)
        table = table.gather(1, batch["boxes_kept"].clamp(min=0).to(boxes.device))
    out = []
    for k, c in enumerate(counts):
        target = {"boxes": boxes[k, :c], "labels": table[k, :c]}
        for name in ("masks", "keypoints"):
            if name in batch:
                target[name] = batch[name][k, :c]
        out.append(target)
    return out


def category_labels(store, start: int = 1) -> dict[int, int]:
    """{category id: label} for a store packed from a COCO annotation file: its categories
    (`store.categories`) in id order onto start, start + 1, ... with no gaps, for `per_image(...,
    label_map=)`. `start=1` (the default) leaves 0 to the background, as torchvision's detection models
    take it (num_classes = C + 1; label k is `store.classes[k - 1]`); `start=0` gives detectron2's and
    mmdetection's 0..C-1. COCO's ids themselves (1..90, with gaps) are what a store holds and what
    per_image gives without a map, as torchvision's reference scripts train on them (num_classes=91).

    Raises:
        ValueError: the store records no categories (packed from something else, or by a gpufeed that
            did not record them: pack it again, or give per_image a label_map of your own).
    """
    categories = getattr(store, "categories", {})
    if not categories:
        raise ValueError(
            f"{store.path}: the store records no categories (a store packed from a COCO annotation file "
            "records them): pack it again, or give per_image a label_map of your own"
        )
    return {c: start + k for k, c in enumerate(sorted(categories))}


def _mapped(label_map: Mapping[int, int], values: list, field: str) -> list[int]:
    """`values` through `label_map`; ValueError naming the first one it lacks."""
    out = []
    for v in values:
        try:
            out.append(label_map[v])
        except (KeyError, TypeError):  # (TypeError: an entry that is not a number, unhashable)
            shown = ", ".join(map(str, sorted(label_map)[:10])) + (", ..." if len(label_map) > 10 else "")
            raise ValueError(f"per_image: {field!r} entry {v!r} is not in label_map (which maps {shown})") from None
    return out


def _masks(
    request: FieldRequest, samples: np.ndarray, params: Params | None, kept: Sequence[np.ndarray | None] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's masks through its geometry (`augment.masks`); instance masks whose boxes a loader
    dropped are dropped too, as keypoints are. A sample stored without masks has no instance (or,
    for label maps, the fill everywhere). A damaged value raises StoreError naming it."""
    store, spec = request.store, request.store.fields["masks"]
    column = store.column("masks")
    runs = []
    for k, i in enumerate(samples.tolist()):
        r = column.runs(i)
        if r is None:
            h, w = store.shapes[i] if store.mode == "jpeg" else store.image_shape[:2]
            fill, none = request.mask_fill, np.zeros(0, np.int32)
            r = (
                MaskRuns(int(h), int(w), none, none, none)
                if spec["instances"]
                else MaskRuns(int(h), int(w), np.array([1]), np.array([h * w], np.int32), np.array([fill], np.int32))
            )
        m = kept[k] if kept is not None else None
        if m is not None and spec["instances"] and len(r) == len(m):
            r = r.planes(m)
        runs.append(r)
    return transform_masks(runs, params, request.device, spec["instances"], DTYPES[spec["dtype"]], request.mask_fill)


def _crowd(request: FieldRequest, samples: np.ndarray, counters: Stats) -> list | None:
    """The batch's values of the store's "iscrowd" field (a JSON list per sample, as a COCO file
    packs), where the loader leaves the crowd instances out: boxes, keypoints or masks asked for, and
    not `keep_crowd`. None otherwise (a store without such a field among them)."""
    fields = getattr(request.store, "fields", {})
    spec = fields.get(CROWD) if isinstance(fields, dict) else None
    if request.keep_crowd or spec is None or spec["kind"] != "json" or not PER_INSTANCE & set(request.names):
        return None
    return _values(request, request.store.column(CROWD), samples, counters)


def _not_crowd(store, samples: np.ndarray, values: list) -> list[np.ndarray | None]:
    """Per sample, which of its instances its "iscrowd" value does not mark (bool), or None where it
    has no value (a sample packed without one, or a damaged one yielded as None): all kept. A value
    that is not a list of numbers raises StoreError naming the sample."""
    out: list[np.ndarray | None] = []
    for i, v in zip(samples.tolist(), values, strict=True):
        if v is None:
            out.append(None)
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            out.append(np.asarray(v, np.float64).reshape(-1) == 0)
        else:
            raise StoreError(
                f"{store.path}: sample {i}'s field {CROWD!r} is {str(v)[:80]}, not a list of 0 and 1 per instance "
                "(a Loader leaves out the instances it marks; keep_crowd=True reads the store without it)"
            )
    return out


def _each(store, i: int, kept: np.ndarray | None, count: int) -> np.ndarray:
    """Sample i's `kept` (None: all of its `count` instances), checked to say one per box; StoreError
    naming the sample otherwise."""
    if kept is None:
        return np.ones(count, bool)
    if len(kept) != count:
        raise StoreError(
            f"{store.path}: sample {i}'s field {CROWD!r} has {len(kept)} entries for its {count} boxes (one per "
            "instance: a Loader leaves out the instances it marks; keep_crowd=True reads the store without it)"
        )
    return kept


def _within(kept: np.ndarray, then: np.ndarray) -> np.ndarray:
    """`then` (which of the instances `kept` keeps are kept next) as a mask of all the instances."""
    out = kept.copy()
    out[kept] = then
    return out


def _values(request: FieldRequest, column, samples: np.ndarray, counters: Stats) -> list:
    """A text, bytes or JSON field's values of a batch. A damaged value (a StoreError naming its file,
    field and sample) raises with `on_error="raise"`; with "skip" it is None, and the first of each
    field is warned about and kept in `loader.stats()["notes"]`."""
    out = []
    for i in samples:
        try:
            out.append(column.value(int(i)))
        except StoreError as e:
            if request.on_error == "raise":
                raise
            out.append(None)
            said = f"field {column.name!r}: damaged values yielded as None"
            if not any(n.startswith(said) for n in counters.as_dict()["notes"]):
                log.warning("%s; yielded as None (further ones are not warned about)", e)
                counters.note(f"{said}, the first: {e}")
    return out


def _params(store, samples: np.ndarray, plan_indices: torch.Tensor, params: Params | None) -> Params | None:
    """The geometry each image of the loader's current batch went through (None: no augment ops). A
    sample that replaced an undecodable one took that position's image (a copy of another position,
    or the same crop moved onto it), so it takes that geometry too."""
    if params is None:
        return None
    planned = plan_indices.numpy()
    first = {int(s): q for q, s in reversed(list(enumerate(planned)))}
    rows = torch.tensor([p if s == planned[p] else first.get(int(s), p) for p, s in enumerate(samples)])
    params = params.take(rows)
    moved = [p for p, s in enumerate(samples) if s != planned[p] and int(s) not in first]
    if moved:  # a batch none of whose samples decoded: the same crops, scaled to the new images
        shapes = torch.from_numpy(np.asarray(store.shapes))
        scale = (shapes[samples[moved]] / shapes[planned[moved]]).flip(1).repeat(1, 2)
        params.boxes[moved] = (params.boxes[moved] * scale).to(params.boxes.dtype)
    return params
