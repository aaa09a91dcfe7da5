"""A sharded store in a bucket (`store.remote.RemoteStore`), read through its cache: the cache joined
as the Loader is made (its folder's readers split its limit), the shard-aware order's window sized to
what the cache holds for each of this machine's ranks (or refused, with the numbers to use, at
construction rather than mid-epoch), and at each pass the rank's shards downloaded ahead, in the order
it reads them, across the epoch's end."""

from __future__ import annotations

import functools

import numpy as np
import torch

from gpufeed.loader.bytes import ByteSource, ShardBytes
from gpufeed.loader.cores import local_ranks
from gpufeed.loader.inputs.sharded import ShardedInput, checked_window
from gpufeed.loader.sampler import Shards
from gpufeed.loader.tiers import Tier
from gpufeed.store.readahead import ReadAhead, Want
from gpufeed.store.remote import RemoteStore
from gpufeed.store.sharded import ShardedStore


class RemoteInput(ShardedInput):
    store: RemoteStore

    def __init__(self, store: RemoteStore):
        super().__init__(store)
        store.cache.join()  # among its cache folder's readers before any sizing check
        self.ahead = ReadAhead(store.cache)  # the downloads ahead of this rank's reading; the cache's eviction order
        self._early: tuple[int, int, int] | None = None  # (epoch, start, `follow`'s number) of `begin_early`

    def shards(self, window: int | None, batch_size: int) -> Shards | None:
        return _shards(self.store, window, batch_size)

    def download_elsewhere(self) -> None:
        self.store.cache.download_elsewhere()

    def lead_lands_first(self) -> None:
        self.ahead.lead_lands_first = True

    begins_early = True

    def begin_early(self, order, epoch: int, start: int) -> None:
        """This pass's shards fetched ahead from its order, before its plan is made (`begin` then adds
        only the next epoch's: the plan reads in this order)."""
        told = self.ahead.follow(_shard_order(self.store, order, epoch, start, None), local_ranks())
        self._early = (epoch, start, told)

    def begin(self, plan, epoch: int, start: int, planner) -> None:
        """Fetch this rank's shards ahead, in the order it reads them (unless `begin_early` did), and the
        next epoch's after them: now where it is planned already, else once it is (`Planner.when_made`)."""
        super().begin(plan, epoch, start, planner)
        following = planner.ready(epoch + 1)
        early, self._early = self._early, None
        if early is not None and early[:2] == (epoch, start):
            told = early[2]  # this pass followed already, from its order: the next epoch's entries to add
        elif following is None:
            told = self.ahead.follow(_shard_order(self.store, plan, epoch, start, None), local_ranks())
        else:  # this pass and the next epoch's entries at once
            self.ahead.follow(_shard_order(self.store, plan, epoch, start, following), local_ranks())
            return
        follow_next = functools.partial(_follow_next, self.store, self.ahead, plan, epoch, start, told)
        if following is None:
            planner.when_made(epoch + 1, follow_next)
        else:
            follow_next(following)

    def byte_source(self, tier: Tier) -> ByteSource:
        self._bytes = ShardBytes(self.store, on_read=self.ahead.read)
        return self._bytes

    def close(self) -> None:
        super().close()
        self.ahead.close()
        self.store.close()


def _shard_order(store: RemoteStore, plan, epoch: int, start: int, following) -> list[Want]:
    """What a rank reads from batch `start` of epoch `epoch`'s `plan` (or its `EpochOrder`) on: each
    shard's samples, in the order it first reads them; then the same of the next epoch's plan where it
    is made (`following`, or None): the cache fetches across the epoch's end instead of waiting for the
    next pass to begin (0.2-0.3 s of a cache-bound epoch's start otherwise)."""
    indices = plan.indices[plan.starts[start] :]
    wants = _wants(store, epoch, indices, 0)
    return wants if following is None else wants + _wants(store, epoch + 1, following.indices, len(indices))


def _wants(store: RemoteStore, epoch: int, indices: torch.Tensor, base: int) -> list[Want]:
    """`_shard_order`'s entries of one epoch's `indices`, read after `base` samples of the list."""
    shards, _ = store.locate(indices.numpy())
    found, first, counts = np.unique(shards, return_index=True, return_counts=True)
    _, from_end = np.unique(shards[::-1], return_index=True)
    last = base + len(shards) - 1 - from_end
    return [Want(int(found[j]), epoch, int(counts[j]), int(last[j])) for j in np.argsort(first, kind="stable")]


def _follow_next(store: RemoteStore, ahead: ReadAhead, plan, epoch: int, start: int, told: int, following) -> None:
    """The next epoch's part of `_shard_order`, given to the read-ahead once its plan (`following`) is
    made after the pass began (`ReadAhead.follow_next`)."""
    read_before = len(plan.indices) - plan.starts[start]  # this pass's samples, read first
    ahead.follow_next(_wants(store, epoch + 1, following.indices, read_before), told)


def _shards(store: RemoteStore, asked: int | None, batch_size: int) -> Shards:
    """The store's shards and the shard-aware order's windows: `_window`'s, and for a jpeg store in a
    bucket whose cache holds all of it (no `cache_limit`, or one above the store), a first epoch over
    a quarter of the shards' places: with a full shuffle its first batch would wait for nearly every
    shard, so the first epoch could not train while they download. Each rank's span of a shard-aware
    epoch starts on one shard (`Shards.ramp`): the shards arrive one by one."""
    window = _window(store, asked, batch_size)
    shards = len(store.starts) - 1
    streamed = store.mode == "jpeg" and asked is None
    first = max(1, shards // 4) if streamed and (window is None or window >= shards) else None
    return Shards(store.starts, window, first, ramp=True)


def _window(store: RemoteStore, asked: int | None, batch_size: int) -> int | None:
    """Over how many shards the shard-aware order spreads each shard's samples (None: a full shuffle).
    Asked for, or for a store read through a bounded cache: as many as this machine's ranks each have
    room for in it, less two fetched ahead and those the batches in flight read beyond them (the
    shards of the batch being read and the `ShardBytes.HELD_FOR` before it, and one: counting the
    `HELD_FOR` alone, a cache of 17 small shards for batches of 16 ran out of room at the seventh
    batch); a cache with no room for a window of one is refused here, not mid-epoch, as is a window
    asked for that the cache can't hold (a full shuffle through a small cache), and a cache folder
    read by more processes than LOCAL_WORLD_SIZE says (each counted on its part of the limit: they
    blocked each other mid-epoch, then failed). A raw store's cache must hold it whole."""
    asked = checked_window(asked)
    if store.cache.limit is None:
        return asked
    limit = store.cache.limit
    if store.mode == "raw" and limit < store.nbytes:
        raise ValueError(
            f"{store.path}: a raw store is read through its cache only whole: cache_limit {limit} bytes "
            f"holds less than its {store.nbytes}; raise it, or pack the data as a jpeg store"
        )
    if limit < store.nbytes:  # (a cache that holds the whole store has room for any number of its readers)
        _check_sharing(store, batch_size)
    biggest = max(s["bytes"] for s in store.manifest.shards)
    held = _held(store, batch_size)
    room = limit // (local_ranks() * biggest)
    if room - 2 - held < 1:
        raise ValueError(
            f"{store.path}: cache_limit {limit} bytes holds {room} of its shards a rank; the batches of "
            f"{batch_size} in flight read about {held}, the order spreads over one more and two are fetched "
            f"ahead: raise it to {smallest_cache(store, batch_size)} bytes or more, or use smaller batches"
        )
    if asked is not None and asked > room - 2 - held and limit < store.nbytes:
        needed = min(store.nbytes, (asked + 2 + held) * biggest * local_ranks())
        raise ValueError(
            f"{store.path}: shuffle_window {asked} spreads each shard's samples over {asked} shards' places "
            f"(the batches in flight read about {held} more, and two are fetched ahead), and cache_limit "
            f"{limit} bytes holds {room} of its shards a rank: use a shuffle_window of at most "
            f"{room - 2 - held}, or raise cache_limit to {needed} bytes or more"
        )
    return asked if asked is not None else room - 2 - held


def _check_sharing(store: RemoteStore, batch_size: int) -> None:
    """Refuse a cache folder that more processes read through now than LOCAL_WORLD_SIZE says share it,
    naming the settings to use: each process counts on its part of the limit."""
    others = store.cache.others()
    pids = sorted(user.pid for user in others)
    ranks = local_ranks()
    if len(others) + 1 > ranks:
        users = len(others) + 1
        raise ValueError(
            f"{store.path}: cache_dir {store.cache.folder} is read now by {len(pids)} other process(es) as "
            f"well (pid {', '.join(map(str, pids))}), and LOCAL_WORLD_SIZE says {ranks} share it: each "
            f"process counts on its part of cache_limit. Set LOCAL_WORLD_SIZE={users} (torchrun sets it) "
            f"with cache_limit at least {smallest_cache(store, batch_size, users)} bytes, or give each "
            "process a cache_dir of its own"
        )


def _held(store: ShardedStore, batch_size: int) -> int:
    """The shards the batches in flight read: the one being read and the `ShardBytes.HELD_FOR` before
    it, at the store's samples per shard, and one they straddle."""
    return -(-(ShardBytes.HELD_FOR + 1) * batch_size * len(store.manifest.shards) // len(store)) + 1


def smallest_cache(store: ShardedStore, batch_size: int, ranks: int | None = None) -> int:
    """The smallest `cache_limit` a Loader of `batch_size` accepts for `store` on this machine: room
    for the shards the batches in flight read, a window of one and two fetched ahead, each rank
    (`ranks` sharing the cache folder; default: LOCAL_WORLD_SIZE's)."""
    biggest = max(s["bytes"] for s in store.manifest.shards)
    return (_held(store, batch_size) + 3) * biggest * (ranks or local_ranks())
