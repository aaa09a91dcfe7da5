"""What opening a store costs with its per-sample arrays range-checked: a jpeg store of `--n`
samples (one byte of "image" each, so it is quick to make) opened once (imports included, in the
JSON) and then `--repeats` times (the table: median (min-max) ms).

    python benchmarks/store_open_bench.py --n 1000000 --out store_open.json
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import common

SMOKE = dict(n=1000, repeats=2)


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


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=1_000_000, help="samples")
    p.add_argument("--repeats", type=int, default=5)
    a = common.parse(p, argv, SMOKE)
    import gpufeed

    with common.workdir(None, "gpufeed-store-open-") as d:
        root = make(d, a.n)
        t = time.perf_counter()
        gpufeed.open(root)  # the first open imports the reader's modules: not one of the repeats
        first = time.perf_counter() - t
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            gpufeed.open(root)
            times.append(time.perf_counter() - t)
    markdown = common.table(["samples", "open ms", "each"],
                            [[f"{a.n:,}", common.cell([1e3 * t for t in times], "{:.1f}"),
                              ", ".join(f"{1e3 * t:.1f}" for t in times)]])
    return common.write(a, __file__, {"open_s": times}, markdown, "cpu", samples=a.n, first_open_s=first)


if __name__ == "__main__":
    main()
