"""What opening a store costs with its per-sample arrays range-checked: a jpeg store of `--n`
samples (one byte of "image" each, so it is quick to make) opened once (imports included, in the
JSON) and then `--repeats` times (the table: median (min-max) ms).

With `--shard-size`, the store is sharded instead (packed from 8x8 JPEGs, shards of that size), and
a Loader over it (CPU, RandomResizedCrop, shuffled) is timed too: its construction and the plans of
epochs 0-3, with the process's resident memory after each (flat: nothing kept per epoch).

    python benchmarks/store_open_bench.py --n 1000000 --out store_open.json
    python benchmarks/store_open_bench.py --n 1000000 --shard-size 1MB --out sharded_open.json
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import common

SMOKE = dict(n=1000, repeats=2, shard_size="8KB")


def make(root: Path, n: int) -> Path:
    """A jpeg store of `n` one-byte samples with random shapes and labels, written straight in the
    store's format (no JPEGs, no pack)."""
    from gpufeed.store import format as fmt

    rng = np.random.default_rng(0)
    arrays = {fmt.JPEG_DATA: np.zeros(n, np.uint8), fmt.JPEG_OFFSETS: np.arange(n + 1, dtype="<i8"),
              fmt.JPEG_SHAPES: rng.integers(100, 500, (n, 2)).astype("<i4"),
              fmt.LABELS: rng.integers(0, 1000, n).astype("<i8"),
              fmt.SOURCES: np.zeros(0, np.uint8), fmt.SOURCE_OFFSETS: np.zeros(n + 1, "<i8")}  # no sources
    files = {}
    for name, array in arrays.items():
        array.tofile(root / name)
        files[name] = {"bytes": array.nbytes, "digest": "not computed"}
    fmt.Manifest("jpeg", n, None, [f"c{k}" for k in range(1000)], files).write(root)
    return root


def make_sharded(root: Path, n: int, shard_size: str) -> Path:
    """A sharded jpeg store of `n` 8x8 JPEGs (labels 0-999), packed in shards of `shard_size`."""
    import io

    from PIL import Image

    import gpufeed

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 100, np.uint8)).save(buf, "JPEG", quality=90)
    tiny = buf.getvalue()

    class Tiny:
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            return {"image": tiny, "label": i % 1000}

    gpufeed.pack(Tiny(), root / "store", mode="jpeg", reencode=False, shard_size=shard_size, progress=False)
    return root / "store"


def rss_mb() -> float:
    """This process's resident memory, MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def loader_costs(root: Path) -> dict:
    """A Loader over the store: its construction and the plans of epochs 0-3, seconds and RSS after each."""
    import gpufeed
    from gpufeed.augment import RandomResizedCrop

    out = {"rss_before_mb": rss_mb()}
    t = time.perf_counter()
    loader = gpufeed.Loader(root, batch_size=256, device="cpu", augment=[RandomResizedCrop(224)], num_workers=1)
    out["construct_s"], out["rss_constructed_mb"] = time.perf_counter() - t, rss_mb()
    for epoch in range(4):
        t = time.perf_counter()
        loader.plan(epoch, 0)
        out[f"plan_{epoch}_s"], out[f"rss_plan_{epoch}_mb"] = time.perf_counter() - t, rss_mb()
    loader.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=1_000_000, help="samples")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shard-size", default=None, help="pack the store sharded, in shards of this size (e.g. 1MB)")
    a = common.parse(p, argv, SMOKE)
    import gpufeed

    loader = None
    with common.workdir(None, "gpufeed-store-open-") as d:
        root = make_sharded(d, a.n, a.shard_size) if a.shard_size else make(d, a.n)
        t = time.perf_counter()
        gpufeed.open(root)  # the first open imports the reader's modules: not one of the repeats
        first = time.perf_counter() - t
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            gpufeed.open(root)
            times.append(time.perf_counter() - t)
        shards = len(gpufeed.open(root).manifest.shards)
        if a.shard_size:
            loader = loader_costs(root)
    markdown = common.table(["samples", "shards", "open ms", "each"],
                            [[f"{a.n:,}", f"{shards:,}", common.cell([1e3 * t for t in times], "{:.1f}"),
                              ", ".join(f"{1e3 * t:.1f}" for t in times)]])
    if loader is not None:
        print(", ".join(f"{k} {v:.3f}" for k, v in loader.items()))
    return common.write(a, __file__, {"open_s": times}, markdown, "cpu", samples=a.n, shards=shards,
                        first_open_s=first, loader=loader)


if __name__ == "__main__":
    main()
