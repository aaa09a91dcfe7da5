"""What decoding a RandomResizedCrop region alone costs the CPU, against torchvision decoding the whole image
(500x375 q90, one thread, each image best of 5), and the fit behind `gpufeed.decode.cpu.roi_cost`.

nvImageCodec's libjpeg-turbo backend stops the Huffman decode at the region's last row and converts only
the region, so the cost follows the region's bottom row and its area. Needs the [nvimgcodec] extra.

    PYTHONPATH=src python benchmarks/cpu_roi_probe.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.decode.cpu import decode_one, roi_cost
from gpufeed.synth import encode_jpegs, natural_images
from nvimgcodec_probe import rrc_regions


def best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=256, help="images (and regions)")
    a = p.parse_args()
    if a.n < 3:
        p.error(f"--n must be at least 3 (the fit has 3 weights), got {a.n}")
    torch.set_num_threads(1)
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in encode_jpegs(natural_images(a.n), 90)]
    regions = rrc_regions(a.n, seed=1)
    if decode_one(tensors[0], None, regions[0])[1] is None:
        raise SystemExit("regions are decoded whole here: is nvImageCodec installed (the [nvimgcodec] extra)?")
    whole = np.array([best(lambda: decode_jpeg(t, mode=ImageReadMode.RGB)) for t in tensors])
    alone = np.array([best(lambda: decode_one(t, None, r)) for t, r in zip(tensors, regions)])
    r = np.array(regions, float)
    shapes = np.tile([375.0, 500.0], (a.n, 1))
    area = (r[:, 2] - r[:, 0]) * (r[:, 3] - r[:, 1]) / (375 * 500)
    x = np.stack([np.ones(a.n), r[:, 2] / 375, area], 1)
    coef = np.linalg.lstsq(x, alone / whole, rcond=None)[0]
    print(f"torchvision, whole image: {whole.mean() * 1e3:.3f} ms; region alone: {alone.mean() * 1e3:.3f} ms")
    print(f"fit: region / whole ~ {coef[0]:.2f} + {coef[1]:.2f} * bottom row / height + {coef[2]:.2f} * area share")
    order = np.argsort(roi_cost(shapes, r))
    for share in (0.05, 0.1, 0.15, 0.2, 0.3):
        sel = order[: int(a.n * share)]
        print(f"cheapest {share:.0%} by roi_cost: {alone[sel].mean() / whole.mean():.2f} of a whole decode")


if __name__ == "__main__":
    main()
