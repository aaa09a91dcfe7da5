"""Keypoints: packed from any of the usual forms, moved into the stored image's frame, then through
each batch's crops, flips and warps as torchvision.transforms.v2 moves KeyPoints (a mirror maps x to
W - x, torchvision's to W - 1 - x), mirrored pairs swapped, points that leave invisible, instances
dropped with their boxes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode as IM
from torchvision.transforms.v2 import functional as F

import gpufeed
from gpufeed.augment import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, RandomRotation, Resize
from gpufeed.store import StoreError
from gpufeed.synth import natural_image
from conftest import skipped_after

S, K = 32, 3
FLIP = [0, 2, 1]  # point 0 stays (a nose), 1 and 2 swap (left and right eyes)


def points_of(k: int) -> np.ndarray:
    """Sample k's (instances, K, 3) keypoints: k % 3 + 1 instances, a few points not labelled."""
    rng = np.random.default_rng(k)
    xy = rng.uniform(0, S, size=(k % 3 + 1, K, 2))
    v = rng.choice([0, 1, 2], size=(k % 3 + 1, K, 1), p=[0.2, 0.2, 0.6])
    return np.concatenate([xy, v], 2)


def boxes_around(points: np.ndarray) -> np.ndarray:
    lo, hi = points[..., :2].min(1), points[..., :2].max(1)
    return np.concatenate([lo, np.maximum(hi, lo + 2)], 1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    data = []
    for k in range(24):
        p = points_of(k)
        # COCO's flat rows for some samples, (instances, K, 3) for the others
        given = p.reshape(len(p), -1).tolist() if k % 2 else p
        data.append({"image": natural_image(rng, S, S, k), "label": k % 2, "keypoints": given,
                     "boxes": boxes_around(p), "id": k})
    dest = tmp_path_factory.mktemp("keypoints") / "s"
    gpufeed.pack(data, dest, size=S, progress=False, workers=1)
    return gpufeed.open(dest)


def reference(stored: np.ndarray, params, k: int, rotate: float | None = None) -> np.ndarray:
    """torchvision v2 on KeyPoints with sample k's parameters; its mirror moved one pixel (W - x, not
    W - 1 - x), the pairs swapped, points out of the image invisible."""
    kp = tv_tensors.KeyPoints(torch.as_tensor(stored[..., :2], dtype=torch.float64), canvas_size=(S, S))
    x1, y1, x2, y2 = params.boxes[k].double().tolist()
    kp = F.resized_crop(kp, round(y1), round(x1), round(y2 - y1), round(x2 - x1), list(params.out_hw))
    xy = kp.as_subclass(torch.Tensor).numpy().copy()
    v = stored[..., 2].copy()
    if params.flip[k]:
        xy[..., 0] = params.out_hw[1] - xy[..., 0]
        xy, v = xy[:, FLIP], v[:, FLIP]
    if rotate is not None:
        h, w = params.out_hw  # cropped away before the rotation: it moves only the fill around them
        v = np.where((xy[..., 0] < 0) | (xy[..., 0] > w) | (xy[..., 1] < 0) | (xy[..., 1] > h), 0, v)
        moved = F.rotate(tv_tensors.KeyPoints(torch.from_numpy(xy), canvas_size=tuple(params.out_hw)), rotate, IM.NEAREST)
        xy = moved.as_subclass(torch.Tensor).numpy()
    h, w = params.final_hw
    outside = (xy[..., 0] < 0) | (xy[..., 0] > w) | (xy[..., 1] < 0) | (xy[..., 1] > h)  # edges inclusive
    return np.concatenate([xy, np.where(outside, 0, v)[..., None]], 2)


def test_packed_keypoints_come_back_in_every_form_given(store):
    assert store.fields["keypoints"] == {"kind": "keypoints", "points": K}
    for k in range(24):
        got = store.field("keypoints", k)
        assert got.dtype == np.float32 and got.shape == (k % 3 + 1, K, 3)
        assert np.allclose(got, points_of(k), atol=1e-4)  # raw 32x32 from 32x32: the same frame


def test_keypoints_follow_crops_and_mirrors_like_torchvision_with_pairs_swapped(store):
    ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip()]
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=2, fields=("keypoints", "id"),
                            keypoint_flip=FLIP)
    checked = mirrored = hidden = 0
    for number, batch in enumerate(loader):
        _, params = loader.plan(0, number)
        assert batch["keypoints"].shape[0] == 8 and batch["keypoints"].shape[2:] == (K, 3)
        for k, i in enumerate(batch["id"].tolist()):
            want = reference(store.field("keypoints", i), params, k)
            count = int(batch["keypoints_count"][k])
            got = batch["keypoints"][k, :count].numpy()
            assert count == len(want) and np.allclose(got, want, atol=1e-3), (i, k)
            assert not batch["keypoints"][k, count:].any()
            checked += count
            mirrored += bool(params.flip[k])
            hidden += int(((got[..., 2] == 0) & (store.field("keypoints", i)[..., 2] > 0)).sum())
    assert checked > 10 and mirrored and hidden  # some crops cut labelled points away


def test_keypoints_follow_a_rotation_like_torchvision(store):
    ops = [Resize((S, S)), RandomRotation(25)]
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=4, shuffle=False,
                            fields=("keypoints",))
    batch = next(iter(loader))
    indices, params = loader.plan(0, 0)
    angles = torch.empty(8, dtype=torch.float64).uniform_(-25, 25, generator=torch.Generator().manual_seed(
        hash((4, 0, 0)) & (2**63 - 1)))
    for k in range(8):
        want = reference(store.field("keypoints", int(indices[k])), params, k, float(angles[k]))
        count = int(batch["keypoints_count"][k])
        assert np.allclose(batch["keypoints"][k, :count].numpy(), want, atol=1e-3), k


def test_an_instance_whose_box_is_dropped_loses_its_keypoints_too(tmp_path):
    rng = np.random.default_rng(1)
    near = [[12.0, 12.0, 2], [14.0, 13.0, 2], [16.0, 12.0, 1]]
    far = [[28.0, 28.0, 2], [29.0, 29.0, 2], [30.0, 28.0, 2]]
    data = [{"image": natural_image(rng, S, S, 0), "label": 0, "keypoints": [near, far],
             "boxes": [[10, 10, 20, 20], [27, 27, 31, 31]]}]
    gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1)
    # the center 16x16 (8..24): the far box is cut away, and with it its instance's points
    loader = gpufeed.Loader(tmp_path / "s", batch_size=1, device="cpu", augment=[CenterCrop(16)], shuffle=False,
                            fields=("boxes", "keypoints"))
    batch = next(iter(loader))
    assert int(batch["boxes_count"][0]) == 1 and int(batch["keypoints_count"][0]) == 1
    assert batch["keypoints"][0, 0].tolist() == [[4.0, 4.0, 2], [6.0, 5.0, 2], [8.0, 4.0, 1]]
    alone = gpufeed.Loader(tmp_path / "s", batch_size=1, device="cpu", augment=[CenterCrop(16)], shuffle=False,
                           fields=("keypoints",))
    points = next(iter(alone))["keypoints"][0]  # without boxes asked for: both instances, the far one unseen
    assert points.shape == (2, K, 3) and points[1, :, 2].tolist() == [0, 0, 0]


def test_raw_packing_moves_keypoints_into_the_stored_frame(tmp_path):
    rng = np.random.default_rng(2)
    # 64 wide, 32 tall, center-cropped to 32x32 then resized to 16x16: x - 16, then halved
    points = np.array([[[20.0, 10.0, 2], [2.0, 10.0, 2], [40.0, 30.0, 1]]])
    data = [{"image": natural_image(rng, 32, 64, 0), "label": 0, "keypoints": points}]
    gpufeed.pack(data, tmp_path / "s", size=16, progress=False, workers=1)
    got = gpufeed.open(tmp_path / "s").field("keypoints", 0)
    assert np.allclose(got, [[[2.0, 5.0, 2], [-7.0, 5.0, 0], [12.0, 15.0, 1]]])  # the second cropped away


@pytest.mark.parametrize("bad, why", [
    ([[1.0, 2.0]], "keypoints of shape"),
    ([[[1.0, 2.0, 7.0]]], "visibility other than 0, 1 or 2"),
    ([[[float("nan"), 2.0, 2.0]]], "not finite"),
    ("eyes", "not numbers"),
])
def test_malformed_keypoints_skip_their_sample_with_the_reason(tmp_path, bad, why):
    reason = skipped_after(tmp_path, "keypoints", points_of(0), bad, seed=3, side=S)
    assert "field 'keypoints'" in reason and why in reason, reason


def test_another_count_of_points_per_instance_is_skipped(tmp_path):
    reason = skipped_after(tmp_path, "keypoints", points_of(0), np.zeros((1, 5, 3)), seed=4, side=S)
    assert "has 5 points per instance, the first sample's 3" in reason


def test_keypoint_flip_is_checked(store):
    with pytest.raises(ValueError, match="a permutation of 0..2"):
        gpufeed.Loader(store, batch_size=8, device="cpu", fields=("keypoints",), keypoint_flip=[0, 1, 1])
    with pytest.raises(ValueError, match="mirrored again is itself"):  # a rotation of the points, not a mirror
        gpufeed.Loader(store, batch_size=8, device="cpu", fields=("keypoints",), keypoint_flip=[1, 2, 0])
    with pytest.raises(ValueError, match="keypoint_flip is for fields"):
        gpufeed.Loader(store, batch_size=8, device="cpu", fields=("boxes",), keypoint_flip=FLIP)


def test_a_manifest_or_offsets_out_of_shape_are_refused(store, tmp_path):
    import shutil

    for points in (0, 2000, "3"):
        copy = tmp_path / f"m{points}"
        shutil.copytree(store.path, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["fields"]["keypoints"]["points"] = points
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(StoreError):
            gpufeed.open(copy)
    copy = tmp_path / "offsets"
    shutil.copytree(store.path, copy)
    offsets = np.fromfile(copy / "field.keypoints.i64", "<i8")
    offsets[1:] -= 12  # each sample's first instance cut by one point
    offsets.tofile(copy / "field.keypoints.i64")
    with pytest.raises(StoreError, match="not a whole row"):
        gpufeed.open(copy)


def test_a_sharded_store_keeps_its_keypoints(store, tmp_path):
    data = [{"image": store[i][0].permute(1, 2, 0).numpy(), "label": 0, "keypoints": store.field("keypoints", i)}
            for i in range(12)]
    gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1, shard_size="4KB")
    sharded = gpufeed.open(tmp_path / "s")
    assert len(sharded.manifest.shards) > 1 and sharded.fields["keypoints"] == {"kind": "keypoints", "points": K}
    for i in range(12):
        assert np.array_equal(sharded.field("keypoints", i), store.field("keypoints", i))


def test_a_point_cropped_away_stays_invisible_through_a_rotation_and_one_on_the_edge_is_kept(tmp_path):
    rng = np.random.default_rng(6)
    points = [[[27.0, 16.0, 2], [8.0, 16.0, 2], [16.0, 16.0, 2]]]  # the first outside the center 16x16
    data = [{"image": natural_image(rng, S, S, 0), "label": 0, "keypoints": points}]
    gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1)
    loader = gpufeed.Loader(tmp_path / "s", batch_size=1, device="cpu", shuffle=False, fields=("keypoints",),
                            augment=[CenterCrop(16), RandomRotation((45, 45))])
    got = next(iter(loader))["keypoints"][0, 0]
    assert got[0, 2] == 0 and got[2, 2] == 2  # rotated back inside the frame, still not there
    mirrored = gpufeed.Loader(tmp_path / "s", batch_size=1, device="cpu", shuffle=False, fields=("keypoints",),
                              augment=[CenterCrop(16), RandomHorizontalFlip(p=1.0)])
    got = next(iter(mirrored))["keypoints"][0, 0]
    assert got[1].tolist() == [16.0, 8.0, 2] and got[0, 2] == 0  # x = 0 of the crop mirrored onto its edge


def test_a_sample_without_instances_and_a_sharded_loader(tmp_path):
    rng = np.random.default_rng(7)
    data = [{"image": natural_image(rng, S, S, k), "label": 0, "keypoints": points_of(k) if k % 3 else []}
            for k in range(12)]
    report = gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1, shard_size="4KB")
    assert not report.skipped
    store = gpufeed.open(tmp_path / "s")
    assert len(store.manifest.shards) > 1 and store.field("keypoints", 0).shape == (0, K, 3)
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=[RandomResizedCrop(16)], fields=("keypoints",))
    counts = [int(c) for batch in loader for c in batch["keypoints_count"]]
    assert sorted(counts) == sorted(len(points_of(k)) if k % 3 else 0 for k in range(12))
