"""GPU time of each colour/pixel op and RandomErasing on one batch (CUDA events, median of repeats).

    PYTHONPATH=src python benchmarks/pixel_ops_bench.py [--batch 256] [--size 224]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gpufeed.augment import (ColorJitter, GaussianBlur, RandomAdjustSharpness, RandomAutocontrast, RandomEqualize,
                             RandomErasing, RandomGrayscale, RandomInvert, RandomPosterize, RandomSolarize)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    y = torch.rand(a.batch, 3, a.size, a.size, device="cuda") * 255
    g = torch.Generator().manual_seed(0)
    ops = [ColorJitter(0.4, 0.4, 0.4), ColorJitter(0.4, 0.4, 0.4, 0.1), RandomEqualize(), RandomGrayscale(0.2), RandomSolarize(128), RandomPosterize(4),
           RandomInvert(), RandomAutocontrast(), RandomAdjustSharpness(2.0), GaussianBlur(23), RandomErasing()]
    print(f"{torch.cuda.get_device_name()}, batch {a.batch}x3x{a.size}x{a.size} float32")
    print("| op | GPU ms per batch |\n|---|---:|")
    for op in ops:
        cols = op.draw(a.batch, (a.size, a.size), g).cuda()
        times = []
        for _ in range(a.repeats + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op.apply(y, cols)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        print(f"| {op!r} | {statistics.median(times[3:]):.3f} |")


if __name__ == "__main__":
    main()
