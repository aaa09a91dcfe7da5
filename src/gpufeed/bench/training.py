"""Experiment 5: is the GPU starved? A torchvision ResNet (random weights, bf16 autocast on a GPU) fed by
each loader."""

from __future__ import annotations

import time

import torch

from gpufeed.bench.common import Context, Figure, sync
from gpufeed.bench.feeders import dataset, feeders


def training_step(model: str, device: str, classes: int, wrap=None):
    """`step(images, labels) -> loss`: a torchvision `model` (random init, channels_last) trained with
    bf16 autocast on a GPU (fp32 on a CPU, where most processors emulate bf16: a ResNet-18 step at 96 px,
    batch 8, took 3.8-5 s against 0.8-0.9 s in fp32 on a 2-core development machine, busy beside it) and
    SGD with momentum: the loop `gpufeed bench training` and benchmarks/train_bench.py both feed. Labels
    are clamped into the model's classes. `wrap`: applied to the model before training
    (DistributedDataParallel, in benchmarks/ddp_bench.py)."""
    import torchvision

    net = getattr(torchvision.models, model)(num_classes=classes).to(device).to(memory_format=torch.channels_last)
    net = wrap(net) if wrap is not None else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5)

    kind = torch.device(device).type

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if kind != "cuda":  # the loaders' fp16/bf16 output, in the model's fp32 (autocast would cast it on a GPU)
            images = images.float()
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=kind == "cuda"):
            loss = torch.nn.functional.cross_entropy(
                net(images.contiguous(memory_format=torch.channels_last)), labels.to(device).clamp(0, classes - 1)
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def run(ctx: Context) -> list[Figure]:
    root = dataset(ctx)
    batch = (16 if ctx.cuda else 8) if ctx.quick else 128
    steps = 4 if ctx.quick else 30
    step = training_step("resnet18", ctx.device, 8)
    busy = Figure(
        "training",
        f"ResNet-18 training step fed by each loader ({ctx.device}, batch {batch})",
        "loader",
        "share of step time (%)",
        kind="bar",
    )
    rate = Figure(
        "training_rate",
        f"ResNet-18 training throughput by loader ({ctx.device}, batch {batch})",
        "loader",
        "images/s",
        kind="bar",
    )
    for name, epoch in feeders(ctx, root, batch).items():
        waits, computes = [], []
        for _ in range(ctx.repeats()):
            it, wait, compute = epoch(), 0.0, 0.0
            for k in range(steps):
                t0 = time.perf_counter()
                try:
                    images, labels = next(it)
                except StopIteration:
                    it = epoch()
                    images, labels = next(it)
                sync(ctx.device)
                t1 = time.perf_counter()
                step(images, labels)
                sync(ctx.device)
                if k:  # step 0 includes the loader's start-up
                    wait += t1 - t0
                    compute += time.perf_counter() - t1
            waits.append(wait)
            computes.append(compute)
        totals = [w + c for w, c in zip(waits, computes)]
        busy.line("data wait").add(name, [100 * w / t for w, t in zip(waits, totals)])
        busy.line("model step (GPU busy)" if ctx.cuda else "model step").add(
            name, [100 * c / t for c, t in zip(computes, totals)]
        )
        rate.line("images/s").add(name, [(steps - 1) * batch / t for t in totals])
    return [busy, rate]
