"""Raw-store loader throughput on one machine: gpufeed's tiers against the usual recipes, side by side.

Workload (issue 3): a raw 256² store of `--n` generated images, RandomResizedCrop 224 + flip +
normalize -> fp16 NCHW, batch 256, `--epochs` timed epochs after a warm-up epoch (the table: img/s
median (min-max) over the epochs). Rows: the gpu, host and disk tiers with the recipe and without
(uint8), the host tier gathering whole rows before augmenting, and the baselines (numpy memmap +
roi_align on one thread, DataLoader(ImageFolder) with PIL). Also: pack rates, host-to-device copy
GB/s (pinned, pageable), the augment kernel alone, the CPU gather's GB/s by thread count.

    python benchmarks/loader_bench.py --n 10000 --out results/loader.json
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import common
import feeds

SMOKE = dict(n=40, image="64x48", size=32, side=40, batch=4, epochs=2, device="cpu", workers=0, gather_threads="1,2",
             workdir=None)


def timed(run, images_per_run: int, runs: int, device: str) -> dict:
    """A warm-up `run()`, then `runs` timed ones: img/s (median, min, max over them), CPU cores used."""
    from gpufeed.bench.common import cpu_seconds, sync

    run()
    sync(device)
    rates = []
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(runs):
        t = time.perf_counter()
        run()
        sync(device)
        rates.append(images_per_run / (time.perf_counter() - t))
    wall = time.perf_counter() - t0
    return {"img_per_s": statistics.median(rates), "img_per_s_each": rates, "wall_s": wall,
            "cpu_cores_used": (cpu_seconds() - c0) / wall}


def bench_gpufeed(a, store, cache: str, augment, tuning=None) -> dict:
    import gpufeed

    loader = gpufeed.Loader(store, batch_size=a.batch, device=a.device, cache=cache, augment=augment, tuning=tuning)

    def run():
        for _batch in loader:
            pass

    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    result = timed(run, len(loader) * a.batch, a.epochs, a.device)
    stats = loader.stats()
    moved = stats["bytes"].get("h2d_issue", 0) + (stats["bytes"].get("gather", 0) if cache == "host" else 0)
    # (the host tier's fused augment kernel reads crop regions over PCIe itself: not counted here)
    result.update(tier=loader.tier.name, reason=loader.tier.reason, stalls=stats["stalls"],
                  pcie_gb_per_s=moved / stats["elapsed_s"] / 1e9 if cache != "gpu" else 0.0,
                  gpu_peak_gb=torch.cuda.max_memory_allocated() / 1e9 if a.device.startswith("cuda") else None)
    loader.close()
    return result


def bench_augment_only(a) -> dict:
    """The augment kernel alone on a batch already on the device (8 parameter draws per run)."""
    from gpufeed.augment import Augment

    aug = Augment(feeds.ops(size=a.size))
    x = torch.randint(0, 256, (a.batch, a.side, a.side, 3), dtype=torch.uint8, device=a.device)
    params = [aug.sample(a.batch, a.side, a.side, torch.Generator().manual_seed(i)).to(a.device) for i in range(8)]
    return timed(lambda: [aug.apply(x, p, torch.float16) for p in params], a.batch * len(params), 20, a.device)


def bench_memmap_recipe(a, store, batches: int = 40) -> dict:
    """The seeds' recipe: numpy memmap fancy-index, pin, copy, roi_align crops, one thread."""
    from torchvision.ops import roi_align

    mm, dev, side, n = store.images, a.device, a.side, a.batch
    rng = np.random.default_rng(0)
    mean = torch.tensor(feeds.MEAN, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(feeds.STD, device=dev).view(1, 3, 1, 1) * 255

    def run():
        for _ in range(batches):
            x = torch.from_numpy(mm[np.sort(rng.choice(len(mm), n, replace=False))])
            x = (x.pin_memory() if dev.startswith("cuda") else x).to(dev, non_blocking=True).permute(0, 3, 1, 2).float()
            s = torch.empty(n, device=dev).uniform_(0.3, 1.0) * side
            x0, y0 = torch.rand(n, device=dev) * (side - s), torch.rand(n, device=dev) * (side - s)
            boxes = torch.stack([torch.arange(n, device=dev).float(), x0, y0, x0 + s, y0 + s], 1)
            ((roi_align(x, boxes, (a.size, a.size), aligned=True) - mean) / std).half()

    return timed(run, n * batches, 1, dev)


def bench_pil_dataloader(a, folder: Path, limit: int = 8192) -> dict:
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(a.size), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(feeds.MEAN, feeds.STD)])
    ds = torch.utils.data.Subset(datasets.ImageFolder(folder, tf), range(min(a.n, limit)))
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers, drop_last=True,
                                     pin_memory=a.device.startswith("cuda"), persistent_workers=a.workers > 0)

    def run():
        for x, _labels in dl:
            x.to(a.device, non_blocking=True).half()

    return timed(run, len(dl) * a.batch, 1, a.device)


def gather_variants(a, store, batches: int = 40) -> dict:
    """CPU gather memmap -> (pinned) buffer, GB/s, by thread count (page cache warm)."""
    from gpufeed.store.reader import as_tensor
    from gpufeed.transfer import Gatherer

    src = as_tensor(store.images)
    out = torch.empty((a.batch, *src.shape[1:]), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    rng = np.random.default_rng(0)
    result = {}
    for threads in (int(t) for t in a.gather_threads.split(",")):
        gather = Gatherer(threads)
        idx = [torch.from_numpy(np.sort(rng.choice(len(src), a.batch, replace=False))) for _ in range(batches)]
        gather(src, idx[0], out)
        t0 = time.perf_counter()
        for i in idx:
            gather(src, i, out)
        result[threads] = a.batch * len(idx) * out[0].numel() / (time.perf_counter() - t0) / 1e9
        gather.close()
    return result


def h2d_reference() -> dict:
    """Host-to-device copy GB/s of 256 MiB, from page-locked and from pageable memory."""
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


def pack_rates(a, work: Path) -> dict:
    """Pack img/s: one worker on one class, all workers into /dev/shm (the disk's share), all into `work`."""
    import gpufeed

    folder = work / "images"
    one = gpufeed.pack(folder / "class_000", work / "one", size=a.side, workers=1, progress=False, overwrite=True)
    out = {"one_worker_img_per_s": one.images_per_s, "one_worker_images": one.count}
    if os.path.isdir("/dev/shm"):
        shm = Path("/dev/shm") / f"gpufeed-bench-store-{os.getpid()}"
        to_shm = gpufeed.pack(folder, shm, size=a.side, progress=False, overwrite=True)
        out["to_dev_shm_img_per_s"] = to_shm.images_per_s
        shutil.rmtree(shm)
    report = gpufeed.pack(folder, work / "store", size=a.side, progress=False, overwrite=True)
    return out | {"img_per_s": report.images_per_s, "workers": report.workers}


def loaders(a, store, folder: Path) -> dict:
    """The table's rows: name -> result."""
    from gpufeed.decode.tuning import Tuning

    recipe = feeds.ops(size=a.size)
    rows = {}
    for cache in ("gpu", "host", "disk") if a.device.startswith("cuda") else ("host", "disk"):
        rows[f"gpufeed {cache}"] = bench_gpufeed(a, store, cache, recipe)
        rows[f"gpufeed {cache} uint8"] = bench_gpufeed(a, store, cache, None)
    rows["gpufeed host, gather rows then augment"] = bench_gpufeed(a, store, "host", recipe,
                                                                  Tuning(fused_gather=("gpu",)))
    if not a.skip_baselines:
        rows["numpy memmap + roi_align, 1 thread"] = bench_memmap_recipe(a, store)
        rows[f"DataLoader(ImageFolder, PIL), {a.workers} workers"] = bench_pil_dataloader(a, folder)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=10000, help="generated images")
    p.add_argument("--image", default="500x375", help="generated images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--side", type=int, default=256, help="the raw store's side")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's side")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=16, help="the PIL DataLoader's workers")
    p.add_argument("--gather-threads", default="1,4,8,16", help="thread counts of the CPU gather figure")
    p.add_argument("--workdir", default=None, help="keep the images (and the store) here")
    p.add_argument("--skip-baselines", action="store_true")
    a = common.parse(p, argv, SMOKE)
    import gpufeed
    from gpufeed.synth import make_image_folder

    with common.workdir(a.workdir, "gpufeed-bench-") as work:
        if not (work / "images").exists():
            width, height = (int(x) for x in a.image.split("x"))
            make_image_folder(work / "images", per_class=max(1, a.n // 10), classes=10, width=width, height=height)
        extra = {"pack": pack_rates(a, work)}
        store = gpufeed.open(work / "store")
        if a.device.startswith("cuda"):
            extra["h2d_gb_per_s"] = h2d_reference()
        extra["augment_only"] = bench_augment_only(a)
        extra["cpu_gather_gb_per_s_by_threads"] = gather_variants(a, store)
        rows = loaders(a, store, work / "images")
    lines = [[name, common.cell(r.get("img_per_s_each", [r["img_per_s"]])), f"{r['cpu_cores_used']:.1f}",
              f"{r.get('pcie_gb_per_s', 0):.1f}", r.get("tier", "-")] for name, r in rows.items()]
    markdown = common.table(["loader", "img/s", "CPU cores", "PCIe GB/s", "tier"], lines)
    return common.write(a, __file__, rows, markdown, a.device, **extra)


if __name__ == "__main__":
    main()
