"""Masks: instance masks and label maps packed as runs, moved into the stored image's frame, then
through each batch's crops, flips and warps as torchvision.transforms.v2 resamples with
NEAREST_EXACT, dropped with their boxes, a label map's fill where the image takes one; damaged runs
refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode as IM
from torchvision.transforms.v2 import functional as F

import gpufeed
from conftest import boxes_of, skipped_after
from gpufeed.augment import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, RandomRotation, Resize
from gpufeed.store import StoreError
from gpufeed.synth import natural_image

S = 32


def instances_of(k: int, h: int = S, w: int = S) -> np.ndarray:
    """Sample k's (instances, h, w) 0/1 masks: k % 3 + 1 rectangles and discs, some overlapping."""
    rng = np.random.default_rng(k)
    yy, xx = np.mgrid[:h, :w]
    out = []
    for j in range(k % 3 + 1):
        cx, cy, r = rng.uniform(4, w - 4), rng.uniform(4, h - 4), rng.uniform(3, 9)
        disc = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
        out.append(disc if j % 2 else (abs(xx - cx) < r) & (abs(yy - cy) < r / 2))
    return np.stack(out).astype(np.uint8)


def label_map_of(k: int) -> np.ndarray:
    """Sample k's (h, w) label map: classes 0..5 in blobs, as a segmentation's."""
    m = instances_of(k)
    return (m * np.arange(1, len(m) + 1)[:, None, None]).max(0).astype(np.uint8) + (k % 2)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("masks")
    inst = [{"image": natural_image(rng, S, S, k), "label": k % 2, "masks": instances_of(k),
             "boxes": boxes_of(instances_of(k)), "id": k} for k in range(16)]
    sem = [{"image": natural_image(rng, S, S, k), "label": k % 2, "masks": torch.from_numpy(label_map_of(k)),
            "id": k} for k in range(16)]
    gpufeed.pack(inst, root / "inst", size=S, progress=False, workers=1)
    gpufeed.pack(sem, root / "sem", size=S, progress=False, workers=1)
    return gpufeed.open(root / "inst"), gpufeed.open(root / "sem")


def reference(mask: np.ndarray, params, k: int) -> np.ndarray:
    """torchvision v2 with sample k's crop and mirror, NEAREST_EXACT: on a plain tensor, since v2
    resizes a Mask with NEAREST whatever it is asked (half a pixel off the image beside it)."""
    m = torch.from_numpy(mask if mask.ndim == 3 else mask[None])
    x1, y1, x2, y2 = params.boxes[k].double().tolist()
    m = F.resized_crop(m, round(y1), round(x1), round(y2 - y1), round(x2 - x1), list(params.out_hw),
                       interpolation=IM.NEAREST_EXACT)
    if params.flip[k]:
        m = F.horizontal_flip(m)
    return m.numpy() if mask.ndim == 3 else m[0].numpy()


def test_packed_masks_come_back_as_given(stores):
    from gpufeed.store.summary import describe

    inst, sem = stores
    assert "masks (instance masks)" in describe(inst) and "masks (u1 label maps)" in describe(sem)
    assert inst.fields["masks"] == {"kind": "masks", "instances": True, "dtype": "|u1"}
    assert sem.fields["masks"] == {"kind": "masks", "instances": False, "dtype": "|u1"}
    for k in range(16):
        assert np.array_equal(inst.field("masks", k), instances_of(k))
        assert np.array_equal(sem.field("masks", k), label_map_of(k))


@pytest.mark.parametrize("which", [0, 1])
def test_masks_follow_crops_and_mirrors_exactly_as_torchvision_nearest_exact(stores, which):
    store = stores[which]
    ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip()]
    loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=2, fields=("masks", "id"))
    checked = mirrored = 0
    for number, batch in enumerate(loader):
        _, params = loader.plan(0, number)
        for k, i in enumerate(batch["id"].tolist()):
            want = reference(store.field("masks", i), params, k)
            if which == 0:
                count = int(batch["masks_count"][k])
                assert batch["masks"].dtype == torch.uint8 and count == len(want)
                assert np.array_equal(batch["masks"][k, :count].numpy(), want), (i, k)
                assert not batch["masks"][k, count:].any()
            else:
                assert batch["masks"].shape == (8, 24, 24) and "masks_count" not in batch
                assert np.array_equal(batch["masks"][k].numpy(), want), (i, k)
            checked += 1
            mirrored += bool(params.flip[k])
    assert checked == 16 and mirrored


def test_a_label_map_follows_a_rotation_with_its_own_fill(stores):
    """torchvision rotates a Mask with NEAREST about the same centre; where the image takes the fill,
    the label map takes `mask_fill` (an ignore index)."""
    _, sem = stores
    ops = [Resize((S, S)), RandomRotation(30)]
    loader = gpufeed.Loader(sem, batch_size=8, device="cpu", augment=ops, seed=4, shuffle=False,
                            fields=("masks",), mask_fill=255)
    batch = next(iter(loader))
    indices, params = loader.plan(0, 0)
    angles = torch.empty(8, dtype=torch.float64).uniform_(-30, 30, generator=torch.Generator().manual_seed(
        hash((4, 0, 0)) & (2**63 - 1)))
    agree = total = filled = 0
    for k in range(8):
        want = F.rotate(tv_tensors.Mask(torch.from_numpy(sem.field("masks", int(indices[k])))), float(angles[k]),
                        IM.NEAREST, fill=255).as_subclass(torch.Tensor).numpy()
        got = batch["masks"][k].numpy()
        agree += int((got == want).sum())
        total += got.size
        filled += int((got == 255).sum())
    # float64 here, float32 in torchvision's grid: a rounding tie may fall the other way
    assert agree / total > 0.995 and filled > 0


def test_instance_masks_are_dropped_with_their_boxes(tmp_path):
    rng = np.random.default_rng(1)
    near, far = np.zeros((S, S), np.uint8), np.zeros((S, S), np.uint8)
    near[10:20, 10:20], far[27:31, 27:31] = 1, 1
    data = [{"image": natural_image(rng, S, S, 0), "label": 0, "masks": [near, far],
             "boxes": [[10, 10, 20, 20], [27, 27, 31, 31]]}]
    gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1)
    loader = gpufeed.Loader(tmp_path / "s", batch_size=1, device="cpu", augment=[CenterCrop(16)], shuffle=False,
                            fields=("boxes", "masks"))
    batch = next(iter(loader))
    assert int(batch["boxes_count"][0]) == 1 and int(batch["masks_count"][0]) == 1
    assert batch["masks"].shape == (1, 1, 16, 16) and np.array_equal(batch["masks"][0, 0].numpy(), near[8:24, 8:24])
    alone = gpufeed.Loader(tmp_path / "s", batch_size=1, device="cpu", augment=[CenterCrop(16)], shuffle=False,
                           fields=("masks",))
    masks = next(iter(alone))["masks"][0]  # without boxes asked for: both, the far one empty
    assert masks.shape == (2, 16, 16) and not masks[1].any()


def test_packing_moves_masks_into_the_stored_frame(tmp_path):
    """A raw store center-crops 32x64 to 32x32 and halves it; a jpeg store with max_side halves it."""
    rng = np.random.default_rng(2)
    label = np.zeros((32, 64), np.int16)
    label[:, 16:48] = np.arange(32)[None, :] * 10 - 100  # x - 16 in the crop, negative values: int16
    data = [{"image": natural_image(rng, 32, 64, 0), "label": 0, "masks": label}]
    gpufeed.pack(data, tmp_path / "raw", size=16, progress=False, workers=1)
    got = gpufeed.open(tmp_path / "raw").field("masks", 0)
    assert got.dtype == np.int16 and got.shape == (16, 16)
    assert np.array_equal(got, np.broadcast_to(np.arange(1, 32, 2) * 10 - 100, (16, 16)))  # each pixel's centre
    gpufeed.pack(data, tmp_path / "jpeg", mode="jpeg", max_side=32, progress=False, workers=1)
    store = gpufeed.open(tmp_path / "jpeg")
    got = store.field("masks", 0)
    assert got.shape == tuple(store.shapes[0]) == (16, 32) and np.array_equal(got, label[1::2, 1::2])


@pytest.mark.parametrize("bad, why", [
    (np.zeros((S, S - 1), np.uint8), "masks of 32x31 pixels for an image of 32x32"),
    (np.full((1, S, S), 2, np.uint8), "values other than 0 and 1"),
    (np.zeros((S, S), np.float32), "masks of float32"),
    ("road", "masks of"),
])
def test_malformed_masks_skip_their_sample_with_the_reason(tmp_path, bad, why):
    reason = skipped_after(tmp_path, "masks", instances_of(0), bad, seed=3, side=S)
    assert "field 'masks'" in reason and why in reason, reason


def test_a_label_map_after_instance_masks_is_skipped(tmp_path):
    reason = skipped_after(tmp_path, "masks", instances_of(0), label_map_of(1), seed=4, side=S)
    assert "is a label map, the first sample's is instance masks" in reason


def test_mask_fill_is_checked(stores):
    inst, sem = stores
    with pytest.raises(ValueError, match="mask_fill=256 is not an int a |u1 label map holds"):
        gpufeed.Loader(sem, batch_size=8, device="cpu", fields=("masks",), mask_fill=256)
    with pytest.raises(ValueError, match="mask_fill is for fields"):
        gpufeed.Loader(sem, batch_size=8, device="cpu", fields=("label",), mask_fill=255)


def test_damaged_runs_and_manifests_are_refused_by_name(stores, tmp_path):
    inst, _ = stores
    copy = tmp_path / "runs"
    shutil.copytree(inst.path, copy)
    data = np.fromfile(copy / "field.masks.bin", "<i4")
    offsets = np.fromfile(copy / "field.masks.i64", "<i8")
    first_end = 3 + int(data[0])  # sample 0's first run end
    data[first_end] = 10**6  # past the image
    data.tofile(copy / "field.masks.bin")
    damaged = gpufeed.open(copy)  # (open checks sizes; `gpufeed verify` would find the digest differs)
    with pytest.raises(StoreError, match=r"field.masks.bin: field 'masks' of sample 0: masks whose runs"):
        damaged.field("masks", 0)
    loader = gpufeed.Loader(damaged, batch_size=4, device="cpu", augment=[CenterCrop(16)], shuffle=False,
                            fields=("masks",))
    with pytest.raises(StoreError, match="sample 0"):
        next(iter(loader))
    assert offsets[1] > 0
    for spec in ({"kind": "masks", "instances": "yes", "dtype": "|u1"}, {"kind": "masks", "instances": True,
                                                                          "dtype": "<i2"},
                 {"kind": "masks", "instances": False, "dtype": "<f4"}):
        bad = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(inst.path, bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["fields"]["masks"] = spec
        (bad / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(StoreError):
            gpufeed.open(bad)


def test_a_sharded_store_keeps_its_masks(stores, tmp_path):
    inst, _ = stores
    data = [{"image": inst[i][0].permute(1, 2, 0).numpy(), "label": 0, "masks": inst.field("masks", i), "id": i}
            for i in range(12)]
    gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1, shard_size="4KB")
    sharded = gpufeed.open(tmp_path / "s")
    assert sharded.fields["masks"]["instances"]
    batch = next(iter(gpufeed.Loader(sharded, batch_size=12, device="cpu", shuffle=False, fields=("masks", "id"))))
    for k, i in enumerate(batch["id"].tolist()):
        want = inst.field("masks", i)
        assert np.array_equal(batch["masks"][k, : len(want)].numpy(), want)


KERNEL_CHECK = """
import numpy as np, torch, gpufeed
from gpufeed.augment import (RandomAffine, RandomResizedCrop, RandomHorizontalFlip, RandomRotation,
                             RandomVerticalFlip)
from gpufeed.augment import fused_masks, masks as M
store = gpufeed.open({path!r})
instances = store.fields["masks"]["instances"]
ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip(), RandomVerticalFlip(), RandomRotation(30, fill=3),
       RandomAffine(0, translate=(0.2, 0.2), fill=3)]
loader = gpufeed.Loader(store, batch_size=8, device="cpu", augment=ops, seed=1, fields=("masks",), mask_fill=7)
indices, params = loader.plan(0, 0)
assert len(params.warp.sizes) == 2  # the box pass's output, and the image the affine op read
runs = [store.column("masks").runs(int(i)) for i in indices]
for geometry in (params, None):  # located in the kernel; or stored_pixels' (no augment ran)
    want, counts = M.transform_masks(runs, geometry, torch.device("cpu"), instances, torch.uint8, 7)
    hw = np.array([[r.h, r.w] for r in runs])
    got = torch.full((len(runs), want.shape[1] if instances else 1, *want.shape[-2:]), 99, dtype=torch.uint8)
    M._in_kernel(fused_masks, runs, counts.numpy(), geometry, hw, got, 0 if instances else 7)
    assert torch.equal(got if instances else got[:, 0], want), geometry is None
    assert instances or geometry is None or (want == 7).any()
print("same")
"""


@pytest.mark.parametrize("which", [0, 1])
def test_the_gpu_kernel_gives_the_torch_paths_masks(stores, which):
    """The Triton kernel the GPU runs (`augment.fused_masks`), under Triton's interpreter on the CPU,
    against the torch ops of the CPU path, through crops, flips and rotations with a fill."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = KERNEL_CHECK.format(path=str(stores[which].path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    if done.stdout.strip() != "same" and _INTERPRETER_LOOP_BUG in done.stderr:
        pytest.skip("Triton's interpreter can't run a loop to a runtime bound here (int() of a 1-element array: "
                    "numpy >= 2.5 refuses it, Triton 3.6 asks it); tests/cuda runs the kernel itself")
    assert done.stdout.strip() == "same", done.stderr[-2000:]


# what Triton 3.6's interpreter raises under numpy 2.5 at `for j in range(0, slots)` (the GPU host's stack)
_INTERPRETER_LOOP_BUG = "TypeError('only 0-dimensional arrays can be converted to Python scalars')"


def test_masks_made_in_groups_of_samples_are_the_same(stores, monkeypatch):
    """A batch's samples go in groups that bound the memory on the way: groups of one give the same."""
    from gpufeed.augment import masks as M

    inst, _ = stores
    ops = [RandomResizedCrop(24, scale=(0.3, 1)), RandomHorizontalFlip(), RandomRotation(20)]
    kw = dict(batch_size=8, device="cpu", augment=ops, seed=5, fields=("masks",), shuffle=False)
    whole = [b["masks"] for b in gpufeed.Loader(inst, **kw)]
    monkeypatch.setattr(M, "_PIXELS", 24 * 24)  # one sample a group
    grouped = [b["masks"] for b in gpufeed.Loader(inst, **kw)]
    assert all(torch.equal(a, b) for a, b in zip(whole, grouped, strict=True)) and whole[0].any()


def test_a_label_maps_fill_is_where_its_image_takes_the_fill_through_two_filling_ops(tmp_path):
    """Each image an op that fills reads from is checked at the output pixel's own centre: with a
    rotation and a translation both filling, the mask's fill lands where the image's does."""
    from gpufeed.augment import RandomAffine

    rng = np.random.default_rng(3)
    data = [{"image": rng.integers(60, 200, (S, S, 3), dtype=np.uint8), "label": 0,
             "masks": np.ones((S, S), np.uint8)} for _ in range(8)]
    gpufeed.pack(data, tmp_path / "s", size=S, progress=False, workers=1)
    ops = [RandomResizedCrop(24, scale=(0.5, 1)), RandomRotation(40, fill=0),
           RandomAffine(0, translate=(0.3, 0.3), fill=0)]
    batch = next(iter(gpufeed.Loader(tmp_path / "s", batch_size=8, device="cpu", augment=ops, dtype=torch.uint8,
                                     seed=4, fields=("image", "masks"), mask_fill=255)))
    filled = (batch["image"] == 0).all(1)
    assert filled.float().mean() > 0.1
    assert (filled != (batch["masks"] == 255)).float().mean() < 0.01
