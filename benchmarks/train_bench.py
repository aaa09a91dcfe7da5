"""Training throughput fed by each loader, against a synthetic-data ceiling, in one call.

A torchvision ResNet (random init, bf16 autocast, channels_last, SGD with momentum, batch 256) is
trained for `--steps` steps after `--warmup` steps, fed by each row (feeds.py: `synthetic`, the
ceiling; `raw`; `jpeg`, whose `jpeg:KEY=VALUE,...` settings are Loader arguments or fields of
`gpufeed.decode.tuning.Tuning`, e.g. `jpeg:pipelines=2,gpu_min=0.3`, or `policy=randaugment`;
`dataloader`; `dali` where nvidia-dali is installed). Each row runs in a process of its own, and
the rows are interleaved over `--rounds` rounds, so host drift hits every row alike.

    python benchmarks/train_bench.py --n 10000 --models resnet18,resnet50 --rounds 3 --out train.json

Per row (the table: median (min-max) over rounds): img/s, % of the same round's ceiling, seconds
from the row's construction returning to its first batch, GPU memory in use (the whole device, so
other processes' contexts count), CPU cores used, and the training thread's time per step waiting
for data and launching the step. The JSON also has each step's wait, the loader's counters over the
timed steps, and what the training process's threads waited for (waits.py: the garbage collector,
each thread's time on a CPU and in the run queue, the kernel's counters; `--pyspy`: py-spy's GIL
samples, `--pyspy native` the training thread's native stacks).

`--workdir` keeps the generated images and stores (made there if missing, reused after: start_bench.py
reads the same ones).

`--baseline SRC` (another tree's `src`, e.g. of `git worktree add /tmp/old COMMIT`): each gpufeed
row (raw, jpeg, sharded) runs again as `ROW @baseline` with that tree's gpufeed, from stores that
tree packs of the same images (`WORKDIR/baseline`), interleaved with the rest: a change's before
and after in one call. The baseline must take the same Loader arguments as the rows give.

    python benchmarks/train_bench.py --models resnet18 --rows "synthetic;jpeg" --baseline /tmp/old/src
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import feeds
import waits

SMOKE = dict(n=40, image="64x48", size=32, models="resnet18", rounds=1, steps=2, warmup=1, batch=4, device="cpu",
             rows="synthetic;raw;jpeg:pipelines=1;sharded:pipelines=1;folder:num_workers=0;dataloader:workers=0",
             workdir=None, in_process=True)


def parser():
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=10000, help="generated images (made once per --workdir)")
    p.add_argument("--image", default="500x375", help="--data smooth: the images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--data", choices=feeds.DATA, default="photos",
                   help="photos: photo-like JPEGs of ImageNet's spread of sizes and qualities (photos.py); "
                        "smooth: generated --image-sized q90 ones")
    p.add_argument("--size", type=int, default=224, help="the crop's side (the raw store is packed at size*8/7)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpufeed-train-bench"))
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--rows", default="synthetic;raw;jpeg;dataloader;dali", help="rows, separated by ;")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--pyspy", nargs="?", const="gil", choices=tuple(waits.PYSPY_RATES),
                   help="sample the GIL holders with py-spy (on PATH); `native`: every thread's native stacks; "
                        "`gilnative`: the GIL holders' native frames too")
    p.add_argument("--pyspy-rate", type=int, default=0, help="py-spy's samples per second (default: by mode)")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run every row in this process (--smoke; the rows' figures then disturb each other)")
    p.add_argument("--baseline", default=None, metavar="SRC",
                   help="also each gpufeed row with the gpufeed of this other tree's src (ROW @baseline)")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict | None:
    a = common.parse(parser(), argv, SMOKE)
    if a.row:  # one row, in the process train_bench started for it
        print("RESULT " + json.dumps(run_row(a, Path(a.workdir))), flush=True)
        return None
    for row in a.rows.split(";"):
        feeds.check(row)
    with common.workdir(a.workdir, "gpufeed-train-bench-") as work:
        width, height = (int(x) for x in a.image.split("x"))
        rows = a.rows.split(";")
        feeds.prepare(work, a.n, (width, height), round(a.size * 8 / 7), feeds.wants_sharded(rows), a.data)
        if not feeds.has_dali() or not a.device.startswith("cuda"):
            rows = [r for r in rows if not r.startswith("dali")]
            print("nvidia-dali not installed or no GPU: no dali row", flush=True)
        if a.baseline:
            if not (Path(a.baseline) / "gpufeed" / "__init__.py").is_file():
                raise SystemExit(f"--baseline {a.baseline}: not a tree's src folder (no gpufeed/__init__.py in it)")
            ours = [r for r in rows if r.partition(":")[0] in feeds.GPUFEED_ROWS]
            _pack_baseline(a, work, [r for r in ours if r.partition(":")[0] in feeds.STORE_ROWS])
            rows += [r + BASELINE for r in ours]
        runs = []
        for r in range(a.rounds):
            for model in a.models.split(","):
                for row in rows if r % 2 == 0 else rows[::-1]:
                    res = _run(a, work, row, model)
                    if res is not None:
                        runs.append(res | {"round": r})
                        print(json.dumps({k: v for k, v in res.items() if not isinstance(v, (dict, list))}), flush=True)
        return common.write(a, __file__, runs, summarize(runs), a.device, images=a.n, data=feeds.described(work))


BASELINE = " @baseline"


def _baseline_env(src: str) -> dict:
    """This environment with `src` (the baseline tree's) first on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), *([path] if path else [])])}


def _pack_baseline(a, work: Path, rows: list[str]) -> None:
    """The stores `rows` read, packed by the baseline tree's gpufeed from the same images into
    `work`/baseline (each only if missing) as `prepare` packs this tree's, in a process of its own."""
    raw_side = round(a.size * 8 / 7)
    names = sorted({r.partition(":")[0] for r in rows})
    code = "import gpufeed\n" + "".join(
        f"gpufeed.pack({str(work / 'images')!r}, {str(work / 'baseline' / n)!r}, progress=False, "
        f"**{feeds.pack_settings(n, raw_side)!r})\n"
        for n in names if not (work / "baseline" / n).exists())
    (work / "baseline").mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-c", code], env=_baseline_env(a.baseline), check=True)


def _run(a, work: Path, row: str, model: str) -> dict | None:
    """One row with one model: in a process of its own (or this one, `--in-process`); None if it failed.
    A `BASELINE` row runs with the baseline tree's gpufeed on its stores."""
    baseline = row.endswith(BASELINE)
    if a.in_process and not baseline:
        one = argparse.Namespace(**vars(a) | {"row": row, "model": model})
        return run_row(one, work)
    given = row.removesuffix(BASELINE)
    cmd = [sys.executable, __file__, "--row", given, "--model", model, "--workdir",
           str(work / "baseline" if baseline else work), "--device", a.device,
           "--size", str(a.size), "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch)]
    cmd += ["--pyspy", a.pyspy, "--pyspy-rate", str(a.pyspy_rate)] if a.pyspy else []
    env = _baseline_env(a.baseline) if baseline else None
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    result = [ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not result:
        print(f"{model} {row}: FAILED\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(result[0]) | {"row": row}


def run_row(a, work: Path) -> dict:
    """One row: build the model's step and the row's feed, time its first batch, train, measure."""
    import torch

    import gpufeed
    from gpufeed.bench.common import sync
    from gpufeed.bench.training import training_step

    torch.backends.cudnn.benchmark = True
    step = training_step(a.model, a.device, 1000)
    sync(a.device)
    feed = feeds.feed(a.row, work, a.batch, a.device, a.size)
    try:
        return _train(a, step, feed) | {"gpufeed": str(Path(gpufeed.__file__).parent)}  # (which tree's)
    finally:
        feed.close()


def _train(a, step, feed: feeds.Feed) -> dict:
    """Time the first batch, warm up, time `a.steps` steps."""
    import torch

    from gpufeed.bench.common import cpu_seconds, sync

    t0 = time.perf_counter()
    images, labels = next(feed.batches)
    sync(a.device)
    first = time.perf_counter() - t0
    step(images, labels)
    for _ in range(a.warmup):
        step(*next(feed.batches))
    sync(a.device)
    if feed.loop.get("gc") == "freeze":
        gc.freeze()
    watch = waits.Watch(a.pyspy, max(2, int(a.steps * a.batch / 8000)), a.pyspy_rate)
    before = feed.stats()
    wait = launch = 0.0
    each = []
    c0, w0 = cpu_seconds(), time.perf_counter()
    for _ in range(a.steps):
        s0 = time.perf_counter()
        images, labels = next(feed.batches)
        s1 = time.perf_counter()
        loss = step(images, labels)
        s2 = time.perf_counter()
        wait, launch = wait + s1 - s0, launch + s2 - s1
        each.append(s1 - s0)
    loss.item()
    sync(a.device)
    wall = time.perf_counter() - w0
    cores = (cpu_seconds() - c0) / wall
    used = None
    if a.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 1e9
    out = {"row": a.row, "model": a.model, "img_per_s": a.steps * a.batch / wall, "build_s": feed.build_s,
           "first_batch_s": first, "gpu_used_gb": used, "cpu_cores": cores,
           "wait_ms_per_step": 1e3 * wait / a.steps, "launch_ms_per_step": 1e3 * launch / a.steps,
           "wait_ms_per_step_each": [round(1e3 * w, 2) for w in each], **watch.stop(a.steps, wall)}
    if before is not None:  # the loader's counters over the timed steps (decoders, per-stage seconds, ...)
        after = {k: v for k, v in feed.stats().items() if k != "bytes"}
        out["loader"] = _delta(after, before) | {"decoder_rates": after.get("decoder_rates")}  # rates: averages
    return out


def _delta(after, before):
    """`after` with every number that `before` also holds at the same place made the difference."""
    if isinstance(after, dict):
        return {k: _delta(v, before.get(k) if isinstance(before, dict) else None) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def summarize(runs: list[dict]) -> str:
    """Per model and row, median (min-max) over rounds: img/s, % of the same round's ceiling, ..."""
    ceiling = {(r["model"], r["round"]): r["img_per_s"] for r in runs if r["row"] == "synthetic"}
    lines = []
    for model, row in dict.fromkeys((r["model"], r["row"]) for r in runs):
        mine = [r for r in runs if (r["model"], r["row"]) == (model, row)]
        pct = [100 * r["img_per_s"] / ceiling[(model, r["round"])] for r in mine if (model, r["round"]) in ceiling]
        lines.append([model, row, common.cell([r["img_per_s"] for r in mine]), common.cell(pct, "{:.1f}"),
                      *(common.cell([r[k] for r in mine], "{:.1f}") for k in
                        ("first_batch_s", "gpu_used_gb", "cpu_cores", "wait_ms_per_step", "launch_ms_per_step"))])
    return common.table(["model", "row", "img/s", "% of ceiling", "first batch s", "GPU GB", "CPU cores",
                         "wait ms/step", "launch ms/step"], lines)


if __name__ == "__main__":
    main()
