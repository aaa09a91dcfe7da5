"""A folder, list or tar shards read in place (`loader.folder.FolderStore`): itself the byte source of
its batches, labels on the device's side of the gather (`tiers.in_place`)."""

from __future__ import annotations

import torch

from gpufeed.loader import tiers
from gpufeed.loader.bytes import ByteSource
from gpufeed.loader.folder import FolderStore
from gpufeed.loader.inputs.base import Input
from gpufeed.loader.tiers import Tier


class FolderInput(Input):
    store: FolderStore

    def tier(self, device: torch.device, cache: str) -> Tier:
        return tiers.in_place(self.store.labels)

    def byte_source(self, tier: Tier) -> ByteSource:
        return self.store

    def close(self) -> None:
        self.store.close()
