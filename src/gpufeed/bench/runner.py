"""`gpufeed bench`: run experiments, keep results.json, then the plot step."""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gpufeed.bench import decoders, dtypes, loaders, training, transfer
from gpufeed.bench.common import Context, Skipped
from gpufeed.bench.plots import plot
from gpufeed.logs import logger

log = logger(__name__)
EXPERIMENTS = {
    "transfer": transfer.run,
    "dtype": dtypes.run,
    "decoders": decoders.run,
    "loaders": loaders.run,
    "training": training.run,
}


def machine(device: str) -> dict:
    gpu = torch.cuda.get_device_name() if device == "cuda" else "no GPU"
    return {
        "summary": f"{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "gpu": gpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def run_bench(
    names: list[str] | None = None, out: str | Path = "gpufeed-bench", quick: bool = False, device: str | None = None
) -> dict:
    """Run the named experiments (all by default), merge them into out/results.json, plot them."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but CUDA is not available here")
    unknown = set(names or []) - set(EXPERIMENTS)
    if unknown:
        raise ValueError(f"unknown experiment(s) {sorted(unknown)}: choose from {', '.join(EXPERIMENTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"experiments": {}}
    results.update(machine=machine(device), command=" ".join(["gpufeed", "bench", *sys.argv[2:]]))
    ctx = Context(device, quick, out / "work")
    for name in names or list(EXPERIMENTS):
        log.info("bench %s (%s%s) ...", name, device, ", quick" if quick else "")
        t0 = time.perf_counter()
        entry: dict[str, Any]
        try:
            entry = {"figures": [f.as_dict() for f in EXPERIMENTS[name](ctx)]}
        except Skipped as e:
            entry = {"skipped": str(e)}
            log.info("  skipped: %s", e)
        except Exception as e:  # noqa: BLE001  one broken experiment must not lose the others' results
            entry = {"failed": f"{type(e).__name__}: {e}"}
            log.error("  %s FAILED: %s", name, entry["failed"])
        finally:
            gc.collect()  # shut down the DataLoader workers an experiment kept alive
        entry.update(seconds=time.perf_counter() - t0, device=device, quick=quick)
        results["experiments"][name] = entry
        path.write_text(json.dumps(results, indent=1))
    pngs = plot(out)
    log.info("results: %s; %d plot(s) and summary.md in %s", path, len(pngs), out)
    return results
