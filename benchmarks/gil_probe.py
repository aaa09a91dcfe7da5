"""Does a decoder call let go of the GIL? A Python thread counts while the call runs on another.

For each call: its wall time, and how far a counting thread got during it compared with the same
time of free counting (100 %: the call held no GIL at all; near 0 %: it held the GIL throughout).

    PYTHONPATH=src python benchmarks/gil_probe.py --n 256

`--beside ROWS` asks the training thread's question instead: how long does a Python thread that
launches small CUDA ops (as a training loop does, letting go of the GIL in each) wait for the GIL
while a loader runs beside it? ROWS are benchmarks/train_bench.py's feeder rows (e.g.
`jpeg;jpeg:decoders=(cpu)`); each loader is drained flat out on a thread of its own while the main
thread launches ops, and the ops' extra time is divided by the batches made meanwhile.

    PYTHONPATH=src python benchmarks/gil_probe.py --beside "jpeg;jpeg:decoders=(cpu)" --n 3000 --workdir /tmp/tb [--pyspy]

The same ops on a CPU tensor (`*_cpu_op`) also let go of the GIL but never enter the CUDA driver:
waits they share are the GIL's, waits only the CUDA ops have are the driver's.
`--pyspy` (py-spy on PATH) also names the loader's GIL holders per row, in ms per batch.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from gpufeed.synth import encode_jpegs, natural_images


class Counter(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.count, self.stop = 0, False

    def run(self):
        while not self.stop:
            self.count += 1


def free_rate(seconds: float = 0.5) -> float:
    c = Counter()
    c.start()
    time.sleep(0.05)
    a, t = c.count, time.perf_counter()
    time.sleep(seconds)
    rate = (c.count - a) / (time.perf_counter() - t)
    c.stop = True
    c.join()
    return rate


def probe(fn, repeats: int = 5) -> dict:
    fn()  # warm up
    torch.cuda.synchronize()
    rate = free_rate()
    c = Counter()
    c.start()
    time.sleep(0.05)
    walls, shares = [], []
    for _ in range(repeats):
        a, t = c.count, time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        walls.append(wall)
        shares.append((c.count - a) / (rate * wall))
    c.stop = True
    c.join()
    return {"wall_ms": 1e3 * float(np.median(walls)), "counter_progress_pct": 100 * float(np.median(shares))}


def _launch(x: torch.Tensor, seconds: float) -> np.ndarray:
    """Seconds each small CUDA op took, launched one after another for `seconds`."""
    lat, end = [], time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        x[:16].add_(1)
        lat.append(time.perf_counter() - t)
    return np.array(lat)


def _holders(stacks: dict[str, int] | str, batches: float) -> list:
    """The loader's GIL holders py-spy saw (not the op thread): [(ms per batch at 1 kHz, holder)], the
    first of them all of them together, then the 15 heaviest."""
    import train_bench

    if isinstance(stacks, str):
        return [(0.0, f"py-spy: {stacks}")]
    _, top = train_bench.holders(stacks, "_launch")
    every = [(round(sum(top.values()) / max(1, batches), 3), "all of the loader's threads")]
    return every + [(round(n / max(1, batches), 3), k) for k, n in sorted(top.items(), key=lambda kv: -kv[1])[:15]]


def _waits(alone: np.ndarray, near: np.ndarray, batches: int, seconds: float, suffix: str) -> dict:
    """The op thread's latencies alone and beside a loader that made `batches` meanwhile."""
    extra = (near.mean() - alone.mean()) * len(near)  # the op thread's time lost while the loader ran
    per = max(1, batches)
    found = {"ops_per_s_alone": len(alone) / seconds, "ops_per_s_beside": len(near) / seconds,
             "batches_per_s": batches / seconds,
             "op_us_p50_alone": 1e6 * float(np.median(alone)), "op_us_p50_beside": 1e6 * float(np.median(near)),
             "op_us_p99_beside": 1e6 * float(np.quantile(near, 0.99)), "op_ms_max_beside": 1e3 * float(near.max()),
             "waits_over_1ms_per_s": float((near > 1e-3).sum() / seconds),
             "gil_wait_ms_per_batch": 1e3 * float(near[near > 1e-4].sum() / per),
             "extra_ms_per_batch": float(1e3 * extra / per)}
    return {k + suffix: v for k, v in found.items()}


def beside(rows: list[str], workdir: str, n: int, seconds: float, pyspy: bool = False) -> dict:
    """Per row: the ops' time with the row's loader drained on another thread, against alone; with
    `pyspy`, also the loader's GIL holders (py-spy at 1 kHz: a sample is 1 ms)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import train_bench

    threading.current_thread().name = "op-thread"
    work = Path(workdir)
    train_bench.prepare(work, n)
    xs = {"": torch.zeros(1 << 20, device="cuda"), "_cpu_op": torch.zeros(1 << 20)}
    out = {}
    for row in rows:
        alone = {k: _launch(x, seconds) for k, x in xs.items()}
        _, batches, _ = train_bench.feeder(row, work, 256)
        next(batches)
        made, stop = [0], threading.Event()

        def drain():
            while not stop.is_set():
                next(batches)
                made[0] += 1

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        spy = train_bench.spy_on_gil(int(seconds + 1), 1000) if pyspy else None
        time.sleep(0.0 if spy else 1.0)  # the loader at its pace
        out[row] = {}
        for k, x in xs.items():
            before, sched = made[0], train_bench._schedstat()
            near = _launch(x, seconds)
            out[row] |= _waits(alone[k], near, made[0] - before, seconds, k)
            if k == "":  # per thread, per batch: CPU ms, ms waiting for a CPU, times it blocked
                batches_made = made[0] - before
                out[row]["threads_per_batch"] = train_bench._per_step(sched, train_bench._schedstat(),
                                                                      max(1, batches_made))
        stop.set()
        t.join()
        if spy is not None:
            window = int(seconds + 1) / seconds  # py-spy samples a little longer than the ops ran
            out[row]["gil_holders_ms_per_batch"] = _holders(train_bench.gil_stacks(spy, 60), batches_made * window)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--beside", help="train_bench feeder rows, ';'-separated")
    p.add_argument("--workdir", default="/tmp/gpufeed-train-bench")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--pyspy", action="store_true", help="with --beside: the loader's GIL holders (py-spy on PATH)")
    a = p.parse_args()
    if a.beside:
        print(json.dumps(beside(a.beside.split(";"), a.workdir, a.n, a.seconds, a.pyspy), indent=1))
        return
    sys_interval = 0.005
    import sys

    sys.setswitchinterval(sys_interval)
    data = encode_jpegs(natural_images(a.n))
    arrays = [np.frombuffer(d, np.uint8) for d in data]
    tensors = [torch.from_numpy(x.copy()) for x in arrays]
    out = {}
    from torchvision.io import decode_jpeg

    out["torchvision decode_jpeg cuda batch"] = probe(lambda: (decode_jpeg(tensors, device="cuda"),
                                                               torch.cuda.synchronize()))
    out["torchvision decode_jpeg cpu x16"] = probe(lambda: [decode_jpeg(t) for t in tensors[:16]])
    try:
        from gpufeed.decode.pixels import nvimgcodec as load

        nv = load()
        for kind in ("HW_GPU_ONLY", "HYBRID_CPU_GPU"):
            dec = nv.Decoder(device_id=0, max_num_cpu_threads=4, backends=[nv.Backend(getattr(nv.BackendKind, kind))])
            out[f"nvimgcodec {kind} batch"] = probe(lambda: (dec.decode(arrays), torch.cuda.synchronize()))
            out[f"nvimgcodec {kind} batch, no sync"] = probe(lambda: dec.decode(arrays))
    except ImportError as e:
        out["nvimgcodec"] = f"unavailable: {e}"
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    out["1000 small torch cuda ops"] = probe(lambda: [x[:16].add_(1) for _ in range(1000)])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
