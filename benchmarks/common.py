"""What every benchmark here shares: its command line's common flags, the machine it ran on, the
median (min-max) cells of its table, and the record it leaves (JSON of every run + a markdown table).

A benchmark measures and writes; nothing here plots. Each script's `main(argv)`:

    p = common.parser(__doc__)            # --out PATH, --smoke
    ...                                   # the script's own flags
    a = common.parse(p, argv, SMOKE)      # --smoke: the script's SMOKE values become the defaults
    ...                                   # measure: a list (or dict) of runs
    common.write(a, "name", runs, table)  # PATH (JSON) and PATH with .md (the table); prints the table

`--smoke` is a run of a few seconds on the CPU (a few tiny images, one or two steps, no DALI) that
takes the code path end to end; tests/test_benchmarks.py runs every benchmark's. Its numbers mean
nothing. Flags given with it still win (`--smoke --device cuda`: the same tiny run on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has: `--out` and `--smoke`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="write every run as JSON here and the table as markdown beside it (.md); default: print only")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny CPU run that takes the code path end to end in seconds (tests/test_benchmarks.py)")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None, smoke: dict) -> argparse.Namespace:
    """`p`'s arguments; with `--smoke`, `smoke`'s values are the defaults (flags given still win)."""
    a = p.parse_args(argv)
    if a.smoke:
        p.set_defaults(**smoke)
        a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


@contextmanager
def workdir(given: str | None, prefix: str):
    """`given` (kept), or a new temporary folder removed afterwards."""
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def machine(device: str = "cuda") -> dict:
    """The machine, the software and the tree a run measured on `device`."""
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "no GPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"device": device, "gpu": gpu, "gpus": torch.cuda.device_count() if cuda else 0, "cpus": os.cpu_count(),
           "usable_cores": cores, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "platform": platform.platform(), **_commit()}
    out["summary"] = (f"{gpu}, {cores} of {os.cpu_count()} cores, torch {torch.__version__}, ran on {device}, "
                      f"commit {out['commit'] or 'unknown'}{' (modified)' if out['modified'] else ''}")
    return out


def _commit() -> dict:
    """This tree's commit and whether tracked files differ from it (None where git can't say)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": None}
    return {"commit": head or None, "modified": bool(changed) if head else None}


def command(script: str, argv: list[str]) -> str:
    """The command line that reproduces a run, from the repository root."""
    return " ".join(["python", f"benchmarks/{Path(script).name}", *argv])


def spread(values: list[float]) -> dict:
    """median, min, max and count of `values` (the figures a table cell shows)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cell(values: list[float], fmt: str = "{:,.0f}") -> str:
    """A table cell: median (min-max) of `values`; the value alone if there is one; '-' if none."""
    s = spread(values)
    if not s["n"]:
        return "-"
    if s["n"] == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; columns of figures (every cell begins with a digit or is '-') right-aligned."""

    def figures(k: int) -> bool:
        return bool(rows) and all(str(line[k])[:1].isdigit() or str(line[k]) == "-" for line in rows)

    align = ["---:" if figures(k) else "---" for k in range(len(header))]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in [header, align, *rows])


class Rows(dict):
    """A benchmark's rows by name, each printed (one JSON line, flushed) as it is set and, with `out`
    (its --out), written there with the rows before it (`"partial": true`; `write` replaces it with
    the whole record): a run cut off by a time limit, or ended by a crash, still leaves the rows it
    finished, in its log and in its JSON."""

    def __init__(self, out: str | None = None, script: str = ""):
        super().__init__()
        self.out, self.script = out, script

    def __setitem__(self, name, row) -> None:
        super().__setitem__(name, row)
        print(f"row {name}: {json.dumps(row, default=str)}", flush=True)
        if self.out:
            out = Path(self.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            partial = {"benchmark": Path(self.script).stem, "partial": True, "runs": dict(self)}
            temp = out.with_name(out.name + ".part")
            temp.write_text(json.dumps(partial, indent=1, default=str) + "\n")
            os.replace(temp, out)


def write(a: argparse.Namespace, script: str, runs, markdown: str, device: str = "cuda", **extra) -> dict:
    """Print `markdown`; with `--out PATH`, write the record (command, machine, date, config, `extra`,
    every run, the table) to PATH as JSON and the command, machine, date and table to PATH with .md."""
    config = {k: v for k, v in vars(a).items() if k not in ("argv", "out")}
    record = {"benchmark": Path(script).stem, "command": command(script, a.argv), "machine": machine(device),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": config, **extra,
              "runs": runs, "table": markdown}
    print(markdown, flush=True)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(f"# {record['benchmark']}\n\n    {record['command']}\n\n"
                                          f"{record['machine']['summary']}, {record['date']}\n\n{markdown}\n")
    return record


def device_ms(fn, device: str, repeats: int) -> list[float]:
    """Milliseconds of fn() for each of `repeats` calls after 3 warm-ups: CUDA events on a GPU (the
    device time of what fn() queues), the wall clock on a CPU."""
    import torch

    times = []
    for _ in range(repeats + 3):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times[3:]


def kernel_ms(fn, repeats: int) -> float:
    """Milliseconds of GPU work (kernels and copies, by torch's profiler) one fn() queues, averaged over
    `repeats` calls after a warm-up: what the device spends, without the host's time between its
    launches (which CUDA events around fn() would count)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / repeats / 1e3
