"""Experiment 4: the loaders end to end on the same data: img/s vs batch size."""

from __future__ import annotations

import gc
import time

from gpufeed.bench.common import Context, Figure, sync
from gpufeed.bench.feeders import dataset, feeders


def run(ctx: Context) -> list[Figure]:
    root = dataset(ctx)
    fig = Figure(
        "loaders",
        f"Loaders end to end on {ctx.device} (RandomResizedCrop + flip + normalize)",
        "batch size",
        "images/s",
    )
    for batch in [32] if ctx.quick else [32, 64, 128, 256]:
        feeds = feeders(ctx, root, batch)
        for name, epoch in feeds.items():
            samples = []
            for rep in range(ctx.repeats() + 1):  # the first pass warms workers and caches up
                t0, n = time.perf_counter(), 0
                for images, _ in epoch():
                    n += len(images)
                sync(ctx.device)
                if rep:
                    samples.append(n / (time.perf_counter() - t0))
            fig.line(name).add(batch, samples)
        del feeds  # the DataLoaders' persistent workers go with them
        gc.collect()
    return [fig]
