"""Sources at their edges (issue 63): COCO files that would take the packer's memory or give wrong
annotations, labels that are missing or mixed, JSON nested too deeply, keypoints on some categories
only, and the skip reasons the CLI prints."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

import gpufeed
from conftest import pixels, save, smooth
from gpufeed.sources import SourceError


def write_coco(root, images: list[dict], anns: list[dict], categories: list[dict] | None = None) -> None:
    """An annotation file `root/ann.json` over the images of `root/images`; each image entry is saved
    at its "real" (h, w) when it has one, else at its declared size."""
    for k, image in enumerate(images):
        h, w = image.pop("real", (image["height"], image["width"]))
        save(root / "images" / image["file_name"], smooth(k, h, w))
    data = {"images": images, "annotations": anns, "categories": categories or [{"id": 1, "name": "thing"}]}
    (root / "ann.json").write_text(json.dumps(data))


def pack_coco(root, **kw):
    kw = {"mode": "jpeg", "reencode": False, "progress": False, "workers": 1} | kw
    return gpufeed.pack(root / "ann.json", root / "s", images=root / "images", **kw)


def reasons_of(report, name: str) -> list[str]:
    return [s["reason"] for s in report.skipped if s["path"].endswith(name)]


def never_drawn(*args, **kw):
    raise AssertionError("a mask was drawn")


# -- 6: COCO input that would take the packer's memory ------------------------------------------------------------


class _FakeCoco:
    """Stands in for pycocotools.mask: draws a mask of ones for a polygon within the image, and fails
    the test for one beyond it (on a vertex at 1e9 the real one takes gigabytes, at 1e308 it crashes
    the process)."""

    def frPyObjects(self, seg, h, w):
        assert all(abs(v) <= 2 * max(h, w) for p in seg for v in p), "pycocotools was given the polygon"
        return h, w

    def merge(self, hw):
        return hw

    def decode(self, hw):
        return np.ones(hw, np.uint8)


def _drawn_within(polygons, h, w):
    assert all(abs(v) <= 2 * max(h, w) for p in polygons for v in p), "gpufeed's drawer was given the polygon"
    return np.ones((h, w), np.uint8)


@pytest.mark.parametrize("far", [1e9, 1e308, -1e9])
@pytest.mark.parametrize("installed", [True, False])
def test_a_polygon_far_outside_its_image_skips_it_before_any_drawer_sees_it(tmp_path, monkeypatch, far, installed):
    from gpufeed.sources import coco_masks

    monkeypatch.setattr(coco_masks, "_pycocotools", lambda: _FakeCoco() if installed else None)
    monkeypatch.setattr(coco_masks, "polygon_mask", _drawn_within)
    write_coco(tmp_path, [{"id": 1, "file_name": "a.jpg", "height": 48, "width": 64},
                          {"id": 2, "file_name": "b.jpg", "height": 48, "width": 64}],
               [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [4, 4, 16, 16],
                 "segmentation": [[4, 4, 20, 4, 20, 20, 4, 20]]},
                {"id": 2, "image_id": 2, "category_id": 1, "bbox": [4, 4, 16, 16],
                 "segmentation": [[4, 4, far, 4, 20, 20, 4, 20]]}])
    report = pack_coco(tmp_path)
    (reason,) = reasons_of(report, "b.jpg")
    assert "annotation 0" in reason and "far outside" in reason and "64x48" in reason, reason
    assert len(gpufeed.open(tmp_path / "s")) == 1


def test_a_polygon_whose_edges_are_too_long_to_draw_skips_its_image(tmp_path, monkeypatch):
    """Each edge within the image, but so many of them that pycocotools would take gigabytes (about 52
    bytes per pixel of edge): skipped with the reason, not drawn."""
    from gpufeed.sources import coco_masks

    monkeypatch.setattr(coco_masks, "_pycocotools", lambda: None)
    monkeypatch.setattr(coco_masks, "polygon_mask", never_drawn)
    n = 200_000  # edges across a 64-pixel image: 12.8 million pixels of edge, about 660 MB to draw
    zigzag = np.stack([np.where(np.arange(n) % 2, 63.0, 0.0), np.linspace(0, 47, n)], 1).ravel().tolist()
    write_coco(tmp_path, [{"id": 1, "file_name": "a.jpg", "height": 48, "width": 64}],
               [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 64, 48], "segmentation": [zigzag]}])
    with pytest.raises(gpufeed.PackError) as e:
        pack_coco(tmp_path)
    (reason,) = reasons_of(e.value, "a.jpg")
    assert "annotation 0" in reason and "edges" in reason, reason


@pytest.mark.parametrize("masks", [True, False])
def test_an_images_entry_declaring_another_size_skips_it_before_anything_is_drawn(tmp_path, monkeypatch, masks):
    """60000x60000 declared for a 64x48 file: drawn at the declared size, its masks would take 3.6 GB
    each; its boxes would be clipped to a frame that is not the file's."""
    from gpufeed.sources import coco_masks

    monkeypatch.setattr(coco_masks.CocoMasks, "_one", never_drawn)
    seg = {"segmentation": [[4, 4, 20, 4, 20, 20, 4, 20]]} if masks else {}
    write_coco(tmp_path, [{"id": 1, "file_name": "a.jpg", "height": 60000, "width": 60000, "real": (48, 64)},
                          {"id": 2, "file_name": "b.jpg", "height": 48, "width": 64}],
               [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [4, 4, 16, 16], **seg}])
    report = pack_coco(tmp_path)
    (reason,) = reasons_of(report, "a.jpg")
    assert "declares 60000x60000" in reason and "64x48" in reason, reason
    assert len(gpufeed.open(tmp_path / "s")) == 1


def test_more_mask_pixels_than_packing_holds_for_one_image_skip_it_before_drawing(tmp_path, monkeypatch):
    """50,000 instances in one 256x256 image: 3.3 GB of masks at once. Skipped with the reason before
    any is drawn; the other image packs."""
    from gpufeed.sources import coco_masks

    monkeypatch.setattr(coco_masks.CocoMasks, "_one", lambda self, seg, k: (
        never_drawn() if self.h == 256 else np.ones((self.h, self.w), np.uint8)))
    tri = [[1, 1, 5, 1, 5, 5]]
    anns = [{"id": k, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "segmentation": tri}
            for k in range(50_000)]
    anns.append({"id": 50_000, "image_id": 2, "category_id": 1, "bbox": [1, 1, 4, 4], "segmentation": tri})
    write_coco(tmp_path, [{"id": 1, "file_name": "big.jpg", "height": 256, "width": 256},
                          {"id": 2, "file_name": "small.jpg", "height": 48, "width": 64}], anns)
    report = pack_coco(tmp_path)
    (reason,) = reasons_of(report, "big.jpg")
    assert "50000 masks of 256x256 pixels" in reason and "GiB" in reason, reason
    assert len(gpufeed.open(tmp_path / "s")) == 1


def test_more_instance_masks_than_a_store_holds_are_skipped_when_packing(tmp_path):
    """A store holds at most 65536 masks per sample (its reader refuses more): a sample with more is
    skipped when packing, not written into a store that then can't be read."""
    data = [{"image": pixels(k, 4, 4), "label": 0, "masks": np.zeros((n, 4, 4), np.uint8)}
            for k, n in enumerate((2, 65537))]
    report = gpufeed.pack(data, tmp_path / "s", size=4, progress=False, workers=1)
    assert len(report.skipped) == 1, report.skipped
    assert "65537 masks, more than a store holds" in report.skipped[0]["reason"]
    store = gpufeed.open(tmp_path / "s")
    assert store.field("masks", 0).shape == (2, 4, 4)


# -- 10: labels, duplicate ids, deep JSON ----------------------------------------------------------------------


def test_missing_labels_skip_their_rows_and_classes_are_the_names_given(tmp_path):
    """Before: `N/A`, a blank and `NA` became classes, and a sample labelled "1" became class 2 of
    ['', '0', '1', 'N/A', 'NA', 'cat']."""
    save(tmp_path / "0.png", pixels(0, 16, 16))
    (tmp_path / "l.csv").write_text("path,label\n0.png,cat\n0.png,N/A\n0.png,\n0.png,dog\n0.png,NA\n")
    report = gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    assert store.classes == ["cat", "dog"] and store.labels.tolist() == [0, 1]
    assert [s["reason"] for s in report.skipped] == [
        "no label (line 3 of the list: 'N/A')", "no label (line 4 of the list: '')",
        "no label (line 6 of the list: 'NA')"]


def test_a_null_label_in_a_jsonl_list_skips_its_row_and_an_absent_one_is_unlabelled(tmp_path):
    save(tmp_path / "0.png", pixels(0, 16, 16))
    rows = [{"path": "0.png", "label": 3}, {"path": "0.png", "label": None}, {"path": "0.png"}]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = gpufeed.pack(tmp_path / "l.jsonl", tmp_path / "s", size=16, progress=False, workers=1)
    assert gpufeed.open(tmp_path / "s").labels.tolist() == [3, -1]
    assert [s["reason"] for s in report.skipped] == ["no label (line 2 of the list: None)"]


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_labels_mixing_numbers_and_class_names_are_an_error_naming_the_rows(tmp_path, suffix):
    labels = ["cat", "1", "dog", "0", "cat"]
    if suffix == "csv":
        text = "path,label\n" + "".join(f"0.png,{lab}\n" for lab in labels)
        lines = "lines 3, 5"
    else:
        text = "".join(json.dumps({"path": "0.png", "label": int(lab) if lab.isdigit() else lab}) + "\n"
                       for lab in labels)
        lines = "lines 2, 4"
    (tmp_path / f"l.{suffix}").write_text(text)
    with pytest.raises(SourceError, match=rf"l\.{suffix}: labels mix numbers \({lines}\) and class names") as e:
        gpufeed.pack(tmp_path / f"l.{suffix}", tmp_path / "s", size=16, progress=False, workers=1)
    assert "'cat'" in str(e.value)


def test_integer_labels_no_store_holds_skip_their_rows_and_minus_one_is_unlabelled(tmp_path):
    """Before: -5 was packed into a store its reader then refused, 2**64 failed the pack at its end;
    and in a list of class names, -1 became a class "-1"."""
    save(tmp_path / "0.png", pixels(0, 16, 16))
    (tmp_path / "l.csv").write_text(f"path,label\n0.png,3\n0.png,-5\n0.png,{2**64}\n0.png,-1\n")
    report = gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, progress=False, workers=1)
    assert gpufeed.open(tmp_path / "s").labels.tolist() == [3, -1]
    assert [s["reason"] for s in report.skipped] == [
        "label -5 is not a class index (0 and up, -1 for none; line 3 of the list)",
        f"label {2**64} is not a class index (0 and up, -1 for none; line 4 of the list)"]
    (tmp_path / "n.csv").write_text("path,label\n0.png,cat\n0.png,-1\n")
    gpufeed.pack(tmp_path / "n.csv", tmp_path / "n", size=16, progress=False, workers=1)
    named = gpufeed.open(tmp_path / "n")
    assert named.classes == ["cat"] and named.labels.tolist() == [0, -1]


def test_a_tar_label_below_minus_one_skips_its_sample(tmp_path):
    save(tmp_path / "0.png", pixels(0, 16, 16))
    png = (tmp_path / "0.png").read_bytes()
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for key, cls in (("a", b"2"), ("b", b"-3")):
            for ext, data in (("png", png), ("cls", cls)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    report = gpufeed.pack(tmp_path / "s.tar", tmp_path / "s", size=16, progress=False, workers=1)
    assert gpufeed.open(tmp_path / "s").labels.tolist() == [2]
    assert [s["reason"] for s in report.skipped] == ["label -3 in .cls is not a class index (0 and up, -1 for none)"]


def test_duplicate_coco_image_ids_are_an_error_naming_the_id_and_files(tmp_path):
    """Before: both images packed with the same annotations, without a word."""
    write_coco(tmp_path, [{"id": 7, "file_name": "a.jpg", "height": 48, "width": 64},
                          {"id": 8, "file_name": "b.jpg", "height": 48, "width": 64},
                          {"id": 7, "file_name": "c.jpg", "height": 48, "width": 64}],
               [{"id": 1, "image_id": 7, "category_id": 1, "bbox": [4, 4, 16, 16]}])
    with pytest.raises(SourceError, match=r"ann\.json: image id 7 is listed twice in \"images\" \(a\.jpg, c\.jpg\)"):
        pack_coco(tmp_path)


def test_a_jsonl_line_nested_too_deeply_is_an_error_naming_the_file_and_line(tmp_path):
    """Before: a RecursionError ended the pack."""
    save(tmp_path / "0.png", pixels(0, 16, 16))
    (tmp_path / "l.jsonl").write_text('{"path": "0.png", "label": 0}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(SourceError, match=r"l\.jsonl: line 2: not JSON \(nested too deeply\)"):
        gpufeed.pack(tmp_path / "l.jsonl", tmp_path / "s", size=16, progress=False, workers=1)


def test_a_csv_cell_nested_too_deeply_is_text(tmp_path):
    """A cell that looks like a JSON list but is nested past what the parser takes: not an array,
    so the column is text (before: a RecursionError ended the pack)."""
    save(tmp_path / "0.png", pixels(0, 16, 16))
    deep = "[" * 50_000 + "]" * 50_000
    (tmp_path / "l.csv").write_text(f"path,label,note\n0.png,0,[1]\n0.png,1,{deep}\n")
    gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    assert store.fields["note"]["kind"] == "str" and store.field("note", 1) == deep


def test_a_tar_samples_json_nested_too_deeply_skips_it(tmp_path):
    save(tmp_path / "0.png", pixels(0, 16, 16))
    png = (tmp_path / "0.png").read_bytes()
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for key, meta in (("a", b"{}"), ("b", b"[" * 100_000 + b"]" * 100_000)):
            for ext, data in (("png", png), ("json", meta)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    report = gpufeed.pack(tmp_path / "s.tar", tmp_path / "s", size=16, progress=False, workers=1)
    assert len(gpufeed.open(tmp_path / "s")) == 1
    assert len(report.skipped) == 1 and "nested too deeply" in report.skipped[0]["reason"], report.skipped


# -- 15: keypoints on some categories only; skip reasons in the CLI --------------------------------------------


def persons_and_cars(root, car_keypoints: dict | None = None) -> None:
    """Persons with 2 keypoints, cars without (as COCO's category lists them: no "keypoints" there)."""
    anns = [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [4, 4, 16, 16], "keypoints": [5, 6, 2, 7, 8, 1]},
        {"id": 2, "image_id": 1, "category_id": 2, "bbox": [30, 10, 20, 20], **(car_keypoints or {})},
        {"id": 3, "image_id": 2, "category_id": 2, "bbox": [1, 1, 10, 10], **(car_keypoints or {})},
    ]
    write_coco(root, [{"id": 1, "file_name": "a.jpg", "height": 48, "width": 64},
                      {"id": 2, "file_name": "b.jpg", "height": 48, "width": 64}], anns,
               [{"id": 1, "name": "person", "keypoints": ["nose", "eye"]}, {"id": 2, "name": "car"}])


@pytest.mark.parametrize("car", [{}, {"keypoints": []}, {"keypoints": [0] * 6, "num_keypoints": 0}])
def test_keypoints_on_some_categories_only_pack_with_unlabelled_points_for_the_others(tmp_path, car):
    """Before: every image with a car was skipped ("nothing could be packed", 0 images)."""
    persons_and_cars(tmp_path, car)
    report = pack_coco(tmp_path)
    assert not report.skipped
    store = gpufeed.open(tmp_path / "s")
    by_id = {store.field("image_id", i): i for i in range(len(store))}
    assert store.field("category", by_id[1]) == [1, 2]
    assert store.field("keypoints", by_id[1]).tolist() == [[[5.5, 6.5, 2], [7.5, 8.5, 1]], [[0, 0, 0], [0, 0, 0]]]
    assert store.field("keypoints", by_id[2]).tolist() == [[[0, 0, 0], [0, 0, 0]]]


def test_a_person_without_its_keypoints_is_still_skipped(tmp_path):
    """Only a category that names no keypoints may go without: a person without them is malformed."""
    persons_and_cars(tmp_path)
    data = json.loads((tmp_path / "ann.json").read_text())
    del data["annotations"][0]["keypoints"]
    (tmp_path / "ann.json").write_text(json.dumps(data))
    report = pack_coco(tmp_path)
    assert reasons_of(report, "a.jpg") == ["an annotation without 2 keypoints (x, y, visibility)"]


def test_the_cli_prints_the_skip_reasons_counted_when_nothing_could_be_packed(tmp_path, capsys):
    from gpufeed.cli import main

    images = [{"id": k, "file_name": f"{k}.jpg", "height": 48, "width": 64} for k in range(5)]
    write_coco(tmp_path, images, [])
    for k in range(4):
        (tmp_path / "images" / f"{k}.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "images" / "4.jpg").unlink()
    assert main(["pack", str(tmp_path / "ann.json"), str(tmp_path / "s"), "--images", str(tmp_path / "images"),
                 "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "nothing could be packed (5 skipped)" in err and "(5 images listed)" in err, err
    counted = [line.split()[0] for line in err.splitlines() if line.startswith("  ")]
    assert counted == ["4", "1"], err  # the 4 not JPEGs, then the missing one
    assert "0.jpg" in err and "4.jpg" in err


def test_the_report_counts_skips_per_reason_with_a_few_examples(tmp_path):
    from gpufeed.packing.packer import PackReport

    skipped = [{"path": f"img/{k}.jpg", "reason": "empty file (0 bytes)"} for k in range(30)]
    skipped += [{"path": "img/x.jpg", "reason": "unreadable: Permission denied"}]
    text = PackReport(tmp_path, "raw", 3, skipped, 1.0, 1, 10).summary()
    assert "skipped 31" in text and "30  empty file (0 bytes)" in text and " 1  unreadable" in text, text
    assert "img/0.jpg" in text and "img/29.jpg" not in text and "img/x.jpg" in text
    assert len(text.splitlines()) < 10
