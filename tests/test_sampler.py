"""Sharding and ordering: every index once per epoch per world, equal disjoint shards, seeded."""

from __future__ import annotations

import numpy as np
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


def _streamed(sizes, batch, world, rank, *, ramp, window=4, first_window=None, epoch=0, segments=(), seed=5,
              drop_last=False):
    """The sampler of `rank` for a shard-aware order over shards of `sizes` samples (a store in a bucket)."""
    from gpufeed.loader.sampler import Segment, Shards

    starts = np.concatenate([[0], np.cumsum(sizes)])
    sampler = ShardedBatchSampler(int(starts[-1]), batch, shuffle=True, seed=seed, rank=rank, world_size=world,
                                  drop_last=drop_last, pad=False,
                                  shards=Shards(starts, window, first_window, ramp=ramp))
    sampler.resume(epoch, tuple(Segment(w, b) for w, b in segments))
    return sampler, starts


def _shards_of(batch, starts):
    return set((np.searchsorted(starts, batch.numpy(), side="right") - 1).tolist())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_span_of_a_streamed_epoch_starts_on_one_shard(world):
    """A store streamed from a bucket (`Shards.ramp`): each rank's first batch reads one shard, where the
    global order's span started inside the windows of the shards before it (rank 1 of 2 read 4 or
    more: each to be downloaded first); each rank reads the samples of its contiguous span of the
    global order, every sample once, and never more than `window` shards at a time."""
    sizes = [60, 55, 70, 64, 58, 61, 66, 52, 63, 60, 57, 69, 62, 59, 65, 60]
    first_batches, before = [], []
    for rank in range(world):
        sampler, starts = _streamed(sizes, 48, world, rank, ramp=True)
        plain, _ = _streamed(sizes, 48, world, rank, ramp=False)
        batches = sampler.batches(0)
        first_batches.append(len(_shards_of(batches[0], starts)))
        before.append(len(_shards_of(plain.batches(0)[0], starts)))
        span = torch.cat(batches)
        assert sorted(span.tolist()) == sorted(torch.cat(plain.batches(0)).tolist())  # the same span, reordered
        read = np.searchsorted(starts, span.numpy(), side="right") - 1
        last = {k: i for i, k in enumerate(read.tolist())}
        first = {}
        for i, k in enumerate(read.tolist()):
            first.setdefault(k, i)
        open_at = [sum(first[k] <= i <= last[k] for k in first) for i in range(len(read))]
        assert max(open_at) <= 4, (rank, max(open_at))
    assert first_batches == [1] * world
    if world > 1:
        assert min(before[1:]) >= 3  # what the spans' first batches read without the ramp
    whole = sorted(i for r in range(world) for b in _streamed(sizes, 48, world, r, ramp=True)[0].batches(0)
                   for i in b.tolist())
    assert whole == list(range(sum(sizes)))


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (1, 4)])
def test_a_streamed_epoch_resumed_at_another_world_size_reads_exactly_the_rest(before, after):
    """A ramped epoch (`Shards.ramp`) stopped after 2 batches at one world size and resumed at another
    reads every sample no rank had consumed, once, and each new span starts on one shard again."""
    sizes = [60, 55, 70, 64, 58, 61, 66, 52, 63, 60, 57, 69, 62, 59, 65, 60]
    consumed = [i for r in range(before)
                for b in _streamed(sizes, 24, before, r, ramp=True, first_window=4, window=None)[0].batches(0)[:2]
                for i in b.tolist()]
    rest = []
    for rank in range(after):
        sampler, starts = _streamed(sizes, 24, after, rank, ramp=True, first_window=4, window=None,
                                    segments=[(before, 2)])
        batches = sampler.batches(0)
        assert len(_shards_of(batches[0], starts)) == 1
        rest += [i for b in batches for i in b.tolist()]
    assert sorted(consumed + rest) == list(range(sum(sizes)))
    # a full shuffle epoch (epoch 1 of a store whose cache holds it all) is not reordered
    sampler, _ = _streamed(sizes, 24, 2, 1, ramp=True, first_window=4, window=None, epoch=1)
    plain, _ = _streamed(sizes, 24, 2, 1, ramp=False, first_window=4, window=None, epoch=1)
    assert torch.equal(torch.cat(sampler.batches(1)), torch.cat(plain.batches(1)))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world, window", [(1, 4), (1, 10), (2, 4), (3, 6), (4, 10), (8, 10)])
def test_a_streamed_span_ends_on_its_last_shard_alone(world, window, drop_last):
    """The shard a span reads first last (the last to be downloaded) takes the span's last place alone:
    once it is in, only its own samples are left to train on. Spread over `window` places as the
    others, it left about (window + 1) / 2 shards' samples for after the last download, the link idle.
    With drop_last, the last shard read is the last one before the cut (the last-ranked shards, those
    shared with the next span that have fewest samples in this one, can lie wholly past it)."""
    sizes = [60, 55, 70, 64, 58, 61, 66, 52, 63, 60, 57, 69, 62, 59, 65, 60, 61, 58, 66, 63] * 2
    for rank in range(world):
        sampler, starts = _streamed(sizes, 48, world, rank, ramp=True, window=window, drop_last=drop_last)
        read = (np.searchsorted(starts, torch.cat(sampler.batches(0)).numpy(), side="right") - 1).tolist()
        first = {}
        for i, k in enumerate(read):
            first.setdefault(k, i)
        last_shard = max(first, key=first.get)
        assert set(read[first[last_shard]:]) == {last_shard}, (rank, read[first[last_shard]:][:20])
        assert read.count(last_shard) == len(read) - first[last_shard]


def test_a_streamed_span_whose_batch_is_larger_than_a_shard_starts_on_as_few_shards_as_hold_it():
    """Batches of 512 over shards of 100: each rank's first batch reads 6 to 8 shards (6 hold it), not
    the 14-25 of the global order's windows (a ramp by powers of 4 read 13)."""
    sizes = [100] * 40
    for rank in range(3):
        sampler, starts = _streamed(sizes, 512, 3, rank, ramp=True, window=20)
        plain, _ = _streamed(sizes, 512, 3, rank, ramp=False, window=20)
        first = len(_shards_of(sampler.batches(0)[0], starts))
        assert 6 <= first <= 8 < len(_shards_of(plain.batches(0)[0], starts)), (rank, first)


def test_a_streamed_span_starts_on_its_first_shard_that_holds_a_batch():
    """Where the span's first whole shard holds fewer samples than a batch, the first one that holds a
    batch goes first: the first batch still reads one shard (it read three)."""
    sizes = [10, 100, 100, 100, 100, 100, 100, 100]
    for seed in (1, 3):  # (seeds whose order puts the 10-sample shard first)
        sampler, starts = _streamed(sizes, 50, 1, 0, ramp=True, window=2, seed=seed)
        assert len(_shards_of(sampler.batches(0)[0], starts)) == 1
