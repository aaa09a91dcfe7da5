"""Whole-image CPU JPEG decoders on threads (500x375 q90): img/s on one thread and on every core, and
whether their pixels agree. What `decode.cpu`'s threads decode whole images with: nvImageCodec's CPU
backend, Pillow without it; torchvision's `decode_jpeg` (deprecated since 0.29) for comparison, where
it still exists.

    PYTHONPATH=src python benchmarks/cpu_whole_probe.py [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import torch

from gpufeed.decode import pixels
from gpufeed.synth import encode_jpegs, natural_images


def decoders(arrays: list[np.ndarray]) -> dict:
    """name -> decode(k) of image k, HWC numpy."""
    found = {"Pillow": lambda k: pixels.pillow(arrays[k], None),
             "nvImageCodec CPU": lambda k: pixels.whole(arrays[k])}
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        tensors = [torch.from_numpy(a.copy()) for a in arrays]
        found["torchvision decode_jpeg"] = lambda k: decode_jpeg(tensors[k], mode=ImageReadMode.RGB).permute(
            1, 2, 0).contiguous().numpy()
    except ImportError:
        pass
    return found


def rate(decode, threads: int, seconds: float, n: int) -> float:
    """Images per second that `threads` threads decode together, each looping over the n images."""
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def work(t: int) -> None:
        k = 0
        while time.perf_counter() < stop:
            decode(k % n)
            k += 1
        done[t] = k

    began = time.perf_counter()
    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = [np.frombuffer(d, np.uint8) for d in encode_jpegs(natural_images(32), 90)]
    found = decoders(arrays)
    reference = [found["Pillow"](k) for k in range(len(arrays))]
    cores = os.cpu_count() or 1
    for name, decode in found.items():
        same = all(np.array_equal(decode(k), reference[k]) for k in range(len(arrays)))
        rates = {t: [rate(decode, t, args.seconds, len(arrays)) for _ in range(args.rounds)] for t in (1, cores)}
        print(f"{name}: pixels {'equal to' if same else 'DIFFERENT from'} Pillow's; "
              + "; ".join(f"{t} thread(s) {min(r):,.0f}-{max(r):,.0f} img/s" for t, r in rates.items()))


if __name__ == "__main__":
    main()
