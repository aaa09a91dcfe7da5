"""The loaders the end-to-end experiments compare, built on one generated dataset."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gpufeed.bench.common import Context
from gpufeed.packing import pack
from gpufeed.synth import make_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def dataset(ctx: Context) -> Path:
    """An ImageFolder of natural-looking 500×375 JPEGs plus its raw and jpeg stores (made once); with
    `quick`, 128 of them (64 on a CPU, at 250×188: a run that shows every experiment works, in seconds)."""
    root = ctx.work / ("data-quick" if ctx.quick else "data")
    if not (root / "raw").exists():
        per_class = (16 if ctx.cuda else 8) if ctx.quick else 512
        side = {"height": 188, "width": 250} if ctx.quick and not ctx.cuda else {}
        make_image_folder(root / "images", per_class=per_class, classes=8, **side)
        pack(root / "images", root / "raw", size=256, progress=False, overwrite=True)
        pack(root / "images", root / "jpeg", mode="jpeg", reencode=False, progress=False, overwrite=True)
    return root


def _torch_loader(root: Path, batch: int, ctx: Context, uint8: bool):
    from torchvision import datasets, transforms

    steps = [transforms.RandomResizedCrop(size(ctx)), transforms.RandomHorizontalFlip()]
    steps += [transforms.PILToTensor()] if uint8 else [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
    workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    return torch.utils.data.DataLoader(
        datasets.ImageFolder(root / "images", transforms.Compose(steps)),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=ctx.cuda,
        persistent_workers=True,
    )


def size(ctx: Context) -> int:
    """Output side: 224 as in training, smaller on a CPU so a model step stays short (64 with `quick`)."""
    return 224 if ctx.cuda else 64 if ctx.quick else 96


def feeders(ctx: Context, root: Path, batch: int) -> dict[str, Callable[[], Iterator]]:
    """name -> a function giving one epoch of (images on the device as float, labels)."""
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
    from gpufeed.loader import Loader

    dev = ctx.device
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1) * 255
    pil = _torch_loader(root, batch, ctx, uint8=False)
    u8 = _torch_loader(root, batch, ctx, uint8=True)
    ops = [RandomResizedCrop(size(ctx)), RandomHorizontalFlip(), Normalize(MEAN, STD)]
    raw = Loader(root / "raw", batch_size=batch, device=dev, augment=ops, dtype=torch.float32)
    jpeg = Loader(root / "jpeg", batch_size=batch, device=dev, augment=ops, dtype=torch.float32)
    return {
        "DataLoader(ImageFolder, PIL)": lambda: ((x.to(dev, non_blocking=True), y) for x, y in pil),
        f"DataLoader uint8 + normalize on {dev}": lambda: (
            ((x.to(dev, non_blocking=True).float() - mean) / std, y) for x, y in u8
        ),
        "gpufeed raw store": lambda: iter(raw),
        "gpufeed jpeg store": lambda: iter(jpeg),
    }
