"""gpufeed.pack(dataset, dest): torchvision-style, dict (Hugging Face-style) and bare-image datasets,
with PIL images, tensors, arrays, encoded bytes or paths, on several workers, bad samples skipped."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from conftest import jpeg_bytes, save, smooth


class Pictures:
    """A torchvision-style dataset: (PIL image, label), with `classes`."""

    classes = ["ant", "bee"]

    def __init__(self, n=6, h=24, w=32):
        self.images = [smooth(i, h, w) for i in range(n)]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return Image.fromarray(self.images[i]), i % 2


def test_a_torchvision_style_dataset_packs_like_its_images(tmp_path):
    ds = Pictures()
    report = gpufeed.pack(ds, tmp_path / "s", size=24, fit="pad", workers=2, progress=False)
    assert report.count == 6 and not report.skipped
    store = gpufeed.open(tmp_path / "s")
    assert store.classes == ["ant", "bee"] and store.labels.tolist() == [0, 1, 0, 1, 0, 1]
    assert store.source(3) == "Pictures[3]"
    assert store.manifest.settings["source"] == "dataset Pictures (6 samples)"
    for i in range(6):  # the same pixels as packing the image files
        save(tmp_path / "files" / f"{i}.png", ds.images[i])
    gpufeed.pack(tmp_path / "files", tmp_path / "f", size=24, fit="pad", workers=1, progress=False)
    files = gpufeed.open(tmp_path / "f")
    assert all(torch.equal(store[i][0], files[i][0]) for i in range(6))


def test_a_classes_attribute_that_is_not_names_names_no_class(tmp_path):
    """A dataset's `classes` that is a count (not torchvision's list of names) names no class: the pack
    failed with "'int' object is not iterable"."""

    class Counted(Pictures):
        classes = 2

    gpufeed.pack(Counted(n=4), tmp_path / "s", size=24, workers=1, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert store.classes == [] and store.labels.tolist() == [0, 1, 0, 1]


def test_tensors_arrays_bytes_and_paths(tmp_path):
    rgb = smooth(1, 20, 20)
    rgba = np.dstack([rgb, np.zeros((20, 20), np.uint8)])  # fully transparent: white, as for files
    path = save(tmp_path / "on_disk.png", smooth(2, 20, 20))
    encoded = jpeg_bytes(smooth(3, 20, 20), quality=90)
    samples = [
        (torch.from_numpy(rgb).permute(2, 0, 1).contiguous(), 0),  # CHW tensor
        (rgb, torch.tensor(1)),  # HWC array, a 0-d tensor label
        (rgb[:, :, 0], 2),  # gray
        (rgba, 0),
        {"image": encoded, "label": 1},  # encoded bytes in a dict
        {"img": {"bytes": encoded, "path": None}, "cls": b"2"},  # an undecoded Hugging Face image
        (str(path), 0),  # a file's path
        torch.from_numpy(rgb).permute(2, 0, 1),  # an image alone: label -1
    ]
    report = gpufeed.pack(samples, tmp_path / "s", size=20, workers=2, progress=False)
    assert report.count == 8, report.skipped
    store = gpufeed.open(tmp_path / "s")
    assert store.labels.tolist() == [0, 1, 2, 0, 1, 2, 0, -1]
    assert torch.equal(store[0][0], torch.from_numpy(rgb).permute(2, 0, 1))
    assert torch.equal(store[2][0][0], torch.from_numpy(rgb[:, :, 0]))
    assert int(store[3][0].min()) == 255
    assert store.source(6) == str(path) and store.source(7) == "list[7]"
    jpeg = gpufeed.pack(samples[4:6], tmp_path / "j", mode="jpeg", reencode=False, workers=1, progress=False)
    assert jpeg.count == 2 and bytes(gpufeed.open(tmp_path / "j").encoded(0).numpy()) == encoded


class Broken:
    def __len__(self):
        return 5

    def __getitem__(self, i):
        if i == 1:
            raise FileNotFoundError("/data/missing.jpg")
        return [(smooth(0, 8, 8), 0), None, (12345, 0), (smooth(4, 8, 8), "dog"), (np.zeros((8, 8), np.float32), 0)][i]


def test_bad_samples_are_skipped_with_reasons_or_raise(tmp_path):
    report = gpufeed.pack(Broken(), tmp_path / "s", size=8, workers=1, progress=False)
    reasons = {s["path"]: s["reason"] for s in report.skipped}
    assert report.count == 1 and len(reasons) == 4
    assert "FileNotFoundError: /data/missing.jpg" in reasons["Broken[1]"]
    assert "int, not a PIL image, array, tensor, bytes or path" in reasons["Broken[2]"]
    assert "label 'dog' is not a class index" in reasons["Broken[3]"]
    assert "float32" in reasons["Broken[4]"]
    with pytest.raises(gpufeed.PackError, match=r"Broken\[1\]: the dataset raised FileNotFoundError"):
        gpufeed.pack(Broken(), tmp_path / "r", size=8, workers=1, on_error="raise", progress=False)
    assert not (tmp_path / "r").exists()


def test_torchvision_fake_data(tmp_path):
    from torchvision.datasets import FakeData

    ds = FakeData(size=10, image_size=(3, 18, 22), num_classes=4, random_offset=3)
    gpufeed.pack(ds, tmp_path / "s", mode="jpeg", workers=2, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert len(store) == 10 and store.labels.tolist() == [int(ds[i][1]) for i in range(10)]
    assert store[0][0].shape == (3, 18, 22)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="Hugging Face datasets not installed")
def test_a_hugging_face_dataset(tmp_path):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"]),
                                  "caption": datasets.Value("string"), "score": datasets.Value("float32")})
    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(smooth(i, 16, 12)) for i in range(4)],
                                     "label": [0, 1, 1, 0], "caption": [f"c{i}" for i in range(4)],
                                     "score": [0.5 * i for i in range(4)]}, features=features)
    gpufeed.pack(ds, tmp_path / "s", size=12, workers=2, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert store.classes == ["cat", "dog"] and store.labels.tolist() == [0, 1, 1, 0]
    assert store.source(2) == "Dataset[2]"
    assert store.fields == {"caption": {"kind": "str"}, "score": {"kind": "float"}}  # the other columns
    assert store.field("caption", 3) == "c3" and store.field("score", 3) == 1.5
    gpufeed.pack(ds.with_format("numpy"), tmp_path / "n", size=12, workers=2, progress=False)
    assert gpufeed.open(tmp_path / "n").field("score", 2) == 1.0
