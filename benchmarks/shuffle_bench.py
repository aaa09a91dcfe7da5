"""How close to a full shuffle is an epoch's order read through a cache holding part of the store?

Orders only, no data: a store of `--n` samples in shards of `--shard` samples, read through a cache
of a `--cache` fraction of the store. Rows: a full shuffle (the reference); gpufeed's shard-aware
order (`ShardedBatchSampler.order`: the shards in a seeded random order, each one's samples spread at
random over the places of `window` shards), with the window its Loader picks for that cache (what it
holds less three shards) and smaller ones, and as its Loader reads a store in a bucket (the span
ordered again to start on one shard and end on its last download alone: `Shards.ramp`); MosaicML streaming's
`py1e` shuffle (its default) with the shuffle block its cache allows; WebDataset's (shards in a random
order, samples through a shuffle buffer of what the cache holds). The last two use the libraries'
own functions where they are installed (`pip install mosaicml-streaming webdataset`), and are left
out otherwise.

The statistics, each 1.0 for a full shuffle and 0 for reading the shards in order:

- **batch mixing**: the mean number of distinct shards in a batch of `--batch`, over what a full
  shuffle gives (the diversity a step's gradient sees);
- **spread**: the mean over shards of the standard deviation of its samples' positions in the
  epoch, over a uniform position's (N/sqrt(12)): how far apart in time one shard's samples fall.

    python benchmarks/shuffle_bench.py --n 1281167 --shard 2300 --cache 0.25 --out shuffle.json
"""

from __future__ import annotations

import importlib
import importlib.machinery
import random
import sys
import types
from pathlib import Path

import numpy as np

import common

SMOKE = dict(n=20_000, shard=500, batch=64)


def mixing(order: np.ndarray, shard_of: np.ndarray, batch: int, shards: int) -> float:
    """Mean distinct shards per batch, over a full shuffle's expectation."""
    n = len(order) // batch * batch
    per = shard_of[order[:n]].reshape(-1, batch)
    per.sort(axis=1)
    distinct = (np.diff(per, axis=1) != 0).sum(axis=1) + 1
    counts = np.bincount(shard_of, minlength=shards).astype(float)
    # a batch of a full shuffle holds shard k with probability 1 - C(N - n_k, B) / C(N, B) ~ 1 - (1 - n_k/N)^B
    expected = (1 - (1 - counts / len(shard_of)) ** batch).sum()
    return float(distinct.mean() / expected)


def spread(order: np.ndarray, shard_of: np.ndarray, shards: int) -> float:
    """Mean over shards of its samples' position std, over a uniform position's."""
    position = np.empty(len(order), np.float64)
    position[order] = np.arange(len(order))
    counts = np.bincount(shard_of, minlength=shards)
    mean = np.bincount(shard_of, weights=position, minlength=shards) / counts
    var = np.bincount(shard_of, weights=position**2, minlength=shards) / counts - mean**2
    return float(np.sqrt(np.maximum(var, 0)).mean() / (len(order) / np.sqrt(12)))


def gpufeed_order(starts: np.ndarray, window: int | None, epoch: int, ramp_batch: int = 0) -> np.ndarray:
    """The global order; `ramp_batch` > 0: the one rank's span of it as a Loader reading a store in a
    bucket orders it again in batches of that many (`Shards.ramp`: it starts on one shard and ends on
    its last download alone)."""
    from gpufeed.loader.sampler import ShardedBatchSampler, Shards

    sampler = ShardedBatchSampler(int(starts[-1]), max(1, ramp_batch), shuffle=True, seed=0, rank=0, world_size=1,
                                  drop_last=False, shards=Shards(starts, window, ramp=ramp_batch > 0))
    return (sampler.shard(epoch) if ramp_batch else sampler.order(epoch)).numpy()


def _library(package: str, module: str):
    """`module` of an installed `package`, loaded without the package's own __init__ (which imports
    torch, cloud clients and more that an order does not need); None where it is not installed."""
    spec = importlib.machinery.PathFinder.find_spec(package)  # not sys.modules: a stub may be there already
    if spec is None or spec.submodule_search_locations is None:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    parts = module.split(".")
    for k in range(1, len(parts)):
        name = ".".join(parts[:k])
        if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
            stub = types.ModuleType(name)
            stub.__path__ = [str(root.joinpath(*parts[1:k]))]
            sys.modules[name] = stub
    return importlib.import_module(module)


def streaming_order(sizes: np.ndarray, block: int, epoch: int) -> np.ndarray | None:
    shuffle = _library("streaming", "streaming.base.shuffle")
    if shuffle is None:
        return None
    return np.asarray(shuffle.get_shuffle("py1e", sizes, 1, 0, epoch, block), np.int64)


def webdataset_order(starts: np.ndarray, buffer: int, epoch: int) -> np.ndarray | None:
    filters = _library("webdataset", "webdataset.filters")
    if filters is None:
        return None
    rng = random.Random(epoch)
    shards = list(range(len(starts) - 1))
    rng.shuffle(shards)
    stream = (i for k in shards for i in range(starts[k], starts[k + 1]))
    return np.fromiter(filters._shuffle(stream, bufsize=buffer, initial=buffer, rng=rng), np.int64, int(starts[-1]))


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=1_281_167, help="samples (ImageNet-1k's train split)")
    p.add_argument("--shard", type=int, default=2_300, help="samples per shard (256 MB of 110 KB JPEGs)")
    p.add_argument("--cache", type=float, default=0.25, help="the cache's size, a fraction of the store")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2, help="epochs whose statistics are averaged")
    a = common.parse(p, argv, SMOKE)
    starts = np.array([*range(0, a.n, a.shard), a.n], np.int64)
    sizes = np.diff(starts)
    shards = len(sizes)
    shard_of = np.repeat(np.arange(shards), sizes)
    cached = max(1, int(shards * a.cache))  # shards the cache holds
    held = -(-5 * a.batch // a.shard) + 1  # the shards the batches in flight read (loader._window)
    window = max(1, cached - 2 - held)  # what gpufeed's Loader picks for that cache
    rows: dict[str, object] = {"full shuffle": lambda e: np.random.default_rng(e).permutation(a.n),
                               "shards in order": lambda e: np.arange(a.n)}
    for w in sorted({1, max(1, window // 4), window}):
        label = f"gpufeed, spread over {w} shards" + (" (its Loader's for this cache)" if w == window else "")
        rows[label] = lambda e, w=w: gpufeed_order(starts, w, e)
    rows[f"gpufeed, spread over {window} shards, from a bucket (each span starts on one shard, ends on its last "
         "download alone)"] = lambda e: gpufeed_order(starts, window, e, a.batch)
    rows[f"MosaicML streaming py1e, block of {cached * a.shard} samples"] = (
        lambda e: streaming_order(sizes, cached * a.shard, e))
    for buffer in (10_000, cached * a.shard):  # its usual buffer (decoded samples in RAM), and the cache's size
        rows[f"WebDataset, shuffled shards, buffer of {buffer} samples"] = (
            lambda e, buffer=buffer: webdataset_order(starts, buffer, e))
    runs, table_rows = [], []
    for name, make in rows.items():
        orders = [make(e) for e in range(a.epochs)]
        if any(o is None for o in orders):
            runs.append({"row": name, "skipped": "the library is not installed"})
            continue
        assert all(np.array_equal(np.sort(o), np.arange(a.n)) for o in orders), name  # every sample once
        mix = [mixing(o, shard_of, a.batch, shards) for o in orders]
        spr = [spread(o, shard_of, shards) for o in orders]
        runs.append({"row": name, "batch_mixing": mix, "spread": spr})
        table_rows.append([name, common.cell(mix, "{:.3f}"), common.cell(spr, "{:.3f}")])
    config = {"samples": a.n, "samples per shard": a.shard, "shards": shards, "cache shards": cached,
              "batch": a.batch, "epochs": a.epochs}
    markdown = common.table(["order", "batch mixing (1 = full shuffle)", "spread (1 = full shuffle)"], table_rows)
    return common.write(a, __file__, runs, markdown, device="cpu", layout=config)


if __name__ == "__main__":
    main()
