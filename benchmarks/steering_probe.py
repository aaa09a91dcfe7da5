"""How the jpeg path's steering splits each batch in a training loop: one `train_bench.py` row run in
this process, with every `Steering.steer` call logged (the loop's waits and own time per batch, the
GPU decoders' part, the shares, the decoders' rates).

    PYTHONPATH=src python benchmarks/steering_probe.py --row jpeg --out steer.json
    taskset -c 0-7 env PYTHONPATH=src python benchmarks/steering_probe.py --row jpeg --out steer8.json

`train_bench.py --rounds 0 --workdir W` first makes the stores under W (the default here is its own).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_bench  # noqa: E402

from gpufeed.decode import steering  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", default="jpeg", help="a train_bench row (jpeg, jpeg:KEY=VALUE,...)")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpufeed-train-bench"))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", required=True, help="the log and the row's result, as JSON")
    a = p.parse_args()
    log: list[dict] = []
    steer, shares = steering.Steering.steer, steering.Steering.shares

    def logged_steer(self, pace, threads, n):
        steer(self, pace, threads, n)
        ms = lambda s: None if s is None else round(s * 1e3, 2)  # noqa: E731
        log.append({"starved_ms": ms(pace and pace.starved), "interval_ms": ms(pace and pace.interval),
                    "step_ms": ms(pace and pace.step), "median_step_ms": ms(self.step), "gpu_part": self.gpu_part,
                    "threads": threads, "rates": {k: round(v) for k, v in self.rates.items()}})

    def logged_shares(self, n, threads):
        out = shares(self, n, threads)
        if log:
            log[-1]["shares"] = out
        return out

    steering.Steering.steer, steering.Steering.shares = logged_steer, logged_shares
    args = argparse.Namespace(row=a.row, model=a.model, workdir=a.workdir, steps=a.steps, warmup=a.warmup,
                              batch=a.batch, pyspy=None, pyspy_rate=0)
    result = train_bench.run_row(args)
    with open(a.out, "w") as f:
        json.dump({"result": result, "steer": log}, f, indent=1)
    print(f"{a.row}: {result['img_per_s']:,.0f} img/s, loop waited {result['wait_ms_per_step']:.1f} ms a step; "
          f"{len(log)} batches logged to {a.out}")


if __name__ == "__main__":
    main()
