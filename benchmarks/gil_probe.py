"""Does a decoder call let go of the GIL? A Python thread counts while the call runs on another.

For each call: its wall time, and how far a counting thread got during it compared with the same
time of free counting (100 %: the call held no GIL at all; near 0 %: it held the GIL throughout).

    PYTHONPATH=src python benchmarks/gil_probe.py --n 256
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=256)
    a = p.parse_args()
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
        from gpufeed.decode.nvimgcodec import load

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
