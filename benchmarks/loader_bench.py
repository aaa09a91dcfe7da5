"""Loader throughput on one machine: gpufeed's tiers against the usual recipes, side by side.

Workload (issue 3): a raw 256² store, RandomResizedCrop 224 + flip + normalize -> fp16 NCHW,
batch 256, steady state over >= 2 epochs after a warm-up epoch. Writes JSON, prints a table.

    PYTHONPATH=src python benchmarks/loader_bench.py --n 10000 --out results/loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gpufeed
from gpufeed.bench.common import cpu_seconds
from gpufeed.augment import Augment, Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.synth import make_image_folder

OPS = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()]


def timed(run, images_per_epoch: int, epochs: int) -> dict:
    """Warm-up epoch, then `epochs` timed epochs: img/s, CPU cores used."""
    run()
    torch.cuda.synchronize()
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(epochs):
        run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"img_per_s": images_per_epoch * epochs / wall, "wall_s": wall,
            "cpu_cores_used": (cpu_seconds() - c0) / wall}


def bench_gpufeed(store, cache: str, augment, epochs: int, batch: int) -> dict:
    loader = gpufeed.Loader(store, batch_size=batch, device="cuda", cache=cache, augment=augment)
    n = len(loader) * batch

    def run():
        for _batch in loader:
            pass

    torch.cuda.reset_peak_memory_stats()
    result = timed(run, n, epochs)
    stats = loader.stats()
    moved = stats["bytes"].get("h2d_issue", 0) + (stats["bytes"].get("gather", 0) if cache == "host" else 0)
    # (the host tier's fused augment kernel reads crop regions over PCIe itself: not counted here)
    result.update(tier=loader.tier.name, reason=loader.tier.reason,
                  pcie_gb_per_s=moved / stats["elapsed_s"] / 1e9 if cache != "gpu" else 0.0,
                  gpu_peak_gb=torch.cuda.max_memory_allocated() / 1e9, stalls=stats["stalls"])
    return result


def bench_augment_only(batch: int) -> dict:
    aug = Augment(OPS)
    x = torch.randint(0, 256, (batch, 256, 256, 3), dtype=torch.uint8, device="cuda")
    params = [aug.sample(batch, 256, 256, torch.Generator().manual_seed(i)).to("cuda") for i in range(8)]
    run = lambda: [aug.apply(x, p, torch.float16) for p in params]  # noqa: E731
    return timed(run, batch * len(params), 20)


def bench_memmap_recipe(store, batch: int, batches: int) -> dict:
    """The seeds' recipe: numpy memmap fancy-index, pin, copy, roi_align crops, one thread."""
    from torchvision.ops import roi_align

    mm = store.images
    rng = np.random.default_rng(0)
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255

    def run():
        for _ in range(batches):
            idx = np.sort(rng.choice(len(mm), batch, replace=False))
            x = torch.from_numpy(mm[idx]).pin_memory().cuda(non_blocking=True)
            x = x.permute(0, 3, 1, 2).float()
            s = torch.empty(batch, device="cuda").uniform_(0.3, 1.0) * 256
            x0 = torch.rand(batch, device="cuda") * (256 - s)
            y0 = torch.rand(batch, device="cuda") * (256 - s)
            boxes = torch.stack([torch.arange(batch, device="cuda").float(), x0, y0, x0 + s, y0 + s], 1)
            out = roi_align(x, boxes, (224, 224), aligned=True)
            ((out - mean) / std).half()

    return timed(run, batch * batches, 1)


def bench_pil_dataloader(folder: Path, batch: int, workers: int, limit: int) -> dict:
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds = torch.utils.data.Subset(datasets.ImageFolder(folder, tf), range(limit))
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=True,
                                     drop_last=True, persistent_workers=True)

    def run():
        for x, _labels in dl:
            x.cuda(non_blocking=True).half()

    return timed(run, len(dl) * batch, 1)


def gather_variants(store, batch: int) -> dict:
    """CPU gather memmap -> pinned buffer, GB/s, for several thread counts (page cache warm)."""
    from gpufeed.store.reader import as_tensor
    from gpufeed.transfer import Gatherer

    src = as_tensor(store.images)
    out = torch.empty((batch, *src.shape[1:]), dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    result = {}
    for threads in (1, 4, 8, 16):
        gather = Gatherer(threads)
        idx = [torch.from_numpy(np.sort(rng.choice(len(src), batch, replace=False))) for _ in range(40)]
        gather(src, idx[0], out)
        t0 = time.perf_counter()
        for i in idx:
            gather(src, i, out)
        result[f"Gatherer (numpy take) x{threads} threads"] = batch * len(idx) * out[0].numel() / (time.perf_counter() - t0) / 1e9
        gather.close()
    return result


def h2d_reference() -> dict:
    out = {}
    for pinned in (True, False):
        x = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=pinned)
        d = torch.empty_like(x, device="cuda")
        for _ in range(3):
            d.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            d.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        out["pinned" if pinned else "pageable"] = x.numel() * 10 / (time.perf_counter() - t0) / 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="loader_bench.json")
    p.add_argument("--skip-baselines", action="store_true")
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpufeed-bench-"))
    results = {"machine": {"gpu": torch.cuda.get_device_name(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "python": platform.python_version()},
               "args": vars(a)}
    folder = work / "images"
    if not folder.exists():
        t0 = time.perf_counter()
        make_image_folder(folder, per_class=a.n // 10, classes=10)
        results["make_images_s"] = time.perf_counter() - t0
    shutil.rmtree(work / "store", ignore_errors=True)
    one = gpufeed.pack(folder / "class_000", work / "one", size=256, workers=1, progress=False, overwrite=True)
    if os.path.isdir("/dev/shm"):  # same pack into RAM: tells the disk's share of pack time
        shm = gpufeed.pack(folder, "/dev/shm/gpufeed-bench-store", size=256, progress=False, overwrite=True)
        results["pack_to_dev_shm_img_per_s"] = shm.images_per_s
        shutil.rmtree("/dev/shm/gpufeed-bench-store")
    report = gpufeed.pack(folder, work / "store", size=256, progress=False)
    results["pack"] = {"img_per_s": report.images_per_s, "workers": report.workers,
                       "one_worker_img_per_s": one.images_per_s, "one_worker_images": one.count}
    store = gpufeed.open(work / "store")
    results["h2d_gb_per_s"] = h2d_reference()
    results["augment_only"] = bench_augment_only(a.batch)
    results["cpu_gather_gb_per_s_by_threads"] = gather_variants(store, a.batch)
    rows = {}
    for cache in ("gpu", "host", "disk"):
        rows[f"gpufeed {cache}"] = bench_gpufeed(store, cache, OPS, a.epochs, a.batch)
        rows[f"gpufeed {cache} uint8"] = bench_gpufeed(store, cache, None, a.epochs, a.batch)
    gpufeed.Loader.FUSED_GATHER = ("gpu",)
    rows["gpufeed host, gather rows then augment"] = bench_gpufeed(store, "host", OPS, a.epochs, a.batch)
    gpufeed.Loader.FUSED_GATHER = ("gpu", "host")
    if not a.skip_baselines:
        rows["numpy memmap + roi_align, 1 thread"] = bench_memmap_recipe(store, a.batch, 40)
        rows["DataLoader(ImageFolder, PIL), 16 workers"] = bench_pil_dataloader(folder, a.batch, 16, min(a.n, 8192))
    results["loaders"] = rows
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "loaders"}, indent=1))
    print(f"{'loader':45s} {'img/s':>10s} {'cores':>6s} {'PCIe GB/s':>9s}")
    for name, r in rows.items():
        print(f"{name:45s} {r['img_per_s']:10.0f} {r['cpu_cores_used']:6.1f} {r.get('pcie_gb_per_s', 0):9.1f}")


if __name__ == "__main__":
    main()
