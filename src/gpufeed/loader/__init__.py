"""The Loader: sampler → gather → pinned ring → side-stream copy → batched augment."""

from gpufeed.loader.loader import Loader
from gpufeed.loader.sampler import ShardedBatchSampler, resolve_rank

__all__ = ["Loader", "ShardedBatchSampler", "resolve_rank"]
