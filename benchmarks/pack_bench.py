"""Pack throughput (raw 256 from ~500x375 JPEGs) by number of worker processes.

    PYTHONPATH=src python benchmarks/pack_bench.py --n 2000 --out pack.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import gpufeed
from gpufeed.synth import make_image_folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--dest", default=None, help="where stores are written (default: a temp dir)")
    p.add_argument("--out", default="pack_bench.json")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufeed-pack-"))
    dest = Path(a.dest or work)
    make_image_folder(work / "images", per_class=a.n // 4, classes=4)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    result = {"cpu_count": os.cpu_count(), "usable_cores": cores, "images": a.n, "by_workers": {}}
    workers = 1
    while workers <= cores:
        r = gpufeed.pack(work / "images", dest / "store", size=256, workers=workers, progress=False, overwrite=True)
        result["by_workers"][workers] = {"img_per_s": r.images_per_s, "seconds": r.seconds}
        print(f"{workers:3d} workers: {r.images_per_s:8.0f} img/s ({r.seconds:.2f} s)", flush=True)
        workers *= 2
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
