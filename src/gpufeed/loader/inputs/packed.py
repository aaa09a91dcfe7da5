"""A store packed in one file on this disk (`store.reader.Store`): memory-mapped, checked at each
pass for a file cut short under its map (reading it would raise SIGBUS)."""

from __future__ import annotations

import torch

from gpufeed.loader import tiers
from gpufeed.loader.bytes import ByteSource, PackedBytes
from gpufeed.loader.inputs.base import Input
from gpufeed.loader.tiers import Tier
from gpufeed.store.reader import Store


class PackedInput(Input):
    store: Store

    def tier(self, device: torch.device, cache: str) -> Tier:
        return tiers.materialize(self.store, device, cache)

    def byte_source(self, tier: Tier) -> ByteSource:
        return PackedBytes(self.store, tier.images)

    def begin(self, plan, epoch: int, start: int, planner) -> None:
        self.store.check_unchanged()
