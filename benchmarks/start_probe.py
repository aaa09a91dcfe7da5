"""How long a jpeg Loader takes to start: `Loader(...)` and its first batch, each run in a fresh
process (a script that imports torch, makes the CUDA context, then builds the Loader with the
training recipe of benchmarks/train_bench.py and takes one batch). Also says whether the run
imported torchvision or nvImageCodec's Python module (each costs seconds of a start).

    PYTHONPATH=src python benchmarks/start_probe.py --workdir /tmp/tb10 --repeats 3

`--workdir` holds train_bench's stores (`jpeg/`), made there if missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE), str(HERE.parent / "src")) if p not in sys.path]


def one(work: Path) -> dict:
    """This process: the seconds of each step of a start."""
    t0 = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    import gpufeed
    from train_bench import _ops

    loader = gpufeed.Loader(work / "jpeg", batch_size=256, device="cuda", augment=_ops())
    t2 = time.perf_counter()
    next(iter(loader))
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return {"torch_and_context_s": t1 - t0, "loader_s": t2 - t1, "first_batch_s": t3 - t2,
            "imported_torchvision": "torchvision" in sys.modules,
            "imported_nvimgcodec_module": "nvidia.nvimgcodec" in sys.modules}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/gpufeed-train-bench")
    p.add_argument("--n", type=int, default=10000, help="images, if the stores are made here")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    work = Path(a.workdir)
    if a.one:
        print("RESULT " + json.dumps(one(work)), flush=True)
        return
    from train_bench import prepare

    prepare(work, a.n)
    for _ in range(a.repeats):
        done = subprocess.run([sys.executable, __file__, "--one", "--workdir", str(work)], capture_output=True,
                              text=True, timeout=600)
        result = [ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        print(result[0] if result else f"FAILED\n{done.stderr[-3000:]}", flush=True)


if __name__ == "__main__":
    main()
