"""A sharded store on this disk (`store.sharded.ShardedStore`): the shard-aware order over its shards,
a jpeg store's bytes read shard by shard (`ShardBytes`), a batch's fields from the shards its images
were read from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gpufeed.loader import tiers
from gpufeed.loader.bytes import ByteSource, ShardBytes
from gpufeed.loader.inputs.base import Input
from gpufeed.loader.sampler import Shards
from gpufeed.loader.tiers import Tier
from gpufeed.store.sharded import ShardedStore


def checked_window(asked: int | None) -> int | None:
    """`shuffle_window` checked: a number of shards, 1 or more, or None."""
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise ValueError(f"shuffle_window must be a number of shards, 1 or more, got {asked!r}")
    return asked


class ShardedInput(Input):
    store: ShardedStore

    def __init__(self, store: ShardedStore):
        super().__init__(store)
        self._bytes: ShardBytes | None = None

    def shards(self, window: int | None, batch_size: int) -> Shards | None:
        return Shards(self.store.starts, checked_window(window), None)

    def tier(self, device: torch.device, cache: str) -> Tier:
        return tiers.materialize_sharded(self.store, device, cache)

    def byte_source(self, tier: Tier) -> ByteSource:
        self._bytes = ShardBytes(self.store)
        return self._bytes

    def begin(self, plan, epoch: int, start: int, planner) -> None:
        self.store.check_unchanged()

    def fields_store(self, shards: Mapping[int, Any] | None):
        return self.store if shards is None else self.store.pinned(shards)

    def close(self) -> None:
        if self._bytes is not None:
            self._bytes.close()
