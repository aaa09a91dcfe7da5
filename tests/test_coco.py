"""COCO annotation files as a pack source: boxes, category ids, iscrowd, keypoints and the image id
per image, moved with the packed image; bad files and entries named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gpufeed
from conftest import save, smooth
from gpufeed.augment import RandomResizedCrop
from gpufeed.sources import SourceError


def coco(root, keypoints: bool = False) -> dict:
    """Four images (one without annotations, one missing) and their annotations."""
    sizes = {1: (40, 60), 2: (50, 50), 3: (30, 80), 4: (40, 40)}  # id: (height, width)
    for i, (h, w) in sizes.items():
        if i != 4:  # image 4 is listed but missing
            save(root / "images" / f"{i:04d}.jpg", smooth(i, h, w))
    images = [{"id": i, "file_name": f"{i:04d}.jpg", "height": h, "width": w} for i, (h, w) in sizes.items()]
    images.append({"id": 5, "file_name": "../escape.jpg", "height": 10, "width": 10})
    anns = [
        {"id": 1, "image_id": 1, "category_id": 3, "bbox": [10, 5, 20, 10], "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 1, "bbox": [50, 30, 30, 30], "iscrowd": 1},  # clipped to 60x40
        {"id": 3, "image_id": 1, "category_id": 1, "bbox": [5, 5, 0, 4], "iscrowd": 0},  # empty: left out
        {"id": 4, "image_id": 3, "category_id": 3, "bbox": [0, 0, 80, 30], "iscrowd": 0},
    ]
    if keypoints:
        for a in anns:
            x, y = a["bbox"][:2]
            a["keypoints"] = [x + 1, y + 1, 2, x + 2, y + 1, 1]
    data = {"images": images, "annotations": anns, "categories": [{"id": 3, "name": "dog"}, {"id": 1, "name": "cat"}]}
    (root / "ann.json").write_text(json.dumps(data))
    return data


def test_an_instances_file_packs_each_image_with_its_annotations(tmp_path):
    coco(tmp_path)
    report = gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg",
                          max_side=40, progress=False, workers=1)  # images halved or so: boxes move with them
    store = gpufeed.open(tmp_path / "s")
    assert store.classes == ["cat", "dog"] and len(store) == 3
    reasons = sorted(s["reason"] for s in report.skipped)
    assert any("outside the images folder" in r for r in reasons) and any("0004.jpg" in s["path"] for s in report.skipped)
    by_id = {store.field("image_id", i): i for i in range(len(store))}
    one = by_id[1]
    assert store.field("category", one) == [3, 1] and store.field("iscrowd", one) == [0, 1]
    scale = 40 / 60  # 60x40 stored as 40 wide
    assert np.allclose(store.field("boxes", one), np.array([[10, 5, 30, 15], [50, 30, 60, 40]]) * scale, atol=0.5)
    assert store.field("category", by_id[2]) == [] and len(store.field("boxes", by_id[2])) == 0
    assert int(store.labels[one]) == -1


def test_a_keypoints_file_packs_them_and_a_loader_moves_them(tmp_path):
    coco(tmp_path, keypoints=True)
    gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg",
                 reencode=False, progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    assert store.fields["keypoints"] == {"kind": "keypoints", "points": 2}
    one = next(i for i in range(len(store)) if store.field("image_id", i) == 1)
    # pixel indices + 0.5, as detectron2 reads them: continuous pixels, as the boxes
    assert store.field("keypoints", one).tolist() == [[[11.5, 6.5, 2], [12.5, 6.5, 1]], [[51.5, 31.5, 2], [52.5, 31.5, 1]]]
    empty = next(i for i in range(len(store)) if store.field("image_id", i) == 2)
    assert store.field("keypoints", empty).shape == (0, 2, 3)
    loader = gpufeed.Loader(store, batch_size=3, device="cpu", augment=[RandomResizedCrop(32)],
                            fields=("boxes", "keypoints", "category", "image_id"), drop_last=False,
                            keypoint_flip=[1, 0])
    for batch in loader:
        for k, i in enumerate(batch["image_id"].tolist()):
            count = int(batch["boxes_count"][k])
            assert int(batch["keypoints_count"][k]) == count
            kept = batch["boxes_kept"][k, :count].tolist()
            stored = next(j for j in range(len(store)) if store.field("image_id", j) == i)
            categories = [batch["category"][k][j] for j in kept]  # a sample's per-instance values, picked
            assert categories == [store.field("category", stored)[j] for j in kept]
            assert sorted(kept) == kept and all(0 <= j < len(store.field("boxes", stored)) for j in kept)


@pytest.mark.parametrize("content, why", [
    ("{not json", "not JSON"),
    ('{"annotations": []}', 'no "images" list'),
    ('{"images": [], "annotations": {}}', '"annotations" is not a list'),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_a_file_that_is_not_coco_is_refused_by_name(tmp_path, content, why):
    (tmp_path / "images").mkdir()
    (tmp_path / "ann.json").write_text(content)
    with pytest.raises(SourceError, match=why) as e:
        gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", progress=False, workers=1)
    assert "ann.json" in str(e.value)


def test_an_annotation_file_needs_its_images_folder(tmp_path):
    coco(tmp_path)
    with pytest.raises(SourceError, match="needs its images folder"):
        gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", progress=False, workers=1)
    with pytest.raises(SourceError, match="no such folder"):
        gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "nowhere", progress=False, workers=1)


def test_the_cli_packs_an_annotation_file_with_its_images(tmp_path, capsys):
    from gpufeed.cli import main

    coco(tmp_path)
    assert main(["pack", str(tmp_path / "ann.json"), str(tmp_path / "s"), "--images", str(tmp_path / "images"),
                 "--mode", "jpeg", "--workers", "1"]) == 0
    assert len(gpufeed.open(tmp_path / "s")) == 3


def test_raw_packing_keeps_every_instance_in_step(tmp_path):
    """Centre-cropped to a square, image 1 loses its second box's area: the box stays (empty), so the
    sample's boxes, categories and keypoints still line up; a loader then drops it and says so."""
    coco(tmp_path, keypoints=True)
    gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", size=32, progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    one = next(i for i in range(len(store)) if store.field("image_id", i) == 1)
    assert len(store.field("boxes", one)) == len(store.field("category", one)) == len(store.field("keypoints", one)) == 2
    loader = gpufeed.Loader(store, batch_size=3, device="cpu", augment=[RandomResizedCrop(32, scale=(1, 1), ratio=(1, 1))],
                            fields=("boxes", "keypoints", "category", "image_id"), shuffle=False, drop_last=False)
    batch = next(iter(loader))
    k = batch["image_id"].tolist().index(1)
    assert int(batch["boxes_count"][k]) == int(batch["keypoints_count"][k]) == 1
    assert [batch["category"][k][j] for j in batch["boxes_kept"][k, :1].tolist()] == [3]


def test_hostile_entries_are_skipped_or_refused_by_name(tmp_path):
    data = coco(tmp_path, keypoints=True)
    data["images"] += [{"id": [7], "file_name": "0001.jpg", "height": 40, "width": 60},
                       {"id": 8, "file_name": "0001.jpg", "height": 10**400, "width": 60},
                       {"id": 9, "file_name": "nul\u0000.jpg", "height": 40, "width": 60}]
    data["annotations"] += [{"id": 9, "image_id": {"x": 1}, "bbox": [0, 0, 5, 5]},
                            {"id": 10, "image_id": 2, "category_id": 1, "bbox": [1e400, 0, 5, 5]},
                            {"id": 11, "image_id": 3, "category_id": 1, "bbox": [0, 0, 5, 5], "keypoints": None}]
    (tmp_path / "ann.json").write_text(json.dumps(data).replace("Infinity", "1" + "0" * 400))
    report = gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg",
                          progress=False, workers=1)
    reasons = " ".join(s["reason"] for s in report.skipped)
    assert "id is not a number or string" in reasons and "no width and height" in reasons and "NUL" in reasons
    assert "without 2 keypoints" in reasons  # image 3's annotation without them
    assert len(gpufeed.open(tmp_path / "s")) == 2


def test_the_images_folder_inside_the_destination_is_refused(tmp_path):
    coco(tmp_path / "data")
    (tmp_path / "data" / "ann.json").rename(tmp_path / "ann.json")
    with pytest.raises(ValueError, match="inside the destination"):
        gpufeed.pack(tmp_path / "ann.json", tmp_path / "data", images=tmp_path / "data" / "images",
                     overwrite=True, progress=False, workers=1)
    assert (tmp_path / "data" / "images" / "0001.jpg").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pycocotools and numpy 2
def test_segmentations_pack_as_instance_masks_from_polygons_and_run_lengths(tmp_path):
    """Image 1's first annotation is a polygon (a rectangle), its crowd one COCO's compressed
    run-length string; both come back as masks in step with the boxes, halved with the image."""
    pycocotools = pytest.importorskip("pycocotools.mask")
    data = coco(tmp_path)
    crowd = np.zeros((40, 60), np.uint8)
    crowd[30:40, 50:60] = 1
    rle = pycocotools.encode(np.asfortranarray(crowd))
    anns = data["annotations"]
    anns[0]["segmentation"] = [[10, 5, 30, 5, 30, 15, 10, 15]]
    anns[1]["segmentation"] = {"size": [40, 60], "counts": rle["counts"].decode()}
    anns[3]["segmentation"] = {"size": [30, 80], "counts": [0, 30 * 80]}  # all of image 3, uncompressed
    (tmp_path / "ann.json").write_text(json.dumps(data))
    gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg", reencode=False,
                 progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    assert store.fields["masks"] == {"kind": "masks", "instances": True, "dtype": "|u1"}
    by_id = {store.field("image_id", i): i for i in range(len(store))}
    masks = store.field("masks", by_id[1])
    rect = np.zeros((40, 60), np.uint8)
    rect[5:15, 10:30] = 1
    assert masks.shape == (2, 40, 60) and np.array_equal(masks[0], rect) and np.array_equal(masks[1], crowd)
    assert store.field("masks", by_id[3]).all() and store.field("masks", by_id[2]).shape == (0, 50, 50)
    loader = gpufeed.Loader(store, batch_size=3, device="cpu", augment=[RandomResizedCrop(24)], shuffle=False,
                            fields=("masks", "boxes", "image_id"), drop_last=False)
    batch = next(iter(loader))
    assert batch["masks"].shape[2:] == (24, 24) and batch["masks_count"].tolist() == batch["boxes_count"].tolist()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pycocotools and numpy 2
def test_coco_run_lengths_and_polygons_are_drawn_as_pycocotools_draws_them(monkeypatch):
    """Compressed run-lengths decode exactly; without pycocotools, polygons are drawn by their pixel
    centres: measured here, under 3 % of a mask's pixels (its edges) differ from COCO's."""
    from gpufeed.sources import coco_masks

    mask = pytest.importorskip("pycocotools.mask")
    rng = np.random.default_rng(0)
    h, w, differ, total = 60, 80, 0, 0
    for _ in range(100):
        n = rng.integers(3, 9)
        angles, radii = np.sort(rng.uniform(0, 2 * np.pi, n)), rng.uniform(3, 20, n)
        cx, cy = rng.uniform(10, 70), rng.uniform(10, 50)
        poly = np.stack([cx + radii * np.cos(angles), cy + radii * np.sin(angles)], 1).ravel().tolist()
        want = mask.decode(mask.merge(mask.frPyObjects([poly], h, w)))
        encoded = mask.encode(np.asfortranarray(want))
        got = coco_masks.rle_mask(coco_masks.rle_counts(encoded["counts"].decode()), h, w)
        assert np.array_equal(got, want)
        assert np.array_equal(coco_masks.CocoMasks(([poly],), h, w)()[0], want)  # pycocotools, installed
        monkeypatch.setattr(coco_masks, "_pycocotools", lambda: None)
        drawn = coco_masks.CocoMasks(([poly],), h, w)()[0]
        monkeypatch.undo()
        differ += int((drawn != want).sum())
        total += int(want.sum())
    assert 0 < differ / total < 0.03


@pytest.mark.parametrize("seg, why", [
    ({"size": [40, 60], "counts": "~~~"}, "character outside"),
    ({"size": [40, 60], "counts": [5, 5]}, "cover 10 pixels of a 40x60 image"),
    ({"size": [4, 6], "counts": [24]}, "run-length mask of size [4, 6]"),
    ([[1, 2, 3]], "neither polygons nor a run-length mask"),
    (None, "neither polygons nor a run-length mask"),
])
def test_a_malformed_segmentation_skips_its_image_with_the_reason(tmp_path, seg, why):
    data = coco(tmp_path)
    data["annotations"][0]["segmentation"] = seg
    (tmp_path / "ann.json").write_text(json.dumps(data))
    report = gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg",
                          progress=False, workers=1)
    reasons = [s["reason"] for s in report.skipped if s["path"].endswith("0001.jpg")]
    assert len(reasons) == 1 and "annotation 0" in reasons[0] and why in reasons[0], report.skipped


def test_keypoints_per_instance_come_from_the_categories_names_of_them(tmp_path):
    """COCO's person category names its 17 keypoints: an annotation with another count is named, even
    when it comes first."""
    data = coco(tmp_path, keypoints=True)
    data["categories"][0]["keypoints"] = ["nose", "eye"]  # 2 points per instance, as every annotation has
    data["categories"][1]["keypoints"] = ["nose", "eye"]
    data["annotations"][0]["keypoints"] = [1, 1, 2, 2, 2, 2, 3, 3, 2]  # the first one has 3
    (tmp_path / "ann.json").write_text(json.dumps(data))
    report = gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg",
                          progress=False, workers=1)
    assert gpufeed.open(tmp_path / "s").fields["keypoints"]["points"] == 2
    assert any("without 2 keypoints" in s["reason"] and s["path"].endswith("0001.jpg") for s in report.skipped)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pycocotools and numpy 2
def test_per_image_targets_pick_each_kept_boxs_category_mask_and_keypoints(tmp_path):
    """`gpufeed.loader.per_image`: the dicts torchvision's detection models take, each kept box with
    its own category (by `boxes_kept`), mask and keypoints."""
    from gpufeed.loader import per_image

    data = coco(tmp_path, keypoints=True)
    for a in data["annotations"]:
        x, y, w, h = a["bbox"]
        a["segmentation"] = [[x, y, x + max(w, 1), y, x + max(w, 1), y + max(h, 1), x, y + max(h, 1)]]
    (tmp_path / "ann.json").write_text(json.dumps(data))
    gpufeed.pack(tmp_path / "ann.json", tmp_path / "s", images=tmp_path / "images", mode="jpeg", reencode=False,
                 progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    loader = gpufeed.Loader(store, batch_size=3, device="cpu", augment=[RandomResizedCrop(24, scale=(0.5, 1))],
                            fields=("boxes", "masks", "keypoints", "category"), shuffle=False, drop_last=False, seed=3)
    batch = next(iter(loader))
    targets = per_image(batch, "category")
    assert len(targets) == 3
    for k, t in enumerate(targets):
        c = int(batch["boxes_count"][k])
        kept = batch["boxes_kept"][k, :c].tolist()
        assert t["labels"].tolist() == [batch["category"][k][j] for j in kept]
        assert t["boxes"].shape == (c, 4) and t["masks"].shape[0] == c and t["keypoints"].shape[0] == c
        assert torch.equal(t["masks"], batch["masks"][k, :c])
    assert [t["labels"].tolist() for t in per_image(batch)] == [[1] * int(c) for c in batch["boxes_count"]]
