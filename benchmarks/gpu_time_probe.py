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
Last, the training stream's idle time between kernels (the next kernel launched late: host-bound;
or queued and started late) and the training thread's time between its ops (its Python and its
waits for the GIL). Last, the training thread's CUDA calls that took over a millisecond (it waited
on a lock of the driver, or for room in the launch queue) and what the other threads' CUDA calls
were meanwhile. `--trace PATH` keeps the
Chrome trace, `--read PATH` analyses a kept one, `--decoders hw+cpu` picks the Loader's decoders.

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
    p.add_argument("--decoders", help="the Loader's decoders, '+'-separated (hw+cpu, cpu, hw, ...): default its own")
    p.add_argument("--read", metavar="TRACE", help="analyse a trace kept with --trace instead of running")
    p.add_argument("--feed", choices=("jpeg", "synthetic"), default="jpeg",
                   help="synthetic: one batch already on the GPU, the same loop's CUDA calls without a loader")
    a = p.parse_args()
    if a.read:
        return analyse(json.loads(Path(a.read).read_text())["traceEvents"], a.steps)
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
        decoders = tuple(a.decoders.split("+")) if a.decoders else None
        loader = gpufeed.Loader(work / "jpeg", batch_size=256, device="cuda", augment=train_bench._ops(),
                                decoders=decoders)

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
    print(f"{a.model}, {a.steps} steps of 256, {a.feed} batches, {torch.cuda.get_device_name()}")
    analyse(json.loads(trace.read_text())["traceEvents"], a.steps)
    if loader is not None:
        loader.close()


def analyse(events: list, steps: int) -> None:
    """Everything this probe prints about a trace of `steps` training steps."""
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
    print(f"training loop (stream {default}): {per_stream[default] / steps:.2f} GPU ms per batch")
    print(f"loader and decoders ({len(others)} other streams): "
          f"{sum(per_stream[s] for s in others) / steps:.2f} GPU ms per batch, of which:")
    for name, ms in kinds.most_common(8):
        print(f"  {ms / steps:6.2f} ms  {name}")
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
        print(f"thread {tid}, {side}: {sum(spent.values()) / steps:.2f} host ms per batch in CUDA calls:")
        for name, ms in spent.most_common(6):
            print(f"  {ms / steps:6.2f} ms  {counts[tid][name] / steps:6.1f} calls  {name}")
    _idle(events, default, steps)
    _gaps(events, steps)
    _stalls(events, steps, training)


def _gaps(events: list, steps: int) -> None:
    """The training thread's (the one that seeds `backward()`) time between its top-level torch ops
    (its Python, and any wait for the GIL), not counting `backward()` (from its gradient seed,
    `aten::ones_like`, to the next op: the thread waits for autograd's) nor the time in the ops."""
    seeds = [e.get("tid") for e in events if e.get("cat") == "cpu_op" and e.get("name") == "aten::ones_like"]
    if not seeds:
        return
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e and e.get("tid") == seeds[0]),
                 key=lambda e: e["ts"])
    top, end = [], float("-inf")
    for e in ops:
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(top, top[1:]) if a["name"] != "aten::ones_like"]
    if gaps:
        print(f"training thread: {sum(gaps) / 1000 / steps:.2f} ms per step between its ops, longest "
              f"{max(gaps) / 1000:.2f} ms, {sum(g > 1000 for g in gaps) / steps:.1f} per step over 1 ms")


def _idle(events: list, stream: int, steps: int) -> None:
    """The training stream's idle time between its kernels, split by why: the next kernel was
    launched only after the stream went idle (the training thread was late: host-bound), or it was
    queued and started late anyway (waiting on an event of another stream, or for SMs the loader's
    kernels held). Also how much of the idle time the other streams' kernels and copies ran."""
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e and "correlation" in e.get("args", {})}
    mine = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
                   and int(e.get("args", {}).get("stream", -1)) == stream), key=lambda e: e["ts"])
    others = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy")
                    and "dur" in e and int(e.get("args", {}).get("stream", -1)) != stream)
    late = queued = overlapped = 0.0
    gaps = []
    for prev, nxt in zip(mine, mine[1:]):
        begin, end = prev["ts"] + prev["dur"], nxt["ts"]
        if end - begin <= 0:
            continue
        call = launches.get(nxt["args"].get("correlation"))
        launched = call["ts"] + call["dur"] if call else begin
        host = min(max(0.0, launched - begin), end - begin)  # idle until the launch returned
        late, queued = late + host, queued + (end - begin - host)
        overlapped += sum(max(0.0, min(end, b) - max(begin, a)) for a, b in others if a < end and b > begin)
        gaps.append(end - begin)
    span = (mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]) / 1000 if mine else 0.0
    big = sorted(gaps)[-5:]
    print(f"training stream: {span / steps:.2f} ms per step from first to last kernel, idle "
          f"{sum(gaps) / 1000 / steps:.2f} ms per step in {len(gaps) / steps:.0f} gaps (largest, us: "
          f"{', '.join(f'{g:.0f}' for g in big)})")
    print(f"  {late / 1000 / steps:.2f} ms per step waiting for the training thread to launch (host-bound), "
          f"{queued / 1000 / steps:.2f} ms queued but started late (another stream's event, SMs held)")
    print(f"  other streams' kernels and copies ran {overlapped / 1000 / steps:.2f} ms per step of the idle time")


STALL_MS = 1.0  # a CUDA call of the training thread this long waited for something


def _stalls(events: list, steps: int, training: set) -> None:
    """The training thread's CUDA calls over STALL_MS (a launch normally takes microseconds; in a loop
    ahead of the GPU they wait for room in the launch queue, so on synthetic data there are many),
    and what every other thread was doing meanwhile: its CUDA calls that overlapped the stall, or
    its last call before it when it made none (a thread inside a library between calls). `training`:
    the training thread's ids (those that made torch ops)."""
    calls = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e),
                   key=lambda e: e["ts"])
    t0 = min((e["ts"] for e in calls), default=0)
    stalls = [e for e in calls if e.get("tid") in training and e["dur"] > 1000 * STALL_MS
              and e["name"] != "cudaDeviceSynchronize"]  # the profile's own closing sync
    print(f"training threads' CUDA calls over {STALL_MS} ms: {len(stalls)}, "
          f"{sum(e['dur'] for e in stalls) / 1000 / steps:.2f} ms per step")
    for stall in stalls[:12]:
        begin, end = stall["ts"], stall["ts"] + stall["dur"]
        print(f"  at {(begin - t0) / 1000:8.2f} ms: {stall['name']} {stall['dur'] / 1000:.2f} ms; meanwhile:")
        for tid in sorted({e.get("tid") for e in calls} - training, key=str):
            mine = [e for e in calls if e.get("tid") == tid]
            during = [e for e in mine if e["ts"] < end and e["ts"] + e["dur"] > begin]
            if during:
                longest = max(during, key=lambda e: e["dur"])
                print(f"    thread {tid}: {len(during)} calls, longest {longest['name']} {longest['dur'] / 1000:.2f} ms")
            else:
                last = [e for e in mine if e["ts"] < begin]
                what = f"last {last[-1]['name']} {(begin - last[-1]['ts'] - last[-1]['dur']) / 1000:.2f} ms before" \
                    if last else "no call before"
                print(f"    thread {tid}: no call ({what})")


if __name__ == "__main__":
    main()
