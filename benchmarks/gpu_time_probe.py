"""GPU time per batch of the loader inside a training loop, by CUDA stream, and the host time of
the CUDA calls each side makes (torch.profiler / Kineto).

A ResNet training loop (benchmarks/train_bench.py's step) fed by a jpeg store with the Loader's
defaults; after warm-up steps, `--steps` steps are profiled. Kernels, copies and memsets are
summed per stream: the training loop's stream (the default stream) against every other (the
loader's streams and the decoders'). The JPEG engines' own work is no kernel and does not show.
Then the CUDA runtime and driver calls (launches, copies, syncs, event queries) are summed by the
thread that made them (the training thread, the loader's threads): a call that blocks its thread
(a copy waiting for a stream, a sync) shows as host time. `--feed synthetic` profiles the same
loop on one batch already on the GPU: the training thread's CUDA calls without a loader beside it.

    PYTHONPATH=src python benchmarks/gpu_time_probe.py --n 10000 --steps 20 [--feed synthetic]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from pathlib import Path

import torch

sys_path = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10000)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpufeed-train-bench"))
    p.add_argument("--model", default="resnet18")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--trace", help="also keep the Chrome trace here")
    p.add_argument("--feed", choices=("jpeg", "synthetic"), default="jpeg",
                   help="synthetic: one batch already on the GPU, the same loop's CUDA calls without a loader")
    a = p.parse_args()
    import sys

    sys.path.insert(0, str(sys_path))
    import train_bench

    import gpufeed
    from gpufeed.bench.training import training_step

    work = Path(a.workdir)
    if a.feed == "jpeg":
        train_bench.prepare(work, a.n)
    step = training_step(a.model, "cuda", 1000)
    if a.feed == "synthetic":
        loader = None
        batch = torch.randn(256, 3, 224, 224, device="cuda").half(), torch.randint(0, 1000, (256,), device="cuda")

        def endless():
            while True:
                yield batch
    else:
        loader = gpufeed.Loader(work / "jpeg", batch_size=256, device="cuda", augment=train_bench._ops())

        def endless():
            while True:
                yield from loader

    it = endless()
    for _ in range(a.warmup):
        step(*next(it))
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(a.steps):
            step(*next(it))
        torch.cuda.synchronize()
    trace = Path(a.trace or tempfile.mktemp(suffix=".json"))
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    per_stream: dict[int, float] = collections.Counter()
    names: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            stream = int(e.get("args", {}).get("stream", -1))
            per_stream[stream] += e["dur"] / 1000
            names[stream][e["name"][:60]] += e["dur"] / 1000
    default = max(per_stream, key=per_stream.get)  # the model's stream does the most work
    others = [s for s in per_stream if s != default]
    kinds: collections.Counter = collections.Counter()
    for s in others:
        kinds.update(names[s])
    print(f"{a.model}, {a.steps} steps of 256, {a.feed} batches, {torch.cuda.get_device_name()}")
    print(f"training loop (stream {default}): {per_stream[default] / a.steps:.2f} GPU ms per batch")
    print(f"loader and decoders ({len(others)} other streams): "
          f"{sum(per_stream[s] for s in others) / a.steps:.2f} GPU ms per batch, of which:")
    for name, ms in kinds.most_common(8):
        print(f"  {ms / a.steps:6.2f} ms  {name}")
    # the profiler records torch ops on the profiling (training) thread only; CUDA calls on every thread
    training = {e.get("tid") for e in events if e.get("cat") == "cpu_op"}
    calls: dict[object, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[object, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            calls[e.get("tid")][e["name"]] += e["dur"] / 1000
            counts[e.get("tid")][e["name"]] += 1
    for tid, spent in sorted(calls.items(), key=lambda kv: -sum(kv[1].values())):
        side = "training thread" if tid in training else "another thread (the loader's)"
        print(f"thread {tid}, {side}: {sum(spent.values()) / a.steps:.2f} host ms per batch in CUDA calls:")
        for name, ms in spent.most_common(6):
            print(f"  {ms / a.steps:6.2f} ms  {counts[tid][name] / a.steps:6.1f} calls  {name}")
    if loader is not None:
        loader.close()


if __name__ == "__main__":
    main()
