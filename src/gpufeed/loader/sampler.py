"""Which samples go in which batch: a seeded permutation per epoch, cut into equal rank shards.

Same semantics as `DistributedSampler` + a batching `DataLoader`: every rank computes the
same permutation from (seed, epoch), takes every `world_size`-th index from `rank`, and
cuts its shard into batches. With `drop_last` the uneven tail is dropped (each index at
most once per epoch); without it, the shards are padded by wrapping around so all ranks
still get the same number of batches, and the last batch may be short. `pad=False` (with
`drop_last=False`, for evaluation) leaves the shards unpadded: every index exactly once over
all ranks, and the first `n % world_size` ranks have one sample more.
"""

from __future__ import annotations

import os

import torch


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size from the arguments, else torch.distributed, else RANK/WORLD_SIZE, else 0/1."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            found = dist.get_rank(), dist.get_world_size()
        else:
            found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    return rank, world_size


class ShardedBatchSampler:
    """Index batches for one rank; `batches(epoch)` is a pure function of its arguments."""

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, seed: int, rank: int,
                 world_size: int, drop_last: bool, pad: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if n == 0:
            raise ValueError("the store is empty: nothing to load")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.pad = pad or drop_last
        if drop_last:
            self.shard_size = n // world_size
        elif pad:
            self.shard_size = -(-n // world_size)
        else:
            self.shard_size = len(range(rank, n, world_size))
        if drop_last and self.shard_size < batch_size:
            raise ValueError(
                f"batch_size {batch_size} is larger than this rank's shard ({self.shard_size} of {n} "
                f"samples over {world_size} rank(s)) and drop_last=True would leave no batch"
            )

    def __len__(self) -> int:
        if self.drop_last:
            return self.shard_size // self.batch_size
        if not self.shard_size:  # more ranks than samples, unpadded: nothing for this rank
            return 0
        return -(-self.shard_size // self.batch_size)

    def shard(self, epoch: int) -> torch.Tensor:
        """This rank's indices for `epoch`, in visiting order."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch * 1_000_003)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        if not self.pad:
            return order[self.rank :: self.world_size]
        total = self.shard_size * self.world_size
        if total > self.n:  # wrapped as often as it takes: more ranks than samples wrap more than once
            order = order.repeat(-(-total // self.n))
        return order[:total][self.rank :: self.world_size]

    def batches(self, epoch: int, start: int = 0) -> list[torch.Tensor]:
        """Index tensors of this rank's batches in `epoch`, from batch number `start` on."""
        shard = self.shard(epoch)
        count = len(self)
        return [shard[b * self.batch_size : (b + 1) * self.batch_size] for b in range(start, count)]
