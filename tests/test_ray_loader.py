"""`gpufeed.ray` on a local Ray cluster (CPU): Ray workers fit images to S×S, the RayLoader's
batches equal the Loader's over a raw store packed from the same images."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from conftest import jpeg_bytes, save, smooth
from gpufeed.augment import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize

ray = pytest.importorskip("ray")
gray = pytest.importorskip("gpufeed.ray")

CLASSES = ["a", "b"]
OPS = [Resize(20), CenterCrop(16), Normalize()]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import tests/
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    yield
    ray.shutdown()


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "src"
    for k in range(20):
        save(root / CLASSES[k % 2] / f"{k:03d}.png", smooth(k, 30 + k, 40))
    return root


def _with_labels(batch: dict) -> dict:
    batch["label"] = np.array([CLASSES.index(Path(p).parent.name) for p in batch["path"]], dtype=np.int64)
    return batch


def _loader_batches(store, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with gpufeed.Loader(store, batch_size=4, device="cpu", shuffle=False, **kw) as loader:
        return list(loader)


def _assert_same(got, want) -> None:
    assert len(got) == len(want) > 0
    for (x, y), (x2, y2) in zip(got, want):
        assert x.dtype == x2.dtype and x.shape == x2.shape
        assert torch.equal(y, y2)
        assert torch.equal(x, x2)


def test_read_images_through_ray_equals_a_packed_store(cluster, folder, tmp_path):
    gpufeed.pack(folder, tmp_path / "s", size=24, workers=1, progress=False)
    ds = ray.data.read_images(str(folder), include_paths=True).map_batches(_with_labels, batch_format="numpy")
    feed = gray.RayLoader(ds, batch_size=4, device="cpu", size=24, augment=OPS, dtype=torch.float16)
    _assert_same(list(feed), _loader_batches(tmp_path / "s", augment=OPS, dtype=torch.float16))
    stats = feed.stats()
    assert stats["tier"] == "ray" and stats["images"] == 20 and stats["seconds"]["wait"] > 0


def test_read_store_feeds_uint8_like_the_loader(cluster, folder, tmp_path):
    gpufeed.pack(folder, tmp_path / "s", size=24, workers=1, progress=False)
    feed = gray.RayLoader(gray.read_store(tmp_path / "s", rows_per_block=8), batch_size=4, device="cpu", size=24)
    _assert_same(list(feed), _loader_batches(tmp_path / "s"))


def test_random_augment_is_seeded_per_epoch(cluster, folder, tmp_path):
    gpufeed.pack(folder, tmp_path / "s", size=24, workers=1, progress=False)
    ops = [RandomResizedCrop(16), RandomHorizontalFlip(), Normalize()]
    feed = gray.RayLoader(gray.read_store(tmp_path / "s"), batch_size=4, device="cpu", size=None, augment=ops,
                          dtype=torch.float32, seed=3)
    first, second = list(feed), list(feed)
    feed.set_epoch(0)
    again = list(feed)
    assert first[0][0].shape == (4, 3, 16, 16)
    _assert_same(again, first)
    assert not torch.equal(first[0][0], second[0][0])


def test_jpeg_store_bytes_are_decoded_on_workers_and_bad_rows_dropped(cluster, tmp_path):
    src = tmp_path / "src"
    for k in range(6):
        (src / "a").mkdir(parents=True, exist_ok=True)
        (src / "a" / f"{k}.jpg").write_bytes(jpeg_bytes(smooth(k, 40, 60), quality=95))
    gpufeed.pack(src, tmp_path / "j", mode="jpeg", workers=1, progress=False)
    rows = gray.read_store(tmp_path / "j").take_all()
    assert all(isinstance(r["image"], bytes) for r in rows)
    items = [{"image": r["image"], "label": k} for k, r in enumerate(rows)]
    items.insert(2, {"image": b"\xff\xd8 broken", "label": 99})
    feed = gray.RayLoader(ray.data.from_items(items), batch_size=3, device="cpu", size=16, drop_last=False)
    out = list(feed)
    labels = torch.cat([y for _, y in out]).tolist()
    assert labels == list(range(6))
    assert all(x.shape[1:] == (3, 16, 16) and x.dtype == torch.uint8 for x, _ in out)


def test_images_of_different_sizes_need_size(cluster, folder):
    ds = ray.data.read_images(str(folder))
    with pytest.raises(Exception, match="pass size="):
        list(gray.RayLoader(ds, batch_size=4, device="cpu", size=None))


def test_read_store_shards_per_rank(cluster, folder, tmp_path):
    gpufeed.pack(folder, tmp_path / "s", size=24, workers=1, progress=False)
    labels = gpufeed.open(tmp_path / "s").labels
    parts = [gray.read_store(tmp_path / "s", rank=r, world_size=3).take_all() for r in range(3)]
    assert [len(p) for p in parts] == [7, 7, 6]
    for r, rows in enumerate(parts):
        assert [int(row["label"]) for row in rows] == labels[r::3].tolist()
