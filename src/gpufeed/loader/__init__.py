"""The Loader: an epoch plan per rank, then per batch either a gather of raw rows (gpu, host or disk
tier), a JPEG decode split between GPU and CPU decoders, or a video store's clips decoded on CPU
threads, then the batched augment kernel.
docs/architecture.md draws both paths."""

from gpufeed.loader.batch import Skipped
from gpufeed.loader.clips import Clip
from gpufeed.loader.fields import category_labels, per_image
from gpufeed.loader.loader import Loader
from gpufeed.loader.sampler import ShardedBatchSampler, resolve_rank

__all__ = ["Clip", "Loader", "ShardedBatchSampler", "Skipped", "category_labels", "per_image", "resolve_rank"]
