"""Experiment 1: host-to-device bandwidth, pageable vs pinned, over copy sizes."""

from __future__ import annotations

import torch

from gpufeed.bench.common import Context, Figure, Skipped, measure


def run(ctx: Context) -> list[Figure]:
    if not ctx.cuda:
        raise Skipped("needs a CUDA device (host-to-device copies)")
    sizes_mb = [1, 16] if ctx.quick else [1, 4, 16, 64, 256]
    fig = Figure("transfer", "Host→device copy bandwidth", "copy size (MB)", "bandwidth (GB/s)", logx=True)
    device_buf = torch.empty(max(sizes_mb) << 20, dtype=torch.uint8, device="cuda")
    for pinned in (False, True):
        host = torch.empty(max(sizes_mb) << 20, dtype=torch.uint8, pin_memory=pinned)
        line = fig.line("pinned" if pinned else "pageable")
        for mb in sizes_mb:
            n = mb << 20
            seconds = measure(lambda: device_buf[:n].copy_(host[:n], non_blocking=True), ctx.repeats(), "cuda")
            line.add(mb, [n / s / 1e9 for s in seconds])
    return [fig]
