"""Experiment 2: convert before or after `.cuda()`? uint8 over the bus, then convert on the GPU."""

from __future__ import annotations

import torch

from gpufeed.bench.common import Context, Figure, Skipped, measure

WAYS = {
    "x.half().cuda()": lambda x, p: x.half().cuda(),
    "x.cuda().half()": lambda x, p: x.cuda().half(),
    "pinned uint8, non_blocking, then .half()": lambda x, p: p.cuda(non_blocking=True).half(),
}


def run(ctx: Context) -> list[Figure]:
    if not ctx.cuda:
        raise Skipped("needs a CUDA device (compares host-to-device orders)")
    shapes = [(384, 384)] if ctx.quick else [(384, 384), (480, 640), (960, 1280)]
    batches = [8, 16] if ctx.quick else [8, 16, 32, 64]
    figures = []
    for h, w in shapes:
        fig = Figure(
            f"dtype_order_{w}x{h}", f"uint8 images {w}×{h} to fp16 on the GPU", "batch size", "time per batch (ms)"
        )
        for b in batches:
            x = torch.randint(0, 256, (b, 3, h, w), dtype=torch.uint8)
            pinned = x.pin_memory()
            for name, way in WAYS.items():
                fig.line(name).add(b, [s * 1e3 for s in measure(lambda: way(x, pinned), ctx.repeats(), "cuda")])
        figures.append(fig)
    return figures
