"""Time the fused augment kernel alone (CUDA events, no Python in the loop) vs. with launches.

    PYTHONPATH=src python benchmarks/augment_kernel_bench.py
"""

from __future__ import annotations

import json
import sys
import time

import torch
from triton.testing import do_bench

from gpufeed.augment import Augment, Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.augment import fused
from gpufeed.augment.pipeline import _affine


def main() -> None:
    batch, store_n = 256, 10000
    store = torch.randint(0, 256, (store_n, 256, 256, 3), dtype=torch.uint8, device="cuda")
    aug = Augment([RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()])
    p = aug.sample(batch, 256, 256, torch.Generator().manual_seed(0)).to("cuda")
    idx = torch.randperm(store_n, device="cuda")[:batch].sort().values
    gathered = store.index_select(0, idx)
    scale, shift = _affine(torch.device("cuda"), aug.normalize)
    out = {}
    for block in (128, 256, 512, 1024):
        fused.BLOCK = block
        run = lambda: fused.resample_normalize(store, p.boxes, p.flip, p.out_hw, scale, shift,  # noqa: E731
                                               torch.float16, False, idx)
        ms = do_bench(run, warmup=50, rep=300, return_mode="median")
        out[f"fused gather, BLOCK={block}, do_bench us/batch"] = ms * 1e3
    fused.BLOCK = 256
    run = lambda: fused.resample_normalize(gathered, p.boxes, p.flip, p.out_hw, scale, shift,  # noqa: E731
                                           torch.float16, False)
    out["pre-gathered, BLOCK=256, do_bench us/batch"] = do_bench(run, warmup=50, rep=300, return_mode="median") * 1e3
    g = torch.cuda.CUDAGraph()
    run()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(10):
            run()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    out["graph replay us/batch (GPU time only)"] = (time.perf_counter() - t0) / 200 * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        run()
    torch.cuda.synchronize()
    out["eager loop us/batch (launch + GPU)"] = (time.perf_counter() - t0) / 200 * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        store.index_select(0, idx)
    torch.cuda.synchronize()
    out["index_select gather us/batch"] = (time.perf_counter() - t0) / 200 * 1e6
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
