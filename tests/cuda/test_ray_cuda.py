"""RayLoader on a GPU: pinned ring, side-stream copy and the fused kernel give the Loader's batches."""

from __future__ import annotations

import pytest
import torch

import gpufeed
from gpufeed.augment import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize
from loader_checks import make_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ray = pytest.importorskip("ray")
gray = pytest.importorskip("gpufeed.ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    yield
    ray.shutdown()


def test_ray_batches_on_cuda_equal_the_loaders(cluster, tmp_path):
    store = make_store(tmp_path, n=96)
    ops = [Resize(36), CenterCrop(28), Normalize()]
    feed = gray.RayLoader(gray.read_store(store.path, rows_per_block=16), batch_size=16, device="cuda", size=None,
                          augment=ops, prefetch=2)
    loader = gpufeed.Loader(store, batch_size=16, device="cuda", shuffle=False, augment=ops)
    for _ in range(2):  # the second epoch reuses the ring's slots
        got, want = list(feed), list(loader)
        assert len(got) == len(want) == 6
        for (x, y), (x2, y2) in zip(got, want):
            assert x.is_cuda and y.is_cuda and x.dtype == torch.float16
            assert torch.equal(y, y2)
            torch.testing.assert_close(x, x2, atol=2e-3, rtol=0)
    assert feed.stats()["bytes"]["h2d_issue"] > 0 and not feed.stats()["notes"]


def test_random_ops_on_cuda_match_the_same_ops_on_cpu(cluster, tmp_path):
    store = make_store(tmp_path, n=64)
    ops = [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize()]
    runs = [list(gray.RayLoader(gray.read_store(store.path), batch_size=16, device=d, size=None, augment=ops,
                                dtype=torch.float32, seed=5)) for d in ("cuda", "cpu")]
    for (g, gl), (c, cl) in zip(*runs):
        assert torch.equal(gl.cpu(), cl)
        assert (g.cpu() - c).abs().max() < 1e-3
