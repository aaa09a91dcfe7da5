"""examples/predict_folder.py on CPU: a folder read in place and a jpeg store in, one CSV row per image
with its top classes out (a ResNet-18 with random weights keeps it fast)."""

from __future__ import annotations

import csv
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from conftest import save, smooth

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "predict_folder.py"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """3 classes x 2 JPEGs, 40x48 and 48x40."""
    root = tmp_path_factory.mktemp("predict") / "images"
    for c in range(3):
        for i in range(2):
            save(root / f"c{c}" / f"{i}.jpg", smooth(i + 10 * c, *((40, 48), (48, 40))[i]), quality=95)
    return root


@pytest.fixture(scope="module")
def store(folder) -> Path:
    gpufeed.pack(folder, folder.parent / "store", mode="jpeg", workers=1, progress=False)
    return folder.parent / "store"


def _predict(argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("predict_folder", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.warns(UserWarning, match="random weights"):
        return module.main([*argv, "--model", "resnet18", "--batch-size", "4", "--device", "cpu"])


def _rows(path: Path, top: int, names: set) -> dict[str, list]:
    """The CSV's rows by source, each checked: `top` names from `names` with probabilities descending."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["source", *(x for k in range(1, top + 1) for x in (f"top{k}", f"p{k}"))]
    for row in rows[1:]:
        classes, probs = row[1::2], [float(p) for p in row[2::2]]
        assert len(classes) == len(set(classes)) == top and set(classes) <= names
        assert all(0 <= p <= 1 for p in probs) and probs == sorted(probs, reverse=True)
    return {row[0]: row[1:] for row in rows[1:]}


def test_a_folder_read_in_place_gives_one_row_per_image(folder, tmp_path):
    names = [f"class {k}" for k in range(10)]
    (tmp_path / "classes.txt").write_text("\n".join(names) + "\n")
    out = _predict([str(folder), "--out", str(tmp_path / "p.csv"), "--classes", str(tmp_path / "classes.txt")])
    images = {str(p) for p in folder.rglob("*.jpg")}
    rows = _rows(tmp_path / "p.csv", 5, set(names))  # 10 outputs named by the file: the top 5
    assert set(rows) == images and out["rows"] == len(images) == 6 and out["skipped"] == []
    assert out["dtype"] == torch.float32  # bf16 on a GPU only: on a CPU it ran 4 times slower (issue 63)


def test_a_jpeg_store_in_with_its_class_names_and_a_limit(folder, store, tmp_path):
    out = _predict([str(store), "--out", str(tmp_path / "p.csv")])
    rows = _rows(tmp_path / "p.csv", 3, {"c0", "c1", "c2"})  # the store's 3 classes: the model's 3 outputs
    assert set(rows) == {str(p) for p in folder.rglob("*.jpg")} and out["rows"] == 6
    _predict([str(store), "--out", str(tmp_path / "some.csv"), "--limit", "5"])
    assert len(_rows(tmp_path / "some.csv", 3, {"c0", "c1", "c2"})) == 5


def test_an_undecodable_image_is_left_out_and_named(store, tmp_path):
    damaged = shutil.copytree(store, tmp_path / "damaged")
    begin = int(np.fromfile(damaged / "offsets.i64", "<i8")[2])
    with open(damaged / "data.bin", "r+b") as f:  # sample 2's JPEG markers gone (`verify` would say so)
        f.seek(begin)
        f.write(bytes(64))
    out = _predict([str(damaged), "--out", str(tmp_path / "p.csv")])
    source = gpufeed.open(store).source(2)
    assert [s for s, _ in out["skipped"]] == [source]
    rows = _rows(tmp_path / "p.csv", 3, {"c0", "c1", "c2"})
    assert out["rows"] == len(rows) == 5 and source not in rows
