"""Reusable checks for Loader properties, shared by the CPU and CUDA test suites."""

from __future__ import annotations

import numpy as np
import torch

import gpufeed
from conftest import save


def make_store(root, n=96, side=32, classes=3):
    """A raw store whose sample i has pixels (i * 7 + x + y) % 256 and label i % classes."""
    src = root / "src"
    for i in range(n):
        y, x = np.mgrid[0:side, 0:side]
        img = np.stack([(i * 7 + x + y) % 256, (i * 3 + x) % 256, (i + 2 * y) % 256], -1).astype(np.uint8)
        save(src / f"c{i % classes}" / f"{i:05d}.png", img)
    gpufeed.pack(src, root / "store", size=side, workers=2, progress=False)
    return gpufeed.open(root / "store")


def expected_uint8(store, idx):
    return torch.stack([store[int(i)][0] for i in idx]), torch.tensor([store[int(i)][1] for i in idx])


def check_uint8_batches(loader, epoch=None):
    """Every batch equals the samples `plan` names, gathered one by one from the store."""
    epoch = loader.epoch if epoch is None else epoch
    seen = []
    for number, (images, labels) in enumerate(loader):
        idx, _ = loader.plan(epoch, number)
        ref_images, ref_labels = expected_uint8(loader.store, idx)
        assert images.device == loader.device and images.dtype == torch.uint8
        assert torch.equal(images.cpu(), ref_images), f"batch {number} pixels differ"
        assert torch.equal(labels.cpu(), ref_labels), f"batch {number} labels differ"
        seen += idx.tolist()
    return seen


def check_resume(make_loader, points):
    """state_dict at each point of an epoch, loaded into a new loader, yields exactly the rest."""
    full = [(x.cpu(), y.cpu()) for x, y in make_loader()]
    for k in points:
        a = make_loader()
        it = iter(a)
        for _ in range(k):
            next(it)
        state = a.state_dict()
        it.close()
        b = make_loader()
        b.load_state_dict(state)
        rest = [(x.cpu(), y.cpu()) for x, y in b]
        assert len(rest) == len(full) - k
        for (x, y), (fx, fy) in zip(rest, full[k:]):
            assert torch.equal(x, fx) and torch.equal(y, fy)
