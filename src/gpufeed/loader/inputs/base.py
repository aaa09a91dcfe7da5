"""`Input`: what the Loader asks of the data it reads, whatever its kind (`gpufeed.loader.inputs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gpufeed.loader.bytes import ByteSource
from gpufeed.loader.sampler import Shards
from gpufeed.loader.tiers import Tier


class Input:
    """A Loader's data: `store` (labels, shapes, fields, digest: what every kind has) and what reading
    it takes. The methods are the Loader's calls, in the order it makes them; a kind overrides those
    it needs."""

    def __init__(self, store: Any):
        self.store = store

    def shards(self, window: int | None, batch_size: int) -> Shards | None:
        """The shard-aware order's shards and windows (`shuffle_window`: `window`), or None where the
        data is not in shards (a full shuffle, or the order as it is)."""
        return None

    def download_elsewhere(self) -> None:
        """Download what the data needs in a process of its own (`Tuning.fetch_process`); nothing where
        nothing downloads."""

    def lead_lands_first(self) -> None:
        """The shard a pass reads first downloads alone until it lands (`Tuning.lead_lands_first`);
        nothing where nothing downloads."""

    def tier(self, device: torch.device, cache: str) -> Tier:
        """Where a pass reads the images from (`Loader(cache=...)`)."""
        raise NotImplementedError

    def byte_source(self, tier: Tier) -> ByteSource:
        """What a jpeg store's batches read their encoded images from, once, after `tier`."""
        raise NotImplementedError

    # whether `begin_early` starts anything: the first pass's order is then drawn as the Loader is made
    begins_early = False

    def begin_early(self, order, epoch: int, start: int) -> None:
        """A pass of `epoch` begins at batch `start` while its plan is still being drawn: what needs only
        its `order` (`plan.EpochOrder`) starts now; `begin` follows once the plan is made."""

    def begin(self, plan, epoch: int, start: int, planner) -> None:
        """A pass of `epoch`'s `plan` begins at batch `start` (`planner`: the next epochs' plans)."""

    def fields_store(self, shards: Mapping[int, Any] | None) -> Any:
        """The store a batch's fields are read from (`shards`: those its images were read from, kept
        for it, or None)."""
        return self.store

    def close(self) -> None:
        """Let go of what the input opened (the Loader's shutdown, after its decoders stopped)."""
