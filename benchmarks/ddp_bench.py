"""Per-GPU loader throughput with 1 rank and with N ranks (torchrun, NCCL), and host RAM used.

Issue 6's check: with 2 ranks on a 2-GPU host, each GPU's img/s must be >= 90 % of the
single-GPU figure, on the same raw and jpeg stores, and the ranks together must hold about
one copy of the store in host RAM (page cache / one registered region), not one each.

    PYTHONPATH=src python benchmarks/ddp_bench.py --n 10000 --out ddp.json

`--train resnet18` instead trains (train_bench's loop, the model in DistributedDataParallel) fed
by the jpeg store or by one synthetic batch: issue 20's check, per-GPU training img/s with 2 ranks
against 1.

Each configuration runs as `torchrun --nproc-per-node W benchmarks/ddp_bench.py --worker ...`;
every rank times whole epochs after a warm-up epoch and reports its img/s and its PSS
(proportional set size: shared pages are split between the processes mapping them, so the
ranks' PSS add up to the RAM they use together).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPS_DOC = "RandomResizedCrop 224 + flip + normalize -> fp16, batch 256"
CONFIGS = {  # name: (store, cache, epochs timed)
    "raw-gpu": ("raw", "gpu", 200),  # raw store, gpu tier
    "raw-host": ("raw", "host", 40),  # raw store, host tier
    "jpeg": ("jpeg", "auto", 6),  # jpeg store, default decoders
}
TRAIN_CONFIGS = {  # `--train`: name: (store, cache or "synthetic", steps timed)
    "synthetic": ("jpeg", "synthetic", 80),  # one batch already on the GPU: the ceiling
    "jpeg": ("jpeg", "auto", 80),  # the jpeg store, the Loader's defaults
}


def _cpu_seconds() -> float:
    """CPU seconds of this rank and every process under it (its decode workers) so far."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def _rank_facts(loader=None) -> dict:
    """What this rank ran with: its cores as gpufeed counts them, and its decode workers."""
    from gpufeed.loader.cores import rank_cores

    workers = None
    if loader is not None and loader.jpeg is not None and loader.jpeg.workers is not None:
        workers = loader.jpeg.workers.size
    return {"cores": rank_cores().usable, "affinity": len(os.sched_getaffinity(0)), "workers": workers}


def _pss_mb() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(a: argparse.Namespace) -> None:
    """One rank: load `--epochs` epochs after a warm-up one; write its numbers as JSON."""
    import torch
    import torch.distributed as dist

    import gpufeed
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
    from gpufeed.bench.common import mapped_mb

    local = int(os.environ["LOCAL_RANK"])
    if a.bound:  # this rank (and its planner/decoder children) on its own slice of the cores
        cores = sorted(os.sched_getaffinity(0))
        per = len(cores) // int(os.environ["LOCAL_WORLD_SIZE"])
        os.sched_setaffinity(0, cores[local * per:(local + 1) * per])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if a.train:
        return _train(a, local)
    ops = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()]
    with gpufeed.Loader(a.store, batch_size=256, device="cuda", cache=a.cache, augment=ops) as loader:
        for _ in loader:
            pass
        torch.cuda.synchronize()
        dist.barrier()
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        epochs = a.epochs * dist.get_world_size()  # as many batches per rank as one rank makes: epochs are shorter
        for _ in range(epochs):
            for _ in loader:
                pass
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        cores_used = (_cpu_seconds() - cpu0) / seconds
        dist.barrier()  # every rank has read all it will: a page another rank maps later would count twice
        stats = loader.stats()
        result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "tier": stats["tier"],
                  "img_per_s": epochs * len(loader) * loader.batch_sampler.batch_size / seconds,
                  "batches_per_epoch": len(loader), "pss_mb": _pss_mb(), "store_maps_mb": mapped_mb(a.store),
                  "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                  "decoded_by": stats.get("decoded_by"), "stage_seconds": stats["seconds"],
                  "images_loaded": stats["images"], "cores_used": cores_used, **_rank_facts(loader)}
        dist.barrier()  # every rank measured while the others still ran
    Path(f"{a.report}.rank{result['rank']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _train(a: argparse.Namespace, local: int) -> None:
    """One rank of `--train MODEL`: train_bench's loop and feeders (its `jpeg` row: the Loader's
    defaults, each rank its shard; `--cache synthetic`: its `synthetic` row, one batch already on the
    GPU) with the model in DistributedDataParallel; `--epochs` timed steps after 15."""
    import torch
    import torch.distributed as dist

    from gpufeed.bench.common import mapped_mb
    from gpufeed.bench.training import training_step
    from train_bench import feeder  # the sibling benchmark: the same rows as one rank's training

    torch.backends.cudnn.benchmark = True
    step = training_step(a.train, "cuda", 1000,
                         functools.partial(torch.nn.parallel.DistributedDataParallel, device_ids=[local]))
    store = Path(a.store)  # train_bench's rows read <work>/jpeg
    _, batches, stats = feeder("synthetic" if a.cache == "synthetic" else store.name, store.parent, 256)
    for _ in range(15):
        step(*next(batches))
    torch.cuda.synchronize()
    dist.barrier()
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    for _ in range(a.epochs):
        loss = step(*next(batches))
    loss.item()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    cores_used = (_cpu_seconds() - cpu0) / seconds
    loader = getattr(stats, "__self__", None)  # the jpeg row's Loader (its stats method)
    free, total = torch.cuda.mem_get_info()
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "img_per_s": a.epochs * 256 / seconds,
              "pss_mb": _pss_mb(), "store_maps_mb": mapped_mb(a.store),
              "decoded_by": stats().get("decoded_by") if stats is not None else None,
              "gpu_used_gb": (total - free) / 1e9, "cores_used": cores_used, **_rank_facts(loader)}
    dist.barrier()
    Path(f"{a.report}.rank{result['rank']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(store: Path, cache: str, epochs: int, world: int, work: Path, bind: bool, train: str | None = None) -> dict:
    report = work / f"r-{store.name}-{cache}-{world}-{'bound' if bind else 'shared'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-port=29517",
           __file__, "--worker", "--store", str(store), "--cache", cache, "--epochs", str(epochs),
           "--report", str(report), *(["--bound"] if bind else []), *(["--train", train] if train else [])]
    subprocess.run(cmd, check=True, env={**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"})
    ranks = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(world)]
    per_gpu = [r["img_per_s"] for r in ranks]
    return {"world": world, "bound": bind, "per_gpu_img_per_s": per_gpu, "mean_per_gpu": sum(per_gpu) / world,
            "cores_used": [round(r["cores_used"], 1) for r in ranks], "workers": [r["workers"] for r in ranks],
            "total_img_per_s": sum(per_gpu), "pss_mb_sum": sum(r["pss_mb"] for r in ranks),
            "store_pss_mb_sum": sum(r["store_maps_mb"]["pss"] for r in ranks),
            "store_rss_mb_sum": sum(r["store_maps_mb"]["rss"] for r in ranks), "ranks": ranks}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10000)
    p.add_argument("--worlds", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--configs", default=None, help="which rows (default: all), comma-separated")
    p.add_argument("--repeats", type=int, default=1, help="runs of each rank count, interleaved; medians reported")
    p.add_argument("--epochs-scale", type=float, default=1.0, help="multiply each row's timed epochs")
    p.add_argument("--bind", choices=("no", "yes", "both"), default="no",
                   help="yes: give each rank its own equal slice of the cores before it imports gpufeed (as "
                        "numactl or a scheduler's cores-per-task do); both: every row bound and not, interleaved")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="ddp_bench.json")
    p.add_argument("--train", metavar="MODEL", help="instead of the loader alone, train MODEL (resnet18, ...) "
                   "in DistributedDataParallel: rows jpeg (the Loader's defaults) and synthetic, 80 steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bound", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store")
    p.add_argument("--cache", default="auto")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--report")
    a = p.parse_args()
    if a.worker:
        return worker(a)

    import torch

    import gpufeed
    from gpufeed.synth import make_image_folder

    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpufeed-ddp-"))
    if not (work / "images").exists():
        make_image_folder(work / "images", per_class=a.n // 10, classes=10)
    stores = {"raw": work / "raw", "jpeg": work / "jpeg"}
    if not a.train:
        gpufeed.pack(work / "images", stores["raw"], size=256, progress=False, overwrite=True)
    gpufeed.pack(work / "images", stores["jpeg"], mode="jpeg", reencode=False, progress=False, overwrite=True)
    result = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "cpus": os.cpu_count(),
              "workload": OPS_DOC, "images": a.n,
              "store_mb": {k: gpufeed.open(v).nbytes / 1e6 for k, v in stores.items() if v.exists()}, "rows": {}}
    worlds = [int(w) for w in a.worlds.split(",") if int(w) <= torch.cuda.device_count()]
    configs = TRAIN_CONFIGS if a.train else CONFIGS
    if not a.train:
        result["host_read_gb_s"] = host_read_gb_s()
    binds = {"no": [False], "yes": [True], "both": [False, True]}[a.bind]
    for name in (a.configs.split(",") if a.configs else configs):
        kind, cache, epochs = configs[name]
        epochs = max(1, round(epochs * a.epochs_scale))
        for bind in binds:
            repeats = [[run(stores[kind], cache, epochs, w, work, bind and w > 1, a.train) for w in worlds]
                       for _ in range(a.repeats)]
            runs = []
            for k, w in enumerate(worlds):  # the repeat with the median per-GPU rate stands for this rank count
                tries = sorted((rep[k] for rep in repeats), key=lambda r: r["mean_per_gpu"])
                median = dict(tries[len(tries) // 2], repeats_per_gpu=[t["mean_per_gpu"] for t in tries])
                runs.append(median)
            for r in runs:
                r["efficiency_vs_1"] = r["mean_per_gpu"] / runs[0]["mean_per_gpu"]
            result["rows"][f"{name}{'-bound' if bind else ''}"] = runs
            Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(table(result))
    Path(a.out).with_suffix(".md").write_text(table(result) + "\n")


def host_read_gb_s(gigabytes: float = 8.0, repeats: int = 3) -> float:
    """Host memory read bandwidth with every core reading its slice of one array (numpy's reductions
    let go of the GIL): the ceiling of the raw host tier, whose GPUs read the store's pages over PCIe
    from this memory. The best of `repeats`."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    words = np.ones(int(gigabytes * 2**30) // 8, np.uint64)
    threads = len(os.sched_getaffinity(0))
    bounds = np.linspace(0, len(words), threads + 1).astype(int)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda k: words[bounds[k]:bounds[k + 1]].sum(), range(threads)))
            best = max(best, words.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def table(result: dict) -> str:
    """The rows as a markdown table: per-GPU rate, of one rank's and of the synthetic row's at the same
    rank count and binding, cores used and decode workers per rank."""
    rows = result["rows"]
    lines = ["| row | ranks | bound | per GPU img/s (repeats) | of 1 rank | of synthetic | CPU cores used per rank "
             "| decode workers per rank |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, runs in rows.items():
        ceiling = rows.get("synthetic-bound" if name.endswith("-bound") else "synthetic")
        for r in runs:
            ref = next((c for c in ceiling or [] if c["world"] == r["world"]), None)
            of_ceiling = f"{r['mean_per_gpu'] / ref['mean_per_gpu']:.1%}" if ref and ref is not r else "-"
            lines.append(f"| {name.removesuffix('-bound')} | {r['world']} | {'yes' if r['bound'] else 'no'} "
                         f"| {r['mean_per_gpu']:,.0f} ({', '.join(f'{x:,.0f}' for x in r['repeats_per_gpu'])}) "
                         f"| {r['efficiency_vs_1']:.1%} | {of_ceiling} | {', '.join(map(str, r['cores_used']))} "
                         f"| {', '.join(str(w) for w in r['workers'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
