"""How long a Loader takes to start, each run in a fresh process: importing torch and making the CUDA
context, `Loader(...)` (the constructor), its first batch, and the GPU memory then in use. A run
imports torch, makes the context, builds feeds.py's row (`--row`, default `jpeg`: the jpeg store
with train_bench's recipe) and takes one batch; it also says whether it imported torchvision or
nvImageCodec's Python module (each costs seconds of a start). The table: median (min-max) over
`--repeats` processes. `--profile N` also gives each start's N functions of most seconds within
`Loader(...)` (where a fresh process's constructor spends 0.4 s where a warm one's spends 0.07).

    python benchmarks/start_bench.py --workdir /tmp/tb10 --repeats 3 --out start.json

`--workdir` holds train_bench's images and stores (made there if missing, with `--n` images).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import feeds

SMOKE = dict(n=20, image="64x48", size=32, batch=4, device="cpu", repeats=1, workdir=None, in_process=True, profile=5)
STEPS = ("torch_and_context_s", "loader_s", "first_batch_s", "gpu_used_gb")


def one(a, work: Path) -> dict:
    """This process: the seconds of each step of a start."""
    t0 = time.perf_counter()
    import torch

    from gpufeed.bench.common import sync

    torch.zeros(1, device=a.device)
    sync(a.device)
    profile = cProfile.Profile() if a.profile else None
    if profile is not None:  # the constructor's own work, not the imports of gpufeed's loader modules
        import gpufeed.loader  # noqa: F401
    t1 = time.perf_counter()
    if profile is not None:
        profile.enable()
    feed = feeds.feed(a.row, work, a.batch, a.device, a.size)
    t2 = time.perf_counter()
    if profile is not None:
        profile.disable()
    next(feed.batches)
    sync(a.device)
    t3 = time.perf_counter()
    used = None
    if a.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 1e9
    feed.close()
    return {"torch_and_context_s": t1 - t0, "loader_s": t2 - t1, "first_batch_s": t3 - t2, "gpu_used_gb": used,
            "imported_torchvision": "torchvision" in sys.modules,
            "imported_nvimgcodec_module": "nvidia.nvimgcodec" in sys.modules,
            "profile": _top(profile, a.profile) if profile is not None else None}


def _top(profile: cProfile.Profile, n: int) -> list[tuple[str, float, float]]:
    """The constructor's `n` functions of most cumulative seconds on its own thread (waits included:
    cProfile's clock is the wall's): (file:line(function), cumulative s, own s)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [(f"{Path(f).name}:{line}({name})", ct, tt) for (f, line, name), (_, _, tt, ct, _) in stats.items()]
    return [(where, round(ct, 4), round(tt, 4)) for where, ct, tt in sorted(rows, key=lambda r: -r[1])[:n]]


def main(argv: list[str] | None = None) -> dict | None:
    p = common.parser(__doc__)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpufeed-train-bench"))
    p.add_argument("--n", type=int, default=10000, help="images, if the stores are made here")
    p.add_argument("--image", default="500x375", help="--data smooth: the images' WIDTHxHEIGHT, if made here")
    p.add_argument("--data", choices=feeds.DATA, default="photos",
                   help="photos: photo-like JPEGs of ImageNet's spread of sizes and qualities (photos.py); "
                        "smooth: generated --image-sized q90 ones")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's side")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--row", default="jpeg", help="feeds.py's row: jpeg, raw, jpeg:KEY=VALUE,...")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=False,
                   help="start in this process (--smoke: torch is imported already, so its figures mean little)")
    p.add_argument("--profile", type=int, default=0,
                   help="also profile each start's Loader(...) on its thread (cProfile) and keep its N functions of"
                        " most cumulative seconds (in the JSON and printed after the table); gpufeed's loader"
                        " modules are then imported before the Loader(...) timer")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = common.parse(p, argv, SMOKE)
    if a.one:
        print("RESULT " + json.dumps(one(a, Path(a.workdir))), flush=True)
        return None
    feeds.check(a.row)
    with common.workdir(a.workdir, "gpufeed-start-") as work:
        width, height = (int(x) for x in a.image.split("x"))
        feeds.prepare(work, a.n, (width, height), round(a.size * 8 / 7), feeds.wants_sharded([a.row]), a.data)
        runs = []
        for _ in range(a.repeats):
            if a.in_process:
                runs.append(one(a, work))
            else:
                cmd = [sys.executable, __file__, "--one", "--workdir", str(work), "--device", a.device, "--row", a.row,
                       "--size", str(a.size), "--batch", str(a.batch), "--profile", str(a.profile)]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                result = [ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                if not result:
                    print(f"FAILED\n{done.stderr[-3000:]}", flush=True)
                    continue
                runs.append(json.loads(result[0]))
            print(json.dumps(runs[-1]), flush=True)
    lines = [[a.row, *(common.cell([r[k] for r in runs], "{:.2f}") for k in STEPS),
              "yes" if any(r["imported_torchvision"] for r in runs) else "no",
              "yes" if any(r["imported_nvimgcodec_module"] for r in runs) else "no"]]
    markdown = common.table(["row", "torch + context s", "Loader(...) s", "first batch s", "GPU GB",
                             "torchvision imported", "nvImageCodec module imported"], lines)
    for k, r in enumerate(runs):
        if r.get("profile"):
            markdown += f"\n\nLoader(...) of start {k}, cumulative s (own s):\n" + "\n".join(
                f"- {where}: {ct:.3f} ({tt:.3f})" for where, ct, tt in r["profile"])
    return common.write(a, __file__, runs, markdown, a.device)


if __name__ == "__main__":
    main()
