"""Sharding and ordering: every index once per epoch per world, equal disjoint shards, seeded."""

from __future__ import annotations

import pytest
import torch

from gpufeed.loader import ShardedBatchSampler, resolve_rank


def epoch_indices(n, batch, world, epoch=0, seed=0, drop_last=True, shuffle=True):
    return [
        torch.cat(ShardedBatchSampler(n, batch, shuffle=shuffle, seed=seed, rank=r, world_size=world,
                                      drop_last=drop_last).batches(epoch)).tolist()
        for r in range(world)
    ]


@pytest.mark.parametrize("n, batch, world", [(96, 8, 1), (96, 8, 3), (96, 4, 4), (100, 5, 2)])
def test_every_index_exactly_once_per_world(n, batch, world):
    shards = epoch_indices(n, batch, world)
    assert len({len(s) for s in shards}) == 1
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))


def test_drop_last_drops_the_uneven_tail_and_equalises():
    shards = epoch_indices(103, 8, 3)
    assert all(len(s) == 32 for s in shards)  # 34 per rank -> 4 full batches
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat) == 96


def test_no_drop_last_pads_to_equal_shards_and_keeps_every_index():
    samplers = [ShardedBatchSampler(10, 4, shuffle=True, seed=0, rank=r, world_size=3, drop_last=False)
                for r in range(3)]
    assert [len(s) for s in samplers] == [1, 1, 1]
    batches = [s.batches(0) for s in samplers]
    assert all(len(b[0]) == 4 for b in batches)
    assert set(torch.cat([b[0] for b in batches]).tolist()) == set(range(10))


def test_order_is_seeded_and_changes_with_epoch():
    assert epoch_indices(64, 8, 2, seed=1) == epoch_indices(64, 8, 2, seed=1)
    assert epoch_indices(64, 8, 2, seed=1) != epoch_indices(64, 8, 2, seed=2)
    assert epoch_indices(64, 8, 2, epoch=0) != epoch_indices(64, 8, 2, epoch=1)
    assert epoch_indices(16, 4, 1, shuffle=False) == [list(range(16))]


def test_rank_resolution(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(None, None) == (2, 4)
    assert resolve_rank(1, None) == (1, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_rank(None, None) == (0, 1)
    with pytest.raises(ValueError, match="rank 4 is not in a world of size 4"):
        resolve_rank(4, 4)


def test_clear_errors():
    with pytest.raises(ValueError, match="larger than this rank's shard"):
        ShardedBatchSampler(10, 8, shuffle=True, seed=0, rank=0, world_size=2, drop_last=True)
    with pytest.raises(ValueError, match="empty"):
        ShardedBatchSampler(0, 8, shuffle=True, seed=0, rank=0, world_size=1, drop_last=True)


@pytest.mark.parametrize("n, world, batch", [(10, 3, 2), (7, 2, 4), (5, 8, 1), (64, 4, 16)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_unpadded_shards_cover_every_sample_exactly_once(n, world, batch, shuffle):
    """Evaluation on several ranks: pad=False, the ranks' batches together are the dataset, once."""
    samplers = [ShardedBatchSampler(n, batch, shuffle=shuffle, seed=1, rank=r, world_size=world, drop_last=False,
                                    pad=False) for r in range(world)]
    seen = [int(i) for s in samplers for b in s.batches(3) for i in b]
    assert sorted(seen) == list(range(n))
    assert [len(s.shard(3)) for s in samplers] == [len(range(r, n, world)) for r in range(world)]
    assert all(len(s) == len(s.batches(3)) for s in samplers)
    padded = ShardedBatchSampler(n, batch, shuffle=shuffle, seed=1, rank=0, world_size=world, drop_last=False)
    assert len(padded.shard(3)) == -(-n // world)  # the default pads, as DistributedSampler does


@pytest.mark.parametrize("n, world", [(3, 8), (1, 4), (5, 16)])
def test_more_ranks_than_samples_padded_gives_every_rank_a_sample(n, world):
    """drop_last=False pads by wrapping as often as it takes (it wrapped once: 3 samples on 8 ranks
    left ranks 6 and 7 with empty batches)."""
    shards = [ShardedBatchSampler(n, 4, shuffle=True, seed=0, rank=r, world_size=world, drop_last=False).batches(0)
              for r in range(world)]
    assert all(len(s) == 1 and len(s[0]) == 1 for s in shards)
    assert sorted({int(s[0][0]) for s in shards}) == list(range(n))
