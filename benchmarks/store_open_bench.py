"""What opening a store costs with its per-sample arrays range-checked: a jpeg store of `--n`
samples (one byte of "image" each, so it is quick to make) opened `--repeats` times.

    PYTHONPATH=src python benchmarks/store_open_bench.py --n 1000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import gpufeed
from gpufeed.store import format as fmt


def make(root: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    arrays = {fmt.JPEG_DATA: np.zeros(n, np.uint8), fmt.JPEG_OFFSETS: np.arange(n + 1, dtype="<i8"),
              fmt.JPEG_SHAPES: rng.integers(100, 500, (n, 2)).astype("<i4"),
              fmt.LABELS: rng.integers(0, 1000, n).astype("<i8")}
    files = {}
    for name, array in arrays.items():
        array.tofile(root / name)
        files[name] = {"bytes": array.nbytes, "digest": "not computed"}
    fmt.Manifest("jpeg", n, None, [f"c{k}" for k in range(1000)], files).write(root)
    return root


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = make(Path(d), a.n)
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            gpufeed.open(root)
            times.append(time.perf_counter() - t)
    print(f"open of a {a.n:,}-sample jpeg store: " + ", ".join(f"{1e3 * t:.1f}" for t in times) + " ms")


if __name__ == "__main__":
    main()
