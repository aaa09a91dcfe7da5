"""Which samples go in which batch: one global order per epoch, cut into equal contiguous rank spans.

The epoch's **global order** is a pure function of (seed, epoch): a seeded permutation of the store
(or, for a store in shards read through a bounded cache, a shard-aware one: the shards permuted, and
each shard's samples spread at random over the places of `window` shards from its own, so that
about `window` shards are being read at any point; a store streamed into a cache that holds it all
has a shard-aware first epoch only, `first_window`), the same whatever the world size. Each rank
takes one contiguous, equal **span** of it and cuts it into batches: with `drop_last` the uneven
tail is dropped (each sample at most once per epoch); without it the spans are padded by wrapping
around so all ranks get the same number of batches (DistributedSampler's way), or with `pad=False`
(evaluation) left unpadded: every sample exactly once over all ranks, the first spans one sample
longer. A span of a shard-aware order reads about 1/world of the store's shards.

**Batches by group** (aspect ratio, for detection: `groups`). Each span is then reordered as
torchvision's GroupedBatchSampler forms batches: walking the span, a sample joins its group's next
batch, and a batch is yielded when it fills; what is left at the span's end follows, group after
group (the last batches mix groups only there). The reordering is a pure function of the span, so
all of the above holds with it.

**Resuming at another world size.** A job's position in an epoch is global: every rank has yielded
as many batches. A job stopped after `batches` batches at world size W and resumed at W' continues
with what no rank consumed (the first `batches` batches of each of the W spans), in global order, cut
into W' spans: each remaining sample once (with `pad=False`). `Segment`s record such earlier parts
of an epoch; a resume at the same world size needs none (the same spans, from the next batch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
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


@dataclass(frozen=True)
class Segment:
    """A part of an epoch already consumed: `batches` batches on each of `world` ranks."""

    world: int
    batches: int


@dataclass(frozen=True)
class Shards:
    """How a store's samples lie in its shards (`starts[k]`: the first sample of shard k, then the
    count), and over how many shards' places the shard-aware order spreads each shard's samples (None:
    all, a full shuffle). `first_window`: epoch 0's instead (a store streamed from a bucket into a
    cache that holds all of it: its first epoch trains while the shards arrive, the later ones are
    full shuffles from the cache)."""

    starts: np.ndarray
    window: int | None = None
    first_window: int | None = None

    def window_of(self, epoch: int) -> int | None:
        return self.first_window if epoch == 0 and self.first_window is not None else self.window


class ShardedBatchSampler:
    """Index batches for one rank; `batches(epoch)` is a pure function of its arguments (and of the
    `Segment`s an epoch was resumed after, `resume`)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        pad: bool = True,
        shards: Shards | None = None,
        groups: np.ndarray | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if n == 0:
            raise ValueError("the store is empty: nothing to load")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.pad = pad or drop_last
        self.shards = shards
        self.groups = None if groups is None else np.asarray(groups, np.int64)
        if self.groups is not None and self.groups.shape != (n,):
            raise ValueError(f"groups: one group id per sample ({n}), got shape {self.groups.shape}")
        self.resumed: tuple[int, tuple[Segment, ...]] | None = None  # (epoch, the segments it continues after)
        self.shard_size = self._span_sizes(n, world_size)[rank]
        if drop_last and self.shard_size < batch_size:
            raise ValueError(
                f"batch_size {batch_size} is larger than this rank's shard ({self.shard_size} of {n} "
                f"samples over {world_size} rank(s)) and drop_last=True would leave no batch"
            )

    def __len__(self) -> int:
        """Batches per epoch on this rank (in an epoch resumed at another world size, of its rest)."""
        return self._count(self.shard_size)

    def length(self, epoch: int) -> int:
        """Batches of `epoch` on this rank: its span's, or of the rest after the segments it was resumed after."""
        segments = self.segments(epoch)
        if not segments:
            return len(self)
        return self._count(self._span_sizes(len(self._remaining(epoch, segments)), self.world_size)[self.rank])

    def _count(self, size: int) -> int:
        if self.drop_last:
            return size // self.batch_size
        return -(-size // self.batch_size) if size else 0

    def resume(self, epoch: int, segments: tuple[Segment, ...]) -> None:
        """Plan `epoch` as the rest after `segments` (none: the whole epoch)."""
        self.resumed = (epoch, tuple(segments)) if segments else None

    def segments(self, epoch: int) -> tuple[Segment, ...]:
        return self.resumed[1] if self.resumed is not None and self.resumed[0] == epoch else ()

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's global order: every sample once, a pure function of (seed, epoch)."""
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + epoch * 1_000_003)
        window = None if self.shards is None else self.shards.window_of(epoch)
        if self.shards is None or window is None or window >= len(self.shards.starts) - 1:
            return torch.randperm(self.n, generator=g)
        # the shards in a seeded random order; each shard's samples spread at random over `window` shards'
        # places from its own: at any point of the epoch about `window` shards are being read, and a cache
        # of that many (and a few to fetch ahead) holds what the order needs
        starts = np.asarray(self.shards.starts, np.int64)
        sizes = np.diff(starts)
        place = torch.empty(len(sizes), dtype=torch.float64)
        place[torch.randperm(len(sizes), generator=g)] = torch.arange(len(sizes), dtype=torch.float64)
        keys = torch.repeat_interleave(place, torch.from_numpy(sizes))
        keys += torch.rand(self.n, generator=g, dtype=torch.float64) * window
        return torch.argsort(keys)

    def _span_sizes(self, m: int, w: int) -> list[int]:
        """The sizes of `w` ranks' spans of `m` samples."""
        if self.drop_last:
            return [m // w] * w
        if self.pad:
            return [-(-m // w)] * w
        return [m // w + (r < m % w) for r in range(w)]

    def _spans(self, sequence: torch.Tensor, world: int) -> list[torch.Tensor]:
        """`sequence` cut into `world` contiguous spans (padded by wrapping where they pad)."""
        sizes = self._span_sizes(len(sequence), world)
        total = sum(sizes)
        if total > len(sequence) and len(sequence):  # wrapped as often as it takes: more ranks than samples
            sequence = sequence.repeat(-(-total // len(sequence)))
        bounds = np.cumsum([0] + sizes)
        spans = [sequence[bounds[r] : bounds[r + 1]] for r in range(world)]
        return spans if self.groups is None else [self._grouped(s) for s in spans]

    def _grouped(self, span: torch.Tensor) -> torch.Tensor:
        """`span` reordered into batches of one group each where it can be (see the module's docstring)."""
        if not len(span):
            return span
        group = self.groups[span.numpy()]  # type: ignore[index]  # (set: _spans calls this only then)
        place = np.arange(len(span))
        done = np.full(len(span), len(span), np.int64)  # where each sample's batch fills; len: never
        for k in np.unique(group):
            at = place[group == k]
            full = len(at) // self.batch_size * self.batch_size
            done[at[:full]] = at[self.batch_size - 1 : full : self.batch_size].repeat(self.batch_size)
        return span[torch.from_numpy(np.lexsort((place, group, done)))]

    def _remaining(self, epoch: int, segments: tuple[Segment, ...]) -> torch.Tensor:
        """The global order of `epoch` without what the `segments` consumed, in order."""
        sequence = self.order(epoch)
        for seg in segments:
            consumed = torch.cat([s[: seg.batches * self.batch_size] for s in self._spans(sequence, seg.world)])
            left = torch.ones(self.n, dtype=torch.bool)
            left[consumed] = False
            sequence = sequence[left[sequence]]
        return sequence

    def shard(self, epoch: int) -> torch.Tensor:
        """This rank's indices for `epoch`, in visiting order (its span, or its span of the rest)."""
        segments = self.segments(epoch)
        sequence = self._remaining(epoch, segments) if segments else self.order(epoch)
        return self._spans(sequence, self.world_size)[self.rank]

    def batches(self, epoch: int, start: int = 0) -> list[torch.Tensor]:
        """Index tensors of this rank's batches in `epoch`, from batch number `start` on."""
        shard = self.shard(epoch)
        count = self._count(len(shard))
        return [shard[b * self.batch_size : (b + 1) * self.batch_size] for b in range(start, count)]
