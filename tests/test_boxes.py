"""Boxes: moved into the stored image's frame when packed, then through each batch's crops, flips
and warps exactly as torchvision.transforms.v2 moves BoundingBoxes, padded with counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode as IM
from torchvision.transforms.v2 import functional as F

import gpufeed
from gpufeed.augment import (CenterCrop, RandomHorizontalFlip, RandomResizedCrop, RandomRotation,
                             RandomVerticalFlip, Resize)
from gpufeed.synth import natural_image

S = 32


def boxes_of(k: int) -> np.ndarray:
    rng = np.random.default_rng(k)
    xy = rng.uniform(0, S - 8, size=(k % 4 + 1, 2))
    wh = rng.uniform(2, 12, size=(k % 4 + 1, 2))
    return np.concatenate([xy, np.minimum(xy + wh, S)], 1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    data = [{"image": natural_image(rng, S, S, k), "label": k % 2, "boxes": boxes_of(k), "id": k} for k in range(24)]
    dest = tmp_path_factory.mktemp("boxes") / "s"
    gpufeed.pack(data, dest, size=S, progress=False, workers=1)
    return gpufeed.open(dest)


def reference(stored: np.ndarray, params, k: int, rotate: float | None = None) -> torch.Tensor:
    """torchvision v2 on BoundingBoxes with sample k's parameters, then boxes under 1 px dropped."""
    b = tv_tensors.BoundingBoxes(torch.as_tensor(stored, dtype=torch.float64), format="XYXY", canvas_size=(S, S))
    x1, y1, x2, y2 = params.boxes[k].double().tolist()
    b = F.resized_crop(b, round(y1), round(x1), round(y2 - y1), round(x2 - x1), list(params.out_hw))
    if params.flip[k]:
        b = F.horizontal_flip(b)
    if params.vflip is not None and params.vflip[k]:
        b = F.vertical_flip(b)
    if rotate is not None:
        b = F.rotate(b, rotate, IM.NEAREST)
    b = b.as_subclass(torch.Tensor)
    keep = (b[:, 2] - b[:, 0] >= 1) & (b[:, 3] - b[:, 1] >= 1)
    return b[keep].float()


def test_boxes_follow_crops_and_flips_like_torchvision(store):
    ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip(), RandomVerticalFlip()]
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=2, fields=("boxes", "id"))
    checked = 0
    for number, batch in enumerate(loader):
        _, params = loader.plan(0, number)
        assert batch["boxes"].shape[0] == 8 and batch["boxes"].shape[2] == 4
        for k, i in enumerate(batch["id"].tolist()):
            want = reference(store.field("boxes", i), params, k)
            count = int(batch["boxes_count"][k])
            assert count == len(want) and torch.allclose(batch["boxes"][k, :count], want, atol=1e-3), (i, k)
            assert not batch["boxes"][k, count:].any()
            checked += count
    assert checked > 10


def test_boxes_follow_a_rotation_like_torchvision(store):
    ops = [Resize((S, S)), RandomRotation(25)]
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=4, shuffle=False,
                            fields=("boxes",))
    batch = next(iter(loader))
    _, params = loader.plan(0, 0)
    angles = torch.empty(8, dtype=torch.float64).uniform_(-25, 25, generator=torch.Generator().manual_seed(
        hash((4, 0, 0)) & (2**63 - 1)))
    for k in range(8):
        i = int(loader.plan(0, 0)[0][k])
        want = reference(store.field("boxes", i), params, k, float(angles[k]))
        count = int(batch["boxes_count"][k])
        assert count == len(want) and torch.allclose(batch["boxes"][k, :count], want, atol=1e-3), k


def test_evaluation_resize_and_center_crop_drop_boxes_outside(store):
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=[Resize(40), CenterCrop(16)],
                            shuffle=False, fields=("boxes", "id"))
    batch = next(iter(loader))
    for k, i in enumerate(batch["id"].tolist()):
        b = tv_tensors.BoundingBoxes(torch.as_tensor(store.field("boxes", i)), format="XYXY", canvas_size=(S, S))
        want = F.center_crop(F.resize(b, [40]), [16]).as_subclass(torch.Tensor)
        want = want[(want[:, 2] - want[:, 0] >= 1) & (want[:, 3] - want[:, 1] >= 1)]
        count = int(batch["boxes_count"][k])
        assert count == len(want) and torch.allclose(batch["boxes"][k, :count], want, atol=1e-3)


def test_packing_moves_boxes_into_the_stored_frame(tmp_path):
    rng = np.random.default_rng(5)
    data = [{"image": natural_image(rng, 40, 60, 0), "boxes": [[10, 5, 20, 30], [0, 0, 5, 5]]},
            {"image": natural_image(rng, 40, 60, 1), "boxes": []}]
    gpufeed.pack(data, tmp_path / "crop", size=20, fit="crop", progress=False, workers=1)
    crop = gpufeed.open(tmp_path / "crop")  # 60x40 -> centre 40x40 from x=10 -> 20x20
    # the second box lay outside the crop: kept, empty, in step with the sample's other per-instance values
    assert crop.field("boxes", 0).tolist() == [[0.0, 2.5, 5.0, 15.0], [0.0, 0.0, 0.0, 2.5]]
    assert crop.field("boxes", 1).shape == (0, 4)
    gpufeed.pack(data, tmp_path / "jpeg", mode="jpeg", max_side=30, progress=False, workers=1)
    jpeg = gpufeed.open(tmp_path / "jpeg")  # 60x40 -> 30x20
    assert jpeg.field("boxes", 0).tolist() == [[5.0, 2.5, 10.0, 15.0], [0.0, 0.0, 2.5, 2.5]]
    bad = [{"image": natural_image(rng, 24, 24, 0), "boxes": [[1, 2, 3]]}]
    report = gpufeed.pack(bad + data, tmp_path / "bad", size=20, progress=False, workers=1)
    assert report.count == 2 and "shape (1, 3)" in report.skipped[0]["reason"]


def test_a_replaced_samples_boxes_are_those_of_the_image_it_got(tmp_path):
    rng = np.random.default_rng(6)
    data = [{"image": natural_image(rng, S, S + k, k), "boxes": boxes_of(k), "id": k} for k in range(8)]
    gpufeed.pack(data, tmp_path / "s", mode="jpeg", progress=False, workers=1)
    gpufeed.pack(data, tmp_path / "whole", mode="jpeg", progress=False, workers=1)
    store = gpufeed.open(tmp_path / "s")
    start, end = int(store.offsets[5]), int(store.offsets[6])
    with open(store.path / "data.bin", "r+b") as f:
        f.seek(start)
        f.write(b"\0" * (end - start))
    make = lambda s, **kw: gpufeed.Loader(s, batch_size=8, device="cpu", augment=[RandomResizedCrop(24)],  # noqa: E731
                                          fields=("boxes", "id"), **kw)
    # evaluation: sample 5 left out, every other one with its own image and boxes
    evaluated = next(iter(make(store, shuffle=False, drop_last=False)))
    whole = next(iter(make(tmp_path / "whole", shuffle=False, drop_last=False)))
    ids = whole["id"].tolist()
    assert sorted(evaluated["id"].tolist()) == [0, 1, 2, 3, 4, 6, 7]
    for j, i in enumerate(evaluated["id"].tolist()):
        assert torch.equal(evaluated["image"][j], whole["image"][ids.index(i)])
        assert torch.equal(evaluated["boxes"][j], whole["boxes"][ids.index(i)])
    loader = make(store)  # training: sample 5 replaced
    batch = next(iter(loader))
    planned = loader.plan(0, 0)[0].tolist()
    k = planned.index(5)
    got = int(batch["id"][k])
    twin = planned.index(got)
    assert got != 5 and torch.equal(batch["image"][k], batch["image"][twin])
    assert torch.equal(batch["boxes"][k], batch["boxes"][twin]) and batch["boxes_count"][k] == batch["boxes_count"][twin]


def test_boxes_kept_names_each_yielded_boxs_stored_index(store):
    """A sample's other per-instance values are picked with "boxes_kept": it names, for each box
    yielded, which of the sample's stored boxes it is (the ones under a pixel are left out)."""
    ops = [RandomResizedCrop(12, scale=(0.1, 0.3)), RandomHorizontalFlip()]  # small crops: many boxes cut away
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=5, fields=("boxes", "id"))
    dropped = 0
    for number, batch in enumerate(loader):
        _, params = loader.plan(0, number)
        for k, i in enumerate(batch["id"].tolist()):
            stored = store.field("boxes", i)
            count = int(batch["boxes_count"][k])
            kept = batch["boxes_kept"][k, :count].tolist()
            assert batch["boxes_kept"][k, count:].eq(-1).all()
            for m, j in enumerate(kept):  # box m is stored box j moved alone
                alone = reference(stored[j : j + 1], params, k)
                assert len(alone) == 1 and torch.allclose(batch["boxes"][k, m], alone[0], atol=1e-3), (i, m, j)
            dropped += len(stored) - count
    assert dropped > 0
