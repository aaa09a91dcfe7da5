"""Everything random about one epoch on one rank, decided up front in a few vectorised calls.

Per batch the loader then only slices: no per-batch sampling ops on the CPU, no per-batch
uploads of indices or parameters (they go to the device once per epoch). The plan is a pure
function of (seed, epoch, rank), so a resumed loader replays exactly the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpufeed.augment.params import Params
from gpufeed.augment.pipeline import Augment
from gpufeed.loader.sampler import ShardedBatchSampler


@dataclass
class EpochOrder:
    """The first half of a plan: which samples each batch reads, in the order they are yielded (the
    sampler's draw, before the augment parameters'). Enough to start what depends on the order alone,
    a bucket's downloads, while the rest is drawn."""

    indices: torch.Tensor  # (samples,) int64; batch b is indices[starts[b]:starts[b + 1]]
    starts: list[int]


def order_epoch(sampler: ShardedBatchSampler, epoch: int) -> EpochOrder:
    """`epoch`'s order for the sampler's rank (`plan_epoch`'s first step)."""
    batches = sampler.batches(epoch)
    starts = [0]
    for b in batches:
        starts.append(starts[-1] + len(b))
    # in the sampler's seeded random order, not sorted: a sorted batch of an ImageFolder store is
    # sorted by class too, and gradient accumulation or in-batch losses would see class-sorted slices
    indices = torch.cat(batches) if batches else torch.empty(0, dtype=torch.int64)
    return EpochOrder(indices, starts)


@dataclass
class EpochPlan:
    """Indices of every batch (in the seeded random order they are yielded in), back to back, and the
    augment parameters aligned with them."""

    indices: torch.Tensor  # (samples,) int64; batch b is indices[starts[b]:starts[b + 1]]
    starts: list[int]
    params: Params | None
    flips: list[bool]  # per batch: any sample mirrored

    def __len__(self) -> int:
        return len(self.starts) - 1

    def batch(self, number: int) -> tuple[torch.Tensor, Params | None]:
        a, b = self.starts[number], self.starts[number + 1]
        if self.params is None:
            return self.indices[a:b], None
        return self.indices[a:b], self.params.rows(a, b, self.flips[number], number)

    def to(self, device: torch.device) -> EpochPlan:
        """The same plan with its tensors on `device` (one copy each per epoch)."""
        params = self.params.to(device, non_blocking=True) if self.params is not None else None
        return replace(self, indices=self.indices.to(device, non_blocking=True), params=params)


def plan_epoch(
    sampler: ShardedBatchSampler,
    augment: Augment | None,
    seed: int,
    epoch: int,
    image_hw: tuple[int, int] | torch.Tensor,
    size_divisible: int | None = None,
    order: EpochOrder | None = None,
) -> EpochPlan:
    """The plan of `epoch` for the sampler's rank; `image_hw` is one (H, W) or a (samples, 2) tensor.
    `size_divisible`: each batch padded to one shape, a multiple of it (`Augment.sample`'s `batches`).
    `order`: the epoch's `order_epoch`, where it was made before."""
    order = order if order is not None else order_epoch(sampler, epoch)
    indices, starts = order.indices, order.starts
    if augment is None:
        return EpochPlan(indices, starts, None, [])
    g = torch.Generator().manual_seed(hash((seed, epoch, sampler.rank)) & (2**63 - 1))
    padded_at = None if size_divisible is None else starts
    multiple = size_divisible or 1
    if isinstance(image_hw, torch.Tensor):
        hw = image_hw[indices]
        params = augment.sample(len(indices), hw[:, 0], hw[:, 1], g, padded_at, multiple)
    else:
        params = augment.sample(len(indices), *image_hw, g, padded_at, multiple)
    mirrored = torch.cat([torch.zeros(1, dtype=torch.int64), params.flip.cumsum(0)])[starts]
    flips = (mirrored[1:] > mirrored[:-1]).tolist()
    return EpochPlan(indices, starts, params, flips)
