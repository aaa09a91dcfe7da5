"""COCO targets as torchvision's detection references give them: crowd objects left out of the training
targets (references/detection/coco_utils.py, `ConvertCocoPolysToMask`) unless asked for, as the v2
dataset wrapper gives them then; category ids as in the file, or onto 1..C with the mapping the store
records; empty targets of the right shapes; the keypoint convention docs/detection.md states; and
`gpufeed inspect` counting instances per category. On a small COCO file generated here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from conftest import save, smooth
from gpufeed.augment import RandomHorizontalFlip, RandomResizedCrop
from gpufeed.loader import category_labels, per_image
from gpufeed.sources import SourceError
from gpufeed.store.format import StoreError
from gpufeed.store.summary import describe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pycocotools and numpy 2
DETECTION = Path(__file__).resolve().parent.parent / "docs" / "detection.md"
SIZES = {1: (40, 60), 2: (50, 50), 3: (30, 80), 4: (40, 40)}  # image id: (height, width)


def rect(x: float, y: float, w: float, h: float) -> list[list[float]]:
    """A rectangle as COCO's polygon: drawn alike by pycocotools and by pixel centres."""
    return [[x, y, x + w, y, x + w, y + h, x, y + h]]


def run_lengths(h: int, w: int, y0: int, y1: int, x0: int, x1: int) -> dict:
    """COCO's uncompressed run-length mask (column-major runs, zeros first) of the box [x0, x1) x [y0, y1)."""
    m = np.zeros((h, w), np.uint8)
    m[y0:y1, x0:x1] = 1
    flat = m.flatten(order="F")
    counts = np.diff(np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])).tolist()
    return {"size": [h, w], "counts": [0] * int(flat[0]) + counts}


def coco_file(root: Path) -> tuple[Path, Path]:
    """Categories with gaps (1, 3, 7, listed out of order); image 1 with a crowd car among a person and
    a truck, image 2 without annotations, image 3 with only a crowd of persons, image 4 with a car and a
    person. Every annotation has 2 keypoints (a car's none labelled, a crowd's all zero, as COCO's)."""
    for i, (h, w) in SIZES.items():
        save(root / "images" / f"{i:04d}.jpg", smooth(i, h, w), quality=95)
    images = [{"id": i, "file_name": f"{i:04d}.jpg", "height": h, "width": w} for i, (h, w) in SIZES.items()]

    def ann(k, image, category, box, crowd=0, points=(0,) * 6):
        seg = run_lengths(*SIZES[image], box[1], box[1] + box[3], box[0], box[0] + box[2]) if crowd else rect(*box)
        return {"id": k, "image_id": image, "category_id": category, "bbox": box, "iscrowd": crowd,
                "segmentation": seg, "keypoints": list(points), "area": box[2] * box[3]}

    anns = [
        ann(1, 1, 1, [10, 5, 20, 20], points=(12, 8, 2, 20, 9, 1)),
        ann(2, 1, 3, [30, 20, 30, 20], crowd=1),
        ann(3, 1, 7, [2, 26, 20, 12]),
        ann(4, 3, 1, [0, 0, 40, 30], crowd=1),
        ann(5, 4, 3, [4, 4, 30, 20]),
        ann(6, 4, 1, [20, 10, 16, 24], points=(25, 12, 2, 0, 0, 0)),
    ]
    categories = [{"id": 7, "name": "truck"}, {"id": 1, "name": "person", "keypoints": ["left", "right"]},
                  {"id": 3, "name": "car"}]
    path = root / "ann.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": categories}))
    return path, root / "images"


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """(annotation file, images folder, the store packed from them at native size)."""
    root = tmp_path_factory.mktemp("coco")
    path, images = coco_file(root)
    gpufeed.pack(path, root / "s", images=images, mode="jpeg", reencode=False, progress=False, workers=1)
    return path, images, gpufeed.open(root / "s")


def reference(path: Path, images: Path, crowd: bool = False) -> dict[int, dict]:
    """torchvision's targets per image id: `CocoDetection` read as references/detection/coco_utils.py's
    `ConvertCocoPolysToMask` reads it (crowd annotations left out, boxes xywh to xyxy clamped to the
    image and empty ones dropped, labels the category ids, masks by pycocotools, keypoints as in the
    file); `crowd=True` keeps the crowd ones."""
    coco_mask = pytest.importorskip("pycocotools.mask")  # the test extra's; optional elsewhere
    from torchvision.datasets import CocoDetection

    out = {}
    dataset = CocoDetection(str(images), str(path))
    for idx in range(len(dataset)):
        image, anno = dataset[idx]
        w, h = image.size
        anno = [obj for obj in anno if crowd or obj["iscrowd"] == 0]
        boxes = torch.as_tensor([obj["bbox"] for obj in anno], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(min=0, max=w)
        boxes[:, 1::2].clamp_(min=0, max=h)
        masks = torch.zeros((0, h, w), dtype=torch.uint8)
        if anno:
            rles = [coco_mask.frPyObjects(obj["segmentation"], h, w) for obj in anno]
            masks = torch.stack([torch.as_tensor(coco_mask.decode(r)).reshape(h, w, -1).any(2) for r in rles]).byte()
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        labels = torch.tensor([obj["category_id"] for obj in anno], dtype=torch.int64)
        out[dataset.ids[idx]] = {"boxes": boxes[keep], "labels": labels[keep], "masks": masks[keep]}
        if anno:  # (none without annotations)
            keypoints = torch.as_tensor([obj["keypoints"] for obj in anno], dtype=torch.float32)
            out[dataset.ids[idx]]["keypoints"] = keypoints.view(len(anno), -1, 3)[keep]
    return out


def targets_by_image(store, label_map=None, **kw) -> dict[int, dict]:
    """per_image's targets of every image at its own size (batches of one aspect group, padded), by
    image id, each mask cut to its image."""
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", group_by_aspect=True, shuffle=False,
                            drop_last=False, fields=("boxes", "masks", "keypoints", "category", "image_id"), **kw)
    out = {}
    for batch in loader:
        for t, i, (h, w) in zip(per_image(batch, "category", label_map), batch["image_id"].tolist(),
                                batch.host["image_size"], strict=True):
            assert not t["masks"][:, h:].any() and not t["masks"][:, :, w:].any()  # the batch's padding
            out[i] = {**t, "masks": t["masks"][:, :h, :w]}
    return out


def cocos_own(keypoints: torch.Tensor) -> torch.Tensor:
    """docs/detection.md's line that gives COCO's own keypoints back, run on `keypoints` (a copy)."""
    line = re.search(r"`(kp\[[^`]*-= 0\.5[^`]*)`", DETECTION.read_text())
    assert line, "docs/detection.md's COCO section no longer says how to get COCO's keypoints back"
    namespace = {"kp": keypoints.clone()}
    exec(line.group(1), namespace)
    return namespace["kp"]


def test_crowd_objects_are_left_out_of_the_targets_as_torchvisions_references_leave_them(coco):
    """Image 1 loses its crowd car, image 3 (only a crowd) and image 2 (nothing) have empty targets
    of the right shapes; the rest are torchvision's, keypoints too once docs/detection.md's line takes
    gpufeed's pixel centres (+0.5) back to COCO's pixel indices."""
    path, images, store = coco
    want, got = reference(path, images), targets_by_image(store)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for i, t in got.items():
        r = want[i]
        assert torch.equal(t["labels"], r["labels"]), i
        assert torch.allclose(t["boxes"], r["boxes"]), i
        assert torch.equal(t["masks"], r["masks"]), i
        assert "keypoints" not in r or torch.equal(cocos_own(t["keypoints"]), r["keypoints"]), i
    assert got[1]["labels"].tolist() == [1, 7] and len(got[4]["labels"]) == 2
    for i in (2, 3):
        h, w = SIZES[i]
        t = got[i]
        assert t["boxes"].shape == (0, 4) and t["labels"].shape == (0,) and t["labels"].dtype == torch.int64
        assert t["masks"].shape == (0, h, w) and t["keypoints"].shape == (0, 2, 3)
    labelled = got[1]["keypoints"][0]  # person 1's: (12, 8) and (20, 9) in the file, pixel centres here
    assert labelled.tolist() == [[12.5, 8.5, 2], [20.5, 9.5, 1]]


def test_keep_crowd_yields_them_as_torchvisions_v2_dataset_wrapper_gives_them(coco):
    """`keep_crowd=True`: every object, crowd ones too, as `wrap_dataset_for_transforms_v2(CocoDetection)`
    gives them (its "iscrowd" marks them, as the field does here)."""
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2

    path, images, store = coco
    wrapped = wrap_dataset_for_transforms_v2(CocoDetection(str(images), str(path)),
                                             target_keys={"image_id", "boxes", "labels", "masks", "iscrowd"})
    got = targets_by_image(store, keep_crowd=True)
    for _, r in wrapped:
        t = got[r["image_id"]]
        if "boxes" not in r:  # the wrapper's image without annotations: its id alone
            assert t["boxes"].shape == (0, 4)
            continue
        assert torch.equal(t["labels"], r["labels"]) and torch.allclose(t["boxes"], r["boxes"].as_subclass(torch.Tensor).float())
        assert torch.equal(t["masks"], r["masks"].as_subclass(torch.Tensor).byte())
    assert got[1]["labels"].tolist() == [1, 3, 7] and got[3]["labels"].tolist() == [1]
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", group_by_aspect=True, shuffle=False, drop_last=False,
                            fields=("boxes", "iscrowd", "image_id"), keep_crowd=True)
    marks = {i: c for b in loader for i, c in zip(b["image_id"].tolist(), b["iscrowd"], strict=True)}
    assert marks == {1: [0, 1, 0], 2: [], 3: [1], 4: [0, 0]}
    with pytest.raises(ValueError, match="keep_crowd is for fields"):
        gpufeed.Loader(store, batch_size=4, device="cpu", group_by_aspect=True, fields=("category",), keep_crowd=True)


def test_crowd_objects_are_left_out_through_crops_and_flips_in_step(coco):
    """With crops and flips the loader drops boxes under a pixel as well: what it yields is what a
    `keep_crowd=True` loader with the same seed yields, less the crowd objects, in step with their
    keypoints and masks and picked by "boxes_kept"; masks asked for without boxes lose them too."""
    _, _, store = coco
    ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip()]
    fields = ("boxes", "masks", "keypoints", "category", "iscrowd", "image_id")
    for seed in range(4):
        kw = dict(batch_size=4, device="cpu", augment=ops, seed=seed, shuffle=False, drop_last=False, fields=fields)
        left, kept = (next(iter(gpufeed.Loader(store, keep_crowd=k, **kw))) for k in (False, True))
        for k in range(4):
            every = kept["boxes_kept"][k, : int(kept["boxes_count"][k])].tolist()
            crowd = kept["iscrowd"][k]
            rows = [j for j, s in enumerate(every) if not crowd[s]]
            c = int(left["boxes_count"][k])
            assert left["boxes_kept"][k, :c].tolist() == [every[j] for j in rows]
            assert torch.equal(left["boxes"][k, :c], kept["boxes"][k, rows])
            assert torch.equal(left["masks"][k, :c], kept["masks"][k, rows])
            assert torch.equal(left["keypoints"][k, :c], kept["keypoints"][k, rows])
            assert int(left["masks_count"][k]) == int(left["keypoints_count"][k]) == c
    masks_only = next(iter(gpufeed.Loader(store, batch_size=4, device="cpu", augment=[RandomResizedCrop(24)],
                                          shuffle=False, drop_last=False, fields=("masks", "image_id"))))
    counts = dict(zip(masks_only["image_id"].tolist(), masks_only["masks_count"].tolist(), strict=True))
    assert counts == {1: 2, 2: 0, 3: 0, 4: 2}


def test_category_ids_keep_their_gaps_or_map_onto_contiguous_labels(coco):
    """The store records the file's categories; `category_labels` maps their ids onto 1..C (0 left to
    the background), as torchvision's `FilterAndRemapCocoCategories` remaps them (the index in [0, *ids]);
    without a map the labels are the ids, as torchvision's references train on them."""
    path, images, store = coco
    assert store.categories == {1: "person", 3: "car", 7: "truck"}
    assert store.classes == ["person", "car", "truck"]
    labels = category_labels(store)
    assert labels == {1: 1, 3: 2, 7: 3} and category_labels(store, start=0) == {1: 0, 3: 1, 7: 2}
    order = [0, *sorted(c["id"] for c in json.loads(path.read_text())["categories"])]  # 0: the background
    want = reference(path, images)
    got = targets_by_image(store, label_map=labels)
    for i, t in got.items():
        assert t["labels"].tolist() == [order.index(c) for c in want[i]["labels"].tolist()]
        assert [store.classes[k - 1] for k in t["labels"].tolist()] == [store.categories[c] for c in
                                                                       want[i]["labels"].tolist()]
    assert got[1]["labels"].tolist() == [1, 3]
    assert targets_by_image(store)[1]["labels"].tolist() == [1, 7]  # the default: ids as in the file
    batch = next(iter(gpufeed.Loader(store, batch_size=4, device="cpu", group_by_aspect=True, shuffle=False,
                                     drop_last=False, fields=("boxes", "category"))))
    with pytest.raises(ValueError, match="entry 7 is not in label_map"):
        per_image(batch, "category", {1: 1, 3: 2})
    with pytest.raises(ValueError, match="label_map maps the entries of a labels field"):
        per_image(batch, label_map=labels)


def test_a_store_not_packed_from_coco_has_no_categories_to_map(tmp_path):
    gpufeed.pack([{"image": smooth(0, 16, 16), "label": 0, "boxes": [[1, 1, 5, 5]], "category": [4]}],
                 tmp_path / "s", mode="raw", size=16, progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    assert store.categories == {}
    with pytest.raises(ValueError, match="records no categories"):
        category_labels(store)


def test_a_category_id_listed_twice_is_refused_by_name(tmp_path):
    path, images = coco_file(tmp_path)
    data = json.loads(path.read_text())
    data["categories"].append({"id": 3, "name": "bus"})
    path.write_text(json.dumps(data))
    with pytest.raises(SourceError, match=r"ann.json: category id 3 is listed twice .*car, bus"):
        gpufeed.pack(path, tmp_path / "s", images=images, progress=False, workers=1)


def test_an_iscrowd_field_out_of_step_with_the_boxes_is_named(tmp_path):
    """A dataset's own "iscrowd" lists mark instances too; one with another count than its boxes is an
    error naming the sample, unless the loader keeps crowd objects."""
    data = [{"image": smooth(k, 16, 16), "label": 0, "boxes": [[1, 1, 9, 9], [2, 2, 12, 12]],
             "iscrowd": [0, 1] if k else [0]} for k in range(2)]
    gpufeed.pack(data, tmp_path / "s", mode="raw", size=16, progress=False, workers=1)
    kw = dict(batch_size=2, device="cpu", shuffle=False, fields=("boxes",))
    with pytest.raises(StoreError, match=r"sample 0's field 'iscrowd' has 1 entries for its 2 boxes"):
        next(iter(gpufeed.Loader(tmp_path / "s", **kw)))
    assert next(iter(gpufeed.Loader(tmp_path / "s", keep_crowd=True, **kw)))["boxes_count"].tolist() == [2, 2]


def test_inspect_counts_instances_per_category(coco, capsys):
    from gpufeed.cli import main

    _, _, store = coco
    assert main(["inspect", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert "person (0)" not in out and "none per image (label -1)" in out
    lines = out[out.index("instances per category"):].splitlines()
    assert lines[1:4] == ["  person: 3 instances (id 1, 1 crowd)", "  car: 2 instances (id 3, 1 crowd)",
                          "  truck: 1 instance (id 7)"]
    assert "keep_crowd=True" in lines[0]


def test_a_sharded_store_keeps_its_categories_and_a_malformed_record_is_named(coco, tmp_path):
    path, images, _ = coco
    gpufeed.pack(path, tmp_path / "s", images=images, mode="jpeg", shard_size="4KB", progress=False, workers=1)
    sharded = gpufeed.open(tmp_path / "s")
    assert sharded.manifest.shards and sharded.categories == {1: "person", 3: "car", 7: "truck"}
    assert "  person: 3 instances (id 1, 1 crowd)" in describe(sharded).splitlines()
    manifest = tmp_path / "s" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["settings"]["categories"] = [[1, "person"], [1, "car"]]
    manifest.write_text(json.dumps(raw))
    with pytest.raises(StoreError, match=r"s/manifest.json: manifest field settings.categories is not a list"):
        gpufeed.open(tmp_path / "s").categories
