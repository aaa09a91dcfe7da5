"""A batch on its way to the consumer, as the feeds make it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpufeed.augment.params import Params


@dataclass(frozen=True)
class Skipped:
    """A sample an evaluation pass left out because no decoder could read it: its store index, where it
    came from (a path, or `shard.tar:key`; "" where the store doesn't know) and why."""

    sample: int
    source: str
    reason: str


@dataclass
class Batch:
    """What the consumer turns into (images, labels): pixels are `images`, or `images[index]` (a
    fused gather reads the store's rows itself); `final`: already augmented (jpeg stores)."""

    images: torch.Tensor
    labels: torch.Tensor
    params: Params | None
    index: torch.Tensor | None = None
    final: bool = False
    samples: torch.Tensor | np.ndarray | None = None  # host: the store index of each sample, for fields
    skipped: tuple[Skipped, ...] = ()  # evaluation: the samples of this batch left out (undecodable)
    # a sharded store's shards the samples were read from, as opened then (number -> shard): the fields
    # are read from them (`ShardedStore.pinned`), not from a remote store's cache, which may have let go
    shards: Mapping[int, Any] | None = None
    clips: Any = None  # a video batch's clips (`loader.video.ClipBatch`): their videos, frames, indexes
