"""The Loader's edges from issue 63: one pass at a time (two threads), every field of a state checked
and the store it was saved on kept, seeds and epochs in defined ranges with an order each, and full
batches with drop_last=True whether shuffled or not."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.augment import MixUp, Normalize, RandomResizedCrop
from gpufeed.synth import natural_image
from loader_checks import make_store

OPS = [RandomResizedCrop(16, scale=(0.5, 1)), Normalize()]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("edges"), n=40, side=16)


def _loader(store, **kw):
    return gpufeed.Loader(store, **{"batch_size": 4, "device": "cpu", "seed": 3, **kw})


# 7: one pass at a time


def test_a_second_thread_iterating_a_loader_is_refused_and_the_first_pass_is_whole(store):
    """Two threads iterating one Loader got the same batches twice (24 of 104), then a KeyError."""
    loader = _loader(store)
    took, go, seen, errors = threading.Event(), threading.Event(), [], []

    def first():
        try:
            it = iter(loader)
            seen.append(next(it))
            took.set()
            go.wait(60)
            seen.extend(it)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)
            took.set()

    thread = threading.Thread(target=first)
    thread.start()
    assert took.wait(60)
    try:
        with pytest.raises(RuntimeError, match="being iterated by thread"):
            iter(loader)
    finally:
        go.set()
        thread.join(60)
    assert not errors and len(seen) == len(loader) == 10
    indices = [i for b in range(len(loader)) for i in loader.plan(0, b)[0].tolist()]
    assert sorted(indices) == list(range(40))  # the pass the first thread made: each sample once
    assert torch.equal(torch.cat([labels for _, labels in seen]), loader.store.labels[indices])
    assert len(list(loader)) == 10 and loader.epoch == 2  # that thread ended: a pass here is epoch 1's


def test_a_new_iter_ends_the_pass_before_it_which_then_says_so(store):
    loader = _loader(store)
    old = iter(loader)
    next(old)
    new = list(loader)  # the next epoch, whole (a DataLoader's new iterator ends the one before)
    assert len(new) == 10 and loader.epoch == 2
    with pytest.raises(RuntimeError, match="ended by a newer iter"):
        next(old)
    assert not [t for t in threading.enumerate() if t.name == "gpufeed-producer" and t.is_alive()]


# 8: every field of a state checked, and the store it was saved on


@pytest.mark.parametrize(
    "segments",
    [[[0, 5]], [[-1, 2]], [[10**12, 1]], [[1, -5]], [[1.5, 2]], [[2, 0]], [[2, 6]], [[True, 1]], [[1]], [[1, 2, 3]],
     "1,2", [[2, 1], [41, 1]]],
    ids=str,
)
def test_segments_no_job_could_have_left_are_refused_and_nothing_changes(store, segments):
    """[[0, 5]] and [[-1, 2]] were a torch.cat error, [[10**12, 1]] memory grown until the OOM killer,
    [[1, -5]] accepted (8 samples came where 91 should), [[1.5, 2]] silently truncated."""
    loader = _loader(store, rank=1, world_size=2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"segments"):
        loader.load_state_dict({**state, "segments": segments})
    assert loader.state_dict() == state and len(list(loader)) == 5  # untouched: epoch 0, whole


def test_the_segments_a_job_leaves_are_accepted(store):
    first = _loader(store, rank=0, world_size=3, drop_last=False, pad=False)
    it = iter(first)
    next(it)
    state = first.state_dict()
    assert state["world_size"] == 3 and state["batch"] == 1
    resumed = _loader(store, rank=0, world_size=2, drop_last=False, pad=False)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["segments"] == [[3, 1]]
    again = _loader(store, rank=0, world_size=2, drop_last=False, pad=False)
    again.load_state_dict(resumed.state_dict())  # a segment as state_dict writes it
    assert len(list(again)) == len(list(resumed))


@pytest.mark.parametrize(
    "field, value, why",
    [("epoch", "1", "epoch='1'"), ("epoch", True, "epoch=True"), ("epoch", 2**64, "epoch"),
     ("batch", 1.0, "batch=1.0"), ("batch", None, "batch=None"), ("world_size", 2.0, "world_size=2.0"),
     ("seed", "3", "seed='3'"), ("seed", None, "seed=None"), ("seed", True, "seed=True"),
     ("batch_size", True, "batch_size=True"), ("batch_size", "4", "batch_size='4'"), ("samples", -1, "samples=-1"),
     ("samples", 40.0, "samples=40.0"), ("store", 5, "store=5"), ("store", "0" * 64, "another store")],
)
def test_every_field_of_a_state_is_checked(store, field, value, why):
    loader = _loader(store)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=why):
        loader.load_state_dict({**state, field: value})
    assert loader.state_dict() == state


def test_a_state_of_a_store_packed_again_is_refused_and_one_without_the_digest_is_checked_as_before(store, tmp_path):
    """A resume after the store was repacked with the same count was accepted and went on over other
    images; the state keeps the store's digest."""
    gpufeed.pack(store.path.parent / "src", tmp_path / "again", size=12, workers=1, progress=False)
    assert len(gpufeed.open(tmp_path / "again")) == len(store)
    loader = _loader(store)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["store"] == store.digest and len(state["store"]) == 64
    with pytest.raises(ValueError, match="another store, or this one packed again"):
        _loader(tmp_path / "again").load_state_dict(state)
    shutil.copytree(store.path, tmp_path / "copy")  # the same store elsewhere: the same digest
    copy = _loader(tmp_path / "copy")
    copy.load_state_dict(state)
    assert len(list(copy)) == 9
    older = {k: v for k, v in state.items() if k != "store"}  # saved before the digest was kept: as before
    _loader(tmp_path / "again").load_state_dict(older)
    with pytest.raises(ValueError, match="samples"):
        _loader(store, batch_size=4).load_state_dict({**older, "samples": 41})


def test_a_folder_read_in_place_keeps_its_identity_in_the_state(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    for k in range(6):
        Image.fromarray(natural_image(rng, 24, 28, k)).save(tmp_path / "images" / f"{k}.jpg")
    make = lambda: gpufeed.Loader(tmp_path / "images", batch_size=2, device="cpu", augment=OPS,  # noqa: E731
                                  num_workers=0, seed=1)
    loader = make()
    state = loader.state_dict()
    make().load_state_dict(state)  # the same images
    (tmp_path / "images" / "0.jpg").rename(tmp_path / "images" / "9.jpg")
    with pytest.raises(ValueError, match="another store"):
        make().load_state_dict(state)


def _drawn(entry) -> bool:
    """The order key's entry saying how a shuffled order is drawn (`loader.ORDER_RANDOM`)."""
    return isinstance(entry, dict) and "order_random" in entry


def test_a_state_saved_before_philox_orders_resumes_only_at_an_epochs_start(store):
    loader = _loader(store)
    it = iter(loader)
    next(it)
    old = {k: v for k, v in loader.state_dict().items() if k != "store"}
    old["order"] = [k for k in old["order"] if not _drawn(k)]
    with pytest.raises(ValueError, match="older gpufeed"):
        _loader(store).load_state_dict(old)  # its epoch's rest would be of another order
    resumed = _loader(store)
    resumed.load_state_dict({**old, "epoch": 1, "batch": 0})
    assert resumed.epoch == 1 and len(list(resumed)) == 10
    unshuffled = _loader(store, shuffle=False)
    assert not any(_drawn(k) for k in unshuffled.state_dict()["order"])  # an order that draws nothing: no change


# 9: seeds and epochs


@pytest.mark.parametrize("seed", ["7", None, 7.0, True, -1, 2**64, 2**70])
def test_a_seed_out_of_range_is_refused_by_the_constructor(store, seed):
    """"7" and None were accepted and failed at iteration; 2**64 and above overflowed; -1 was 2**64 - 1."""
    with pytest.raises(ValueError, match=r"seed must be an int in 0\.\.2\*\*64 - 1"):
        _loader(store, seed=seed)


def test_seeds_and_epochs_of_the_whole_range_each_have_an_order(store):
    """torch's CPU generator keeps the low 32 bits of its seed: seed 2**63 was seed 0's order, -1 was
    2**64 - 1's (and 2**32 - 1's), epochs 2**32 and 2**40 epoch 0's."""
    order = lambda seed, epoch: _loader(store, seed=seed).batch_sampler.order(epoch).tolist()  # noqa: E731
    orders = [order(0, 0), order(2**63, 0), order(2**32, 0), order(2**64 - 1, 0), order(2**32 - 1, 0),
              order(0, 2**32), order(0, 2**40), order(0, 2**64 - 1), order(1, 0), order(0, 1)]
    assert all(sorted(o) == list(range(40)) for o in orders)
    assert len({tuple(o) for o in orders}) == len(orders)
    assert order(np.int64(5), 3) == order(5, 3)  # an integer type is its int


def test_set_epoch_checks_its_range_and_a_state_of_any_epoch_in_it_loads(store):
    """set_epoch(-1) ran, and its checkpoint was refused on load."""
    loader = _loader(store)
    for bad in (-1, 2**64, "1", 1.0, None, True):
        with pytest.raises(ValueError, match="epoch must be an int in"):
            loader.set_epoch(bad)
    assert loader.epoch == 0
    loader.set_epoch(2**64 - 1)
    resumed = _loader(store)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epoch == 2**64 - 1 and len(list(resumed)) == 10
    with pytest.raises(ValueError, match="the next epoch must be an int in"):
        iter(resumed)  # none after the last


def test_mixup_draws_with_the_largest_seed(store):
    """The batch op's generator was seeded with (seed * 1_000_003 + epoch) * 1_000_033 + batch:
    past 2**64 for seeds from about 2**24, which overflowed at the first batch."""
    loader = _loader(store, seed=2**64 - 1, augment=[MixUp(num_classes=3)], dtype=torch.float32)
    images, targets = next(iter(loader))
    assert images.shape == (4, 3, 16, 16) and targets.shape == (4, 3)


# 17: drop_last=True keeps batches full, shuffled or not


def _damaged_jpeg_store(root):
    rng = np.random.default_rng(0)
    data = [{"image": natural_image(rng, 24 + k % 5, 28, k), "label": k % 3, "id": k} for k in range(16)]
    gpufeed.pack(data, root, mode="jpeg", progress=False, workers=1)
    store = gpufeed.open(root)
    for broken in (7, 12, 13, 14, 15):  # 7 alone in its batch; 12..15 a whole batch of four
        start, end = int(store.offsets[broken]), int(store.offsets[broken + 1])
        with open(store.path / "data.bin", "r+b") as f:
            f.seek(start)
            f.write(b"\0" * (end - start))
    return store


@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last_keeps_batches_full_when_samples_fail_to_decode_shuffled_or_not(tmp_path, shuffle):
    """Unshuffled, a batch with an undecodable sample came short (9 of 16): left out as in an evaluation
    pass. drop_last=True promises full batches: filled as training fills them (a failed sample becomes a
    copy of another of its batch; a batch none of whose samples decode, the samples after them)."""
    store = _damaged_jpeg_store(tmp_path / "s")
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=OPS, fields=("id", "label"), seed=1,
                            shuffle=shuffle, drop_last=True, num_workers=0)
    batches = list(loader)
    assert len(batches) == 4 and all(len(b["image"]) == len(b["id"]) == len(b["label"]) == 4 for b in batches)
    ids = [i for b in batches for i in b["id"].tolist()]
    assert not {7, 12, 13, 14, 15} & set(ids)  # each replaced by a sample that decodes
    assert all(int(label) == i % 3 for b in batches for i, label in zip(b["id"].tolist(), b["label"]))
    assert loader.skipped == [] and loader.evaluation is False
    evaluation = gpufeed.Loader(store, batch_size=4, device="cpu", augment=OPS, shuffle=shuffle, drop_last=False,
                                num_workers=0)
    assert sum(len(labels) for _, labels in evaluation) == 11 and len(evaluation.skipped) == 5  # left out, named
