"""What a CPU decode worker pays per image to hand pixels over in CHW or HWC (500x375 q90, one thread).

libjpeg writes HWC; torchvision's CPU `decode_jpeg` returns a CHW view of it. Copying that view into a
shared buffer gathers bytes three apart; copying the HWC pixels is one memcpy.

    PYTHONPATH=src python benchmarks/cpu_layout_probe.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.synth import encode_jpegs, natural_images


def main() -> None:
    torch.set_num_threads(1)
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in encode_jpegs(natural_images(64), 90)]
    size = 375 * 500 * 3
    out = np.empty(size * len(tensors), np.uint8)

    def decode_only() -> None:
        for t in tensors:
            decode_jpeg(t, mode=ImageReadMode.RGB)

    def copied(hwc: bool):
        def run() -> None:
            for k, t in enumerate(tensors):
                pixels = decode_jpeg(t, mode=ImageReadMode.RGB)
                pixels = pixels.permute(1, 2, 0).contiguous() if hwc else pixels
                out[k * size : (k + 1) * size] = pixels.reshape(-1).numpy()
        return run

    runs = {"decode only": decode_only, "decode + copy out as CHW": copied(False),
            "decode + copy out as HWC": copied(True)}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(5):  # interleaved, best of 5
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - t0) / len(tensors))
    for name, seconds in best.items():
        print(f"{name:28s} {seconds * 1e3:6.3f} ms per image")


if __name__ == "__main__":
    main()
