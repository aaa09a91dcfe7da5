"""Where a CPU decode worker's start goes (issue 65): a fresh Loader's workers said Ready 0.4-0.6 s
after they were spawned, most of it before their `main` ran, and the first batch waited for them.

Each row starts `--at-once` interpreters together from this process and times, per child, from just
before its `subprocess.Popen` to the end of what it runs (it prints `time.perf_counter()`, which is
system-wide on Linux), and in the parent how long the `Popen` calls themselves took:

- `-S -c pass`: the interpreter alone, without `site` (its .pth files);
- `-c pass`: with `site`;
- `-c "import numpy"`;
- `-c "import gpufeed.decode.pool.worker"`: what a worker imports before its `main`;
- the same with `pixels` too (`gpufeed.decode.codecs.pixels`, what it imports in `main`);
- a pool of decode workers started as a Loader starts them, each to its `Ready` heard, with its start's
  steps (to `main`, imports, decoder, heard), as `folder_bench` gives them.

Rows run with `--at-once` 1 and the process's cores, first before this process makes its CUDA
context and again after it (`--device cuda`: a parent holding a GPU context may spawn more slowly).
Each cell: median (min-max) over the children of `--repeats` rows.

    python benchmarks/worker_start_bench.py --repeats 3 --out worker_start.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import common

SMOKE = dict(repeats=1, at_once="1,2", device="cpu")  # (a --smoke: tests/test_benchmarks.py)
CODE = {
    "interpreter, no site (-S)": ["-S", "-c", "import time; print(time.perf_counter())"],
    "interpreter": ["-c", "import time; print(time.perf_counter())"],
    "import numpy": ["-c", "import time, numpy; print(time.perf_counter())"],
    "a worker's imports before main": [
        "-c",
        "import time, gpufeed.decode.pool.worker; print(time.perf_counter())",
    ],
    "... and pixels (main's)": [
        "-c",
        "import time, gpufeed.decode.pool.worker, gpufeed.decode.codecs.pixels; print(time.perf_counter())",
    ],
}


def start(args: list[str], at_once: int) -> dict:
    """`at_once` children of `args` started together: each one's seconds from before its Popen to its
    print, and the Popen calls' own seconds."""
    from gpufeed.processes import child_env

    env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # a decode worker's, as `spawn.start` gives it
    begun, spawn, procs = [], [], []
    for _ in range(at_once):
        t = time.perf_counter()
        procs.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, env=env, close_fds=True))
        begun.append(t)
        spawn.append(time.perf_counter() - t)
    ends = []
    for p, t in zip(procs, begun):
        out, _ = p.communicate()
        ends.append(float(out.split()[-1]) - t)
    return {"child_s": ends, "popen_s": spawn}


def pool(n: int, repeats: int) -> dict:
    """`n` decode workers started as a Loader starts them (`DecodeWorkers`, a pool of its own each time):
    each one's seconds from the pool's making to its `Ready` heard, and its start's steps
    (`DecodeWorkers.start_seconds`: to its `main`, imports, its decoder made, heard)."""
    from gpufeed.decode.pool import shared
    from gpufeed.decode.pool.workers import DecodeWorkers

    ready, steps = [], []
    for _ in range(repeats):
        shared.stop_idle()  # (a pool left idle would be taken as it is)
        t = time.perf_counter()
        workers = DecodeWorkers(None, n, files=[])
        workers.wait_ready(60)
        ready += [r - t for r in workers.ready_times]
        steps.append(workers.start_seconds())
        workers.close()
    shared.stop_idle()
    return {"child_s": ready, "popen_s": [], "steps": steps}


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--at-once", default="", help="children started together (comma-separated; default: 1 and the cores)"
    )
    p.add_argument("--device", default="cuda")
    a = common.parse(p, argv, SMOKE)
    cores = len(os.sched_getaffinity(0))
    widths = [int(x) for x in a.at_once.split(",")] if a.at_once else [1, cores]
    rows = common.Rows(a.out, __file__)
    for phase in ["before the CUDA context"] + (["after the CUDA context"] if a.device != "cpu" else []):
        if phase.startswith("after"):
            import torch

            torch.zeros(1, device=a.device)
            torch.cuda.synchronize(a.device)
        for name, args in CODE.items():
            for n in widths:
                runs = [start(args, n) for _ in range(a.repeats)]
                rows[f"{name}, {n} at once, {phase}"] = {
                    "child_s": [s for r in runs for s in r["child_s"]],
                    "popen_s": [s for r in runs for s in r["popen_s"]],
                }
        for n in widths:
            rows[f"a pool of {n} decode workers, each to its Ready heard, {phase}"] = pool(n, a.repeats)
    lines = [
        [name, common.cell(r["child_s"], "{:.3f}"), f"{max(r['child_s']):.3f}", common.cell(r["popen_s"], "{:.4f}")]
        for name, r in rows.items()
    ]
    header = ["start", "child s", "slowest child s", "its Popen s"]
    markdown = f"{cores} cores, {a.repeats} repeats\n\n" + common.table(header, lines)
    for name, r in rows.items():
        if r.get("steps"):
            steps = "; ".join(", ".join(f"{k} {v:.3f}" for k, v in step.items()) for step in r["steps"])
            markdown += f"\n\n{name}: a worker's start in steps, s (median over the workers, by repeat): {steps}"
    return common.write(a, __file__, dict(rows), markdown, a.device, cores=cores)


if __name__ == "__main__":
    main()
