"""Batches by aspect ratio (`Loader(group_by_aspect=...)`): images resized at their own aspect ratio
(`Resize(size, max_size=)`, torchvision's sizes), batches of one aspect group where the epoch allows,
each padded with zeros to one shape, a multiple of `size_divisible`; boxes and masks follow; the
order deterministic, every sample once over any number of ranks, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import InterpolationMode as IM
from torchvision.transforms.v2 import functional as F

import gpufeed
from conftest import boxes_of, smooth
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomRotation, Resize
from gpufeed.loader.sampler import Segment, ShardedBatchSampler
from loader_checks import check_resume

# (h, w): landscape, portrait, square and two long ones, each downscaled less than 2x by OPS (no DCT
# reduction in the decoder, so torchvision's resize of the decoded image is the reference)
SIZES = [(48, 64), (64, 48), (56, 56), (40, 80), (80, 36)]
OPS = [Resize(40, max_size=60), RandomHorizontalFlip()]


def masks_of(k: int, h: int, w: int) -> np.ndarray:
    """Sample k's 1-3 rectangles as instance masks."""
    rng = np.random.default_rng(k)
    out = np.zeros((k % 3 + 1, h, w), np.uint8)
    for m in out:
        y, x = int(rng.integers(0, h - 12)), int(rng.integers(0, w - 12))
        m[y : y + int(rng.integers(6, 12)), x : x + int(rng.integers(6, 12))] = 1
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("aspect")
    samples = []
    for k in range(40):
        h, w = SIZES[k % len(SIZES)]
        masks = masks_of(k, h, w)
        samples.append({"image": smooth(k, h, w), "label": k % 4, "masks": masks, "boxes": boxes_of(masks)})
    gpufeed.pack(samples, root / "s", mode="jpeg", quality=95, workers=1, progress=False)
    return gpufeed.open(root / "s")


def loader(store, **kw):
    args = dict(batch_size=6, device="cpu", augment=OPS, dtype=torch.float32, group_by_aspect=True, seed=3)
    return gpufeed.Loader(store, **(args | kw))


def test_resize_max_size_gives_torchvisions_sizes():
    from gpufeed.augment.view import View

    for h, w in [(480, 640), (640, 480), (500, 1500), (1500, 500), (333, 333), (100, 1001)]:
        want = F.resize(torch.zeros(1, h, w), [800], max_size=1333).shape[1:]
        one = Resize(800, max_size=1333)(
            View(torch.tensor([[0.0, 0, w, h]], dtype=torch.float64), torch.zeros(1, dtype=torch.bool), h, w), None
        )
        several = Resize(800, max_size=1333)(
            View(
                torch.tensor([[0.0, 0, w, h]] * 2, dtype=torch.float64),
                torch.zeros(2, dtype=torch.bool),
                torch.tensor([h, 7]),
                torch.tensor([w, 9]),
            ),
            None,
        )
        assert (one.height, one.width) == tuple(want)
        assert (int(several.height[0]), int(several.width[0])) == tuple(want)
    with pytest.raises(ValueError, match="strictly greater"):
        Resize(800, max_size=800)
    with pytest.raises(ValueError, match="int size"):
        Resize((800, 600), max_size=1333)


def test_batches_are_padded_images_at_their_own_aspect_ratio(store):
    """Each image is torchvision's resize of it (sizes exact, pixels to JPEG-and-filter tolerance),
    mirrored where planned, at the top left of a zero-padded batch of one shape, a multiple of 32."""
    mean, std = (0.5,) * 3, (0.25,) * 3
    lo = loader(store, augment=[*OPS, Normalize(mean, std)], fields=("image", "label", "boxes", "masks"))
    shapes = set()
    for number, batch in enumerate(lo):
        images, sizes = batch["image"], batch["image_size"]
        idx, params = lo.plan(0, number)
        assert images.shape[2] % 32 == 0 and images.shape[3] % 32 == 0
        assert images.shape[2:] == (32 * -(-int(sizes[:, 0].max()) // 32), 32 * -(-int(sizes[:, 1].max()) // 32))
        shapes.add(tuple(images.shape[2:]))
        for k, i in enumerate(idx.tolist()):
            image = store[i][0].float()
            rh, rw = F.resize(image, [40], max_size=60).shape[1:]
            assert sizes[k].tolist() == [rh, rw]
            ref = F.resize(image, [rh, rw], antialias=True)
            ref = ref.flip(-1) if params.flip[k] else ref
            got = images[k, :, :rh, :rw] * 0.25 * 255 + 0.5 * 255
            assert (got - ref).abs().mean() < 4.0, (number, k)
            assert not images[k, :, rh:].any() and not images[k, :, :, rw:].any()  # zeros, after Normalize
            # boxes and masks scaled (and mirrored) the same way, the masks 0 in the padding
            h, w = image.shape[1:]
            stored = store.column("boxes").rows(np.array([i]))[0]
            want = stored * np.array([rw / w, rh / h, rw / w, rh / h])
            if params.flip[k]:
                want = np.stack([rw - want[:, 2], want[:, 1], rw - want[:, 0], want[:, 3]], 1)
            count = int(batch["boxes_count"][k])
            assert count == len(stored)
            assert np.allclose(batch["boxes"][k, :count].numpy(), want, atol=1e-3)
            masks = batch["masks"][k, :count]
            assert masks.shape[1:] == images.shape[2:] and not masks[:, rh:].any() and not masks[:, :, rw:].any()
            ref_m = F.resize(torch.from_numpy(masks_of(i, h, w)), [rh, rw], interpolation=IM.NEAREST_EXACT)
            ref_m = ref_m.flip(-1) if params.flip[k] else ref_m
            assert (masks[:, :rh, :rw] != ref_m).float().mean() < 0.02, (number, k)
    assert len(shapes) > 1  # (this store's aspect ratios give batches of several shapes)


def test_batches_keep_to_one_aspect_group_where_the_epoch_allows(store):
    """Groups of 5 aspect ratios over 40 samples, batches of 6 on one rank: per group one batch (the
    group's 8 samples fill one batch, 2 are left over), then the leftovers: at least 5 of the 7
    batches pure. Without grouping, batches of random samples mix groups."""
    from gpufeed.loader.loader import aspect_groups

    groups = aspect_groups(torch.tensor([SIZES[k % 5] for k in range(40)]), 40, True)
    grouped = loader(store, drop_last=False)
    pure = 0
    for number in range(len(grouped)):
        idx, _ = grouped.plan(0, number)
        pure += len(set(groups[idx.numpy()].tolist())) == 1
    assert pure >= 5 and len(grouped) == 7
    assert sorted(torch.cat([grouped.plan(0, b)[0] for b in range(7)]).tolist()) == list(range(40))


def test_grouping_is_a_pure_function_of_seed_and_epoch_and_shards_every_sample_once():
    groups = np.random.default_rng(0).integers(0, 3, 103)

    def batches(rank, world, epoch=0, **kw):
        s = ShardedBatchSampler(
            103, 8, shuffle=True, seed=1, rank=rank, world_size=world, drop_last=False, pad=False, groups=groups, **kw
        )
        return s, [b.tolist() for b in s.batches(epoch)]

    for world in (1, 2, 3):
        seen = [i for r in range(world) for b in batches(r, world)[1] for i in b]
        assert sorted(seen) == list(range(103))
        for r in range(world):
            got = batches(r, world)[1]
            assert got == batches(r, world)[1]  # deterministic
            assert all(len(set(groups[b])) == 1 for b in got[:-3])  # pure but for a span's last batches
    assert batches(0, 1, epoch=1)[1] != batches(0, 1)[1]
    # a job stopped after 4 batches at world size 2 and resumed at 3 covers exactly the rest, once
    done = [i for r in range(2) for b in batches(r, 2)[1][:4] for i in b]
    rest = []
    for r in range(3):
        s, _ = batches(r, 3)
        s.resume(0, (Segment(2, 4),))
        rest += [i for b in s.batches(0) for i in b.tolist()]
    assert sorted(done + rest) == list(range(103))


def test_resume_yields_exactly_the_rest(store):
    check_resume(lambda: loader(store, augment=OPS[:1]), [0, 2, 5])


def test_group_by_aspect_refuses_what_it_cannot_pad(store):
    with pytest.raises(ValueError, match="need images of one size"):
        loader(store, augment=[*OPS, RandomRotation(10)])
    with pytest.raises(ValueError, match="not rotations"):
        loader(store, augment=[Resize((40, 40)), RandomRotation(10)])
    with pytest.raises(ValueError, match="group_by_aspect must be"):
        loader(store, group_by_aspect=-1)
    with pytest.raises(ValueError, match="different sizes.*group_by_aspect"):
        gpufeed.Loader(store, batch_size=6, device="cpu", augment=OPS)
    # a state from a loader grouped otherwise is refused (the order differs)
    a = loader(store)
    state = a.state_dict()
    b = loader(store, group_by_aspect=0)
    with pytest.raises(ValueError):
        b.load_state_dict(state)


def test_a_raw_store_padded_gives_the_unpadded_pixels(tmp_path):
    """One image size (a raw store): every batch one shape, the images exactly those of the same ops
    without padding, then zeros to the multiple."""
    from loader_checks import make_store

    raw = make_store(tmp_path, n=24, side=30)
    ops = [Resize(21), RandomHorizontalFlip()]
    kw = dict(batch_size=8, device="cpu", dtype=torch.float32, seed=2)
    for (plain, _), padded in zip(
        gpufeed.Loader(raw, augment=ops, **kw),
        gpufeed.Loader(raw, augment=ops, group_by_aspect=True, size_divisible=8, fields=("image",), **kw),
        strict=True,
    ):
        assert plain.shape[2:] == (21, 21) and padded["image"].shape[2:] == (24, 24)
        assert padded["image_size"].tolist() == [[21, 21]] * 8
        assert torch.allclose(padded["image"][:, :, :21, :21], plain, atol=1e-4)
        assert not padded["image"][:, :, 21:].any() and not padded["image"][:, :, :, 21:].any()
