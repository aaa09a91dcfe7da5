"""gpufeed in the frameworks users train with: a fresh pass per iter() for evaluation, the
StatefulDataLoader-style state_dict protocol, and the Lightning example on tiny data on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import gpufeed
from conftest import save, smooth
from gpufeed.augment import CenterCrop, RandomResizedCrop, Resize

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks")
    sizes = [(40, 48), (56, 40), (48, 48)]
    for split, per_class in (("train", 6), ("val", 3)):
        for c in range(2):
            for i in range(per_class):
                save(root / split / f"c{c}" / f"{i}.jpg", smooth(i + 10 * c, *sizes[i % 3]), quality=95)
    gpufeed.pack(root / "train", root / "train-raw", size=40, workers=1, progress=False)
    gpufeed.pack(root / "val", root / "val-jpeg", mode="jpeg", workers=1, progress=False)
    return root / "train-raw", root / "val-jpeg"


def _example(name: str):
    """Import examples/NAME.py as a module (the examples folder is no package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _labels(batches) -> list[int]:
    return [int(y) for _, labels in batches for y in labels]


def test_restart_gives_a_fresh_pass_on_every_iter(stores):
    ops = [Resize(36), CenterCrop(32)]
    val = gpufeed.Loader(stores[1], batch_size=2, device="cpu", shuffle=False, drop_last=False, augment=ops,
                         restart=True)
    full = _labels(val)
    assert len(full) == 6
    it = iter(val)
    next(it)  # a sanity check: two batches, then the pass is dropped
    next(it)
    del it
    assert _labels(val) == full  # from the first batch again


def test_an_iter_after_a_break_begins_the_next_epoch_as_a_dataloader_does(stores):
    """Without restart, a `for` loop after a `break` is a new pass over the next epoch (it used to
    continue the epoch left, unlike a DataLoader); a load_state_dict still resumes mid-epoch."""
    make = lambda: gpufeed.Loader(stores[0], batch_size=2, device="cpu", seed=4,  # noqa: E731
                                  augment=[RandomResizedCrop(16)])
    loader = make()
    for _ in loader:
        state = loader.state_dict()
        break
    assert (state["epoch"], state["batch"]) == (0, 1)
    second = list(loader)
    assert len(second) == len(loader) == 6 and loader.epoch == 2  # all of epoch 1, then on to epoch 2
    reference = make()
    reference.set_epoch(1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(second, list(reference), strict=True))
    resumed = make()
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 5  # the rest of epoch 0


def test_state_dict_mid_pass_resumes_even_with_restart(stores):
    """torchdata StatefulDataLoader's protocol: state_dict() during a pass, load_state_dict() into a
    new loader, and its next pass continues after the last batch yielded."""
    make = lambda: gpufeed.Loader(stores[0], batch_size=2, device="cpu", seed=4, restart=True,  # noqa: E731
                                  augment=[RandomResizedCrop(16)])
    first = make()
    it = iter(first)
    seen = [next(it) for _ in range(2)]
    state = first.state_dict()
    rest = list(it)
    second = make()
    second.load_state_dict(state)
    resumed = list(second)
    assert len(seen) + len(resumed) == len(first) == 6
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, resumed))


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="pytorch-lightning not installed")
def test_lightning_example_validates_every_sample_each_epoch(stores):
    lightning_train = _example("lightning_train")
    model, data = lightning_train.main(["--train", str(stores[0]), "--val", str(stores[1]), "--epochs", "2",
                                        "--batch-size", "2", "--size", "32", "--resize", "36",
                                        "--accelerator", "cpu", "--devices", "1"])
    # the sanity check took 2 of the 3 validation batches and dropped the pass; each real
    # validation epoch still saw all 6 samples
    assert model.val_seen == [6, 6]
    assert model.trainer.global_step == 2 * 6  # 12 training samples, batches of 2, 2 epochs


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm not installed")
def test_timm_example_trains_with_mixup_and_label_smoothing(stores):
    timm_train = _example("timm_train")
    out = timm_train.main(["--store", str(stores[0]), "--model", "resnet18", "--epochs", "2", "--batch-size", "4",
                           "--size", "32"])
    assert out["steps"] == 2 * 3 and all(torch.isfinite(torch.tensor(out["losses"])))
    targets = out["targets"]
    assert targets.shape == (4, 2) and torch.allclose(targets.sum(1), torch.ones(4))
    assert bool((targets > 0).all())  # label smoothing (and mixing): no class gets exactly 0


def test_distributed_evaluation_sees_every_sample_once(stores):
    """pad=False: the ranks' shards together are exactly the store (no sample counted twice)."""
    ops = [Resize(36), CenterCrop(32)]
    per_rank = [gpufeed.Loader(stores[1], batch_size=4, device="cpu", shuffle=False, drop_last=False, augment=ops,
                               rank=r, world_size=4, pad=False) for r in range(4)]
    seen = sorted(int(i) for loader in per_rank for b in range(len(loader)) for i in loader.plan(0, b)[0])
    assert seen == list(range(6)) and [len(loader) for loader in per_rank] == [1, 1, 1, 1]
    assert sum(len(labels) for loader in per_rank for _, labels in loader) == 6
    padded = gpufeed.Loader(stores[1], batch_size=4, device="cpu", shuffle=False, drop_last=False, augment=ops,
                            rank=3, world_size=4)
    assert len(next(iter(padded))[1]) == 2  # padded by wrapping: ranks 2 and 3 repeat samples
