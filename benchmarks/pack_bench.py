"""Pack throughput (raw `--side`² from ~500x375 JPEGs) by number of worker processes: 1, 2, 4, ...
up to the usable cores, each `--repeats` times (the table: median (min-max) img/s).

    python benchmarks/pack_bench.py --n 2000 --out pack.json
"""

from __future__ import annotations

import os
from pathlib import Path

import common

SMOKE = dict(n=8, image="64x48", side=32, repeats=1, max_workers=2, workdir=None)


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=2000, help="generated images (4 classes)")
    p.add_argument("--image", default="500x375", help="generated images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--side", type=int, default=256, help="the raw store's side")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=None, help="default: the usable cores")
    p.add_argument("--workdir", default=None, help="where the images and stores are written (default: a temp dir)")
    a = common.parse(p, argv, SMOKE)
    import gpufeed
    from gpufeed.synth import make_image_folder

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    counts = [w for w in (2**k for k in range(12)) if w <= (a.max_workers or cores)]
    runs = {w: [] for w in counts}
    with common.workdir(a.workdir, "gpufeed-pack-") as work:
        width, height = (int(x) for x in a.image.split("x"))
        make_image_folder(work / "images", per_class=max(1, a.n // 4), classes=4, width=width, height=height)
        for _ in range(a.repeats):
            for workers in counts:
                r = gpufeed.pack(work / "images", Path(work) / "store", size=a.side, workers=workers, progress=False,
                                 overwrite=True)
                runs[workers].append({"img_per_s": r.images_per_s, "seconds": r.seconds, "images": r.count})
                print(f"{workers:3d} workers: {r.images_per_s:8.0f} img/s ({r.seconds:.2f} s)", flush=True)
    lines = [[w, common.cell([r["img_per_s"] for r in rs]), common.cell([r["seconds"] for r in rs], "{:.2f}")]
             for w, rs in runs.items()]
    markdown = common.table(["workers", "img/s", "seconds"], lines)
    return common.write(a, __file__, runs, markdown, "cpu", images=a.n, usable_cores=cores)


if __name__ == "__main__":
    main()
