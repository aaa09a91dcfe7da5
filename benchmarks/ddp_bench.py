"""Per-GPU loader throughput with 1 rank and with N ranks (torchrun, NCCL), and host RAM used.

Issue 6's check: with 2 ranks on a 2-GPU host, each GPU's img/s must be >= 90 % of the
single-GPU figure, on the same raw and jpeg stores, and the ranks together must hold about
one copy of the store in host RAM (page cache / one registered region), not one each.

    python benchmarks/ddp_bench.py --n 10000 --out ddp.json

`--train resnet18` instead trains (train_bench's loop, the model in DistributedDataParallel) fed
by the jpeg store, by one synthetic batch or by DALI (feeds.py's `jpeg`, `synthetic` and `dali` rows;
DALI where nvidia-dali is installed, each rank reading its shard of the image folder with
`--dali-threads` threads): per-GPU training img/s with N ranks against 1 and against the synthetic
ceiling. `--bind yes|both` gives each rank its own equal slice of the cores (both: every row bound
and not, interleaved).

    python benchmarks/ddp_bench.py --n 10000 --train resnet18 --worlds 2 --bind both

Each configuration runs as `torchrun --nproc-per-node W benchmarks/ddp_bench.py --worker ...`
(`--inline`: one rank in this process instead, as `--smoke` does); every rank times whole
epochs after a warm-up epoch and reports its img/s and its PSS (proportional set size: shared pages
are split between the processes mapping them, so the ranks' PSS add up to the RAM they use together).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import common
import feeds
import waits

CONFIGS = {  # name: (store, cache, epochs timed)
    "raw-gpu": ("raw", "gpu", 200),  # raw store, gpu tier
    "raw-host": ("raw", "host", 40),  # raw store, host tier
    "jpeg": ("jpeg", "auto", 6),  # jpeg store, default decoders
}
TRAIN_CONFIGS = {  # `--train`: name: (store, cache or "synthetic", steps timed)
    "synthetic": ("jpeg", "synthetic", 80),  # one batch already on the GPU: the ceiling
    "jpeg": ("jpeg", "auto", 80),  # the jpeg store, the Loader's defaults
    "dali": ("jpeg", "dali", 80),  # DALI on the folder the jpeg store was packed from
}
SMOKE = dict(n=40, image="64x48", size=32, batch=4, warmup=1, device="cpu", worlds="1", inline=True,
             configs=None, epochs_scale=0.01, host_read_gb=0.01, workdir=None)


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


def _join(a: argparse.Namespace):
    """Join the process group: torchrun's ranks by its environment; `--inline`, one rank alone."""
    import torch
    import torch.distributed as dist

    local = 0 if a.inline else int(os.environ["LOCAL_RANK"])
    cuda = a.device.startswith("cuda")
    if a.bound:  # this rank (and its decode worker children) on its own slice of the cores: the host's
        cores = sorted(os.sched_getaffinity(0))  # cores over its GPUs, so one rank has what each of N would
        per = len(cores) // max(1, torch.cuda.device_count() if cuda else int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.sched_setaffinity(0, cores[local * per:(local + 1) * per])
    if cuda:
        torch.cuda.set_device(local)
    how = {"init_method": f"file://{a.report}.init", "rank": 0, "world_size": 1} if a.inline else {}
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local) if cuda else None, **how)
    return local, f"cuda:{local}" if cuda else "cpu"


def worker(a: argparse.Namespace) -> None:
    """One rank: load `--epochs` epochs after a warm-up one; write its numbers as JSON."""
    import torch
    import torch.distributed as dist

    import gpufeed
    from gpufeed.bench.common import cpu_seconds, mapped_mb, sync

    local, device = _join(a)
    if a.train:
        return _train(a, local, device)
    recipe = feeds.ops(size=a.size)
    with gpufeed.Loader(a.store, batch_size=a.batch, device=device, cache=a.cache, augment=recipe) as loader:
        for _ in loader:
            pass
        sync(device)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        epochs = a.epochs * dist.get_world_size()  # as many batches per rank as one rank makes: epochs are shorter
        for _ in range(epochs):
            for _ in loader:
                pass
        sync(device)
        seconds = time.perf_counter() - t0
        cores_used = (cpu_seconds() - cpu0) / seconds
        dist.barrier()  # every rank has read all it will: a page another rank maps later would count twice
        stats = loader.stats()
        result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "tier": stats["tier"],
                  "img_per_s": epochs * len(loader) * loader.batch_sampler.batch_size / seconds,
                  "batches_per_epoch": len(loader), "pss_mb": _pss_mb(), "store_maps_mb": mapped_mb(a.store),
                  "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device != "cpu" else None,
                  "decoded_by": stats.get("decoded_by"), "stage_seconds": stats["seconds"],
                  "images_loaded": stats["images"], "cores_used": cores_used, **_rank_facts(loader)}
        dist.barrier()  # every rank measured while the others still ran
    Path(f"{a.report}.rank{result['rank']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _train(a: argparse.Namespace, local: int, device: str) -> None:
    """One rank of `--train MODEL`: train_bench's loop and feeds (its `jpeg` row: the Loader's
    defaults, each rank its shard; `--cache synthetic`: its `synthetic` row, one batch already on the
    device) with the model in DistributedDataParallel; `--epochs` timed steps after `--warmup`."""
    import torch
    import torch.distributed as dist

    from gpufeed.bench.common import cpu_seconds, mapped_mb, sync
    from gpufeed.bench.training import training_step

    torch.backends.cudnn.benchmark = True
    ddp = functools.partial(torch.nn.parallel.DistributedDataParallel, device_ids=[local] if device != "cpu" else None)
    step = training_step(a.train, device, 1000, ddp)
    store = Path(a.store)  # feeds' rows read <work>/jpeg, DALI <work>/images
    own = a.row.replace(":", ",").replace(",", ":", 1) if a.row else store.name  # jpeg:a=1:b=2 is feeds' jpeg:a=1,b=2
    row = {"synthetic": "synthetic", "dali": f"dali:threads={a.dali_threads}"}.get(a.cache, own)
    feed = feeds.feed(row, store.parent, a.batch, device, a.size, shard=(dist.get_rank(), dist.get_world_size()))
    for _ in range(a.warmup):
        step(*next(feed.batches))
    sync(device)
    dist.barrier()
    watch, before = waits.Watch(), feed.stats()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    each = []  # per step: ms waiting for the batch, ms launching the step, and with --trace images per decoder
    for _ in range(a.epochs):
        s0 = time.perf_counter()
        images, labels = next(feed.batches)
        s1 = time.perf_counter()
        loss = step(images, labels)
        each.append([round(1e3 * (s1 - s0), 3), round(1e3 * (time.perf_counter() - s1), 3)])
        if a.trace and feed.loader is not None:
            each[-1].append(feed.stats().get("decoded_by", {}))
    loss.item()
    sync(device)
    seconds = time.perf_counter() - t0
    cores_used = (cpu_seconds() - cpu0) / seconds
    used = None
    if device != "cpu":
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 1e9
    stats = feed.stats()
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "img_per_s": a.epochs * a.batch / seconds,
              "pss_mb": _pss_mb(), "store_maps_mb": mapped_mb(a.store),
              "decoded_by": stats.get("decoded_by") if stats is not None else None,
              "gpu_used_gb": used, "cores_used": cores_used, **_rank_facts(feed.loader),
              "stages": stages(before, stats, watch.stop(a.epochs, seconds), each, seconds, a.batch,
                               feeds.described(store.parent).get("sample", {})),
              "steps": _steps(each)}
    if a.cache == "dali":
        result["workers"] = a.dali_threads  # DALI's CPU threads stand in the workers' column
    dist.barrier()
    feed.close()
    Path(f"{a.report}.rank{result['rank']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def stages(before: dict | None, after: dict | None, watch: dict, each: list, seconds: float, batch: int,
           sample: dict) -> dict:
    """Where a rank's time went over the timed steps (issue 62's per-stage report): the training loop's
    wait for batches and launch time per step; the decode workers' cores, busy share and images per
    CPU-second; the GPU decoders' share of the images and their rate; the producer's and the GPU
    share's threads' CPU and run-queue ms per step (and every other thread's: waits.py); the host's
    steal per step; and the host memory traffic the loader causes, from byte counts: the JPEG bytes
    read, and an upper bound on the workers' pixels (each image decoded whole, written once and read
    once by the copy to the GPU; DCT-reduced and cropped decodes write less)."""
    steps = len(each)
    out = {"wait_ms_per_step": sum(e[0] for e in each) / steps, "launch_ms_per_step": sum(e[1] for e in each) / steps,
           "threads": watch["threads"], "steal_ms_per_step": watch["os"].get("host_steal_ms")}
    if before is None or after is None:  # the synthetic and dali rows: no gpufeed loader
        return out
    took = {k: after.get("decoded_by", {}).get(k, 0) - before.get("decoded_by", {}).get(k, 0)
            for k in after.get("decoded_by", {})}
    spent = {k: after.get("decode_seconds", {}).get(k, 0.0) - before.get("decode_seconds", {}).get(k, 0.0)
             for k in after.get("decode_seconds", {})}
    cpu, gpu = took.get("cpu", 0), sum(v for k, v in took.items() if k in ("hw", "nvjpeg", "hybrid"))
    workers = after.get("start", {}).get("workers_ready_s")
    workers = len(workers) if isinstance(workers, list) else None
    read = after.get("bytes", {}).get("read", 0) - before.get("bytes", {}).get("read", 0)
    pixels = cpu * sample.get("mean_mpixels", 0.0) * 3e6
    out |= {"images_decoded": took, "gpu_share": gpu / max(1, cpu + gpu),
            "gpu_rates": {k: v for k, v in after.get("decoder_rates", {}).items() if k != "cpu"},
            "workers": workers, "workers_cores": spent.get("workers_cpu", 0.0) / seconds,
            "workers_busy": spent.get("workers_wall", 0.0) / seconds / max(1, workers or 1),
            "cpu_img_per_core_s": cpu / spent["workers_cpu"] if spent.get("workers_cpu") else None,
            "cost_checks": after.get("cost_checks"), "host_gb_s_jpeg_read": read / seconds / 1e9,
            "host_gb_s_pixels_upper": 2 * pixels / seconds / 1e9,
            "producer_stage_ms_per_step": {k: 1e3 * (v - before.get("seconds", {}).get(k, 0.0)) / steps
                                           for k, v in after.get("seconds", {}).items()}}
    return out


def _steps(each: list) -> dict:
    """The per-step record, columns apart; with --trace, each step's images per decoder since the last."""
    out = {"wait_ms": [e[0] for e in each], "launch_ms": [e[1] for e in each]}
    if each and len(each[0]) > 2:
        names = sorted({k for e in each for k in e[2]})
        out["decoded"] = {k: [e[2].get(k, 0) - (each[i - 1][2].get(k, 0) if i else e[2].get(k, 0))
                              for i, e in enumerate(each)] for k in names}
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a: argparse.Namespace, store: Path, cache: str, epochs: int, world: int, work: Path, bind: bool,
        row: str | None = None) -> dict:
    """One configuration at `world` ranks: each rank's figures and their sums. `row`: `--train`'s
    feeds row with its settings (`jpeg:gpu_min=0.1`)."""
    tag = "".join(c if c.isalnum() or c in "._" else "-" for c in row or "")
    report = work / f"r-{store.name}-{cache}-{tag}-{world}-{'bound' if bind else 'shared'}"
    args = ["--worker", "--store", str(store), "--cache", cache, "--epochs", str(epochs), "--report", str(report),
            "--device", a.device, "--batch", str(a.batch), "--size", str(a.size), "--warmup", str(a.warmup),
            "--dali-threads", str(a.dali_threads), *(["--row", row] if row else []),
            *(["--bound"] if bind else []), *(["--train", a.train] if a.train else []),
            *(["--trace"] if a.trace else []), "--data", a.data]
    if a.inline:
        worker(parser().parse_args([*args, "--inline"]))
    else:
        # a free port, not a fixed one: two runs at once (a parallel test run) met at the same rendezvous
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", __file__, *args]
        subprocess.run(cmd, check=True, env={**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"})
    ranks = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(world)]
    per_gpu = [r["img_per_s"] for r in ranks]
    return {"world": world, "bound": bind, "per_gpu_img_per_s": per_gpu, "stages": [r.get("stages") for r in ranks], "mean_per_gpu": sum(per_gpu) / world,
            "cores_used": [round(r["cores_used"], 1) for r in ranks], "workers": [r["workers"] for r in ranks],
            "total_img_per_s": sum(per_gpu), "pss_mb_sum": sum(r["pss_mb"] for r in ranks),
            "store_pss_mb_sum": sum(r["store_maps_mb"]["pss"] for r in ranks),
            "store_rss_mb_sum": sum(r["store_maps_mb"]["rss"] for r in ranks), "ranks": ranks}


def parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=10000, help="generated images")
    p.add_argument("--image", default="500x375", help="--data smooth: the images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--data", choices=feeds.DATA, default="photos",
                   help="photos: photo-like JPEGs of ImageNet's spread of sizes and qualities (photos.py); "
                        "smooth: generated --image-sized q90 ones")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's side")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--device", default="cuda", help="cuda (NCCL, a GPU per rank) or cpu (gloo)")
    p.add_argument("--worlds", default="1,2,4", help="rank counts to run, those the GPUs here allow (default 1,2,4)")
    p.add_argument("--configs", default=None, help="which rows (default: all), comma-separated; with --train, "
                   "jpeg rows take feeds.py's settings, `jpeg:gpu_min=0.1:starved=0.05`")
    p.add_argument("--repeats", type=int, default=1, help="runs of each rank count, interleaved; medians reported")
    p.add_argument("--epochs-scale", type=float, default=1.0, help="multiply each row's timed epochs")
    p.add_argument("--warmup", type=int, default=15, help="--train: steps before the timed ones")
    p.add_argument("--bind", choices=("no", "yes", "both"), default="no",
                   help="yes: give each rank its own slice of the cores, the host's cores over its GPUs, before it "
                        "imports gpufeed (as numactl or a scheduler's cores-per-task do; one rank too, so it has "
                        "what each of N has); both: every row bound and not, interleaved")
    p.add_argument("--host-read-gb", type=float, default=8.0, help="array size of the host read bandwidth figure")
    p.add_argument("--workdir", default=None, help="keep the images and stores here (default: a temporary folder)")
    p.add_argument("--train", metavar="MODEL", help="instead of the loader alone, train MODEL (resnet18, ...) "
                   "in DistributedDataParallel: rows synthetic, jpeg (the Loader's defaults) and dali, 80 steps")
    p.add_argument("--dali-threads", type=int, default=8, help="--train's dali row: DALI's CPU threads per rank "
                   "(default 8, as train_bench's dali row)")
    p.add_argument("--inline", action=argparse.BooleanOptionalAction, default=False,
                   help="one rank in this process instead of torchrun (--smoke; rank counts over 1 are left out)")
    p.add_argument("--trace", action="store_true", help="--train: record each step's images per decoder "
                   "(loader.stats() read every step)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bound", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict | None:
    a = common.parse(parser(), argv, SMOKE)
    if a.worker:
        return worker(a)
    import torch

    import gpufeed

    with common.workdir(a.workdir, "gpufeed-ddp-") as work:
        width, height = (int(x) for x in a.image.split("x"))
        feeds.prepare(work, a.n, (width, height), round(a.size * 8 / 7), data=a.data)
        stores = {"raw": work / "raw", "jpeg": work / "jpeg"}
        result = {"workload": f"RandomResizedCrop {a.size} + flip + normalize -> fp16, batch {a.batch}",
                  "images": a.n, "data": feeds.described(work), "store_mb": {k: gpufeed.open(v).nbytes / 1e6 for k, v in stores.items()}, "rows": {}}
        cuda = a.device.startswith("cuda")
        worlds = [int(w) for w in a.worlds.split(",") if not cuda or int(w) <= torch.cuda.device_count()]
        worlds = [w for w in worlds if w == 1] if a.inline else worlds
        configs = TRAIN_CONFIGS if a.train else CONFIGS
        if not a.train:
            result["host_read_gb_s"] = host_read_gb_s(a.host_read_gb)
        names = a.configs.split(",") if a.configs else [n for n, c in configs.items() if cuda or c[1] != "gpu"]
        if "dali" in names and (not cuda or not feeds.has_dali()):
            names.remove("dali")
            print("nvidia-dali not installed or no GPU: no dali row", flush=True)
        binds = {"no": [False], "yes": [True], "both": [False, True]}[a.bind]
        tries: dict[str, list[list[dict]]] = {}  # row name: per repeat, one run per rank count
        for repeat in range(a.repeats):  # every row once per repeat, in turn: rows compared come from close in time
            for name in names if repeat % 2 == 0 else names[::-1]:
                kind, cache, epochs = configs[name.partition(":")[0]]
                epochs = max(1, round(epochs * a.epochs_scale))
                row = name if a.train and ":" in name else None
                for bind in binds:
                    runs = [run(a, stores[kind], cache, epochs, w, work, bind, row) for w in worlds]
                    tries.setdefault(f"{name}{'-bound' if bind else ''}", []).append(runs)
                    result["rows"] = {row: _median(rep) for row, rep in tries.items()}
                    if a.out:  # what has run so far, should a later row fail
                        Path(a.out).write_text(json.dumps(result, indent=1))
        rows = result.pop("rows")
        tables = table(rows) + ("\n\n" + stage_table(rows) if a.train else "")
        return common.write(a, __file__, rows, tables, a.device, **result)


def _median(repeats: list[list[dict]]) -> list[dict]:
    """Per rank count, the repeat with the median per-GPU rate (all repeats' rates beside it), and its
    rate against the first rank count's."""
    runs = []
    for k in range(len(repeats[0])):
        tries = sorted((rep[k] for rep in repeats), key=lambda r: r["mean_per_gpu"])
        runs.append(dict(tries[len(tries) // 2], repeats_per_gpu=[t["mean_per_gpu"] for t in tries]))
    for r in runs:
        r["efficiency_vs_1"] = r["mean_per_gpu"] / runs[0]["mean_per_gpu"]
    return runs


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


STAGE_COLUMNS = (  # (heading, stages key or a function of the stages, format)
    ("wait ms/step", "wait_ms_per_step", "{:.1f}"), ("launch ms/step", "launch_ms_per_step", "{:.1f}"),
    ("GPU decoders' share", "gpu_share", "{:.0%}"), ("workers busy", "workers_busy", "{:.0%}"),
    ("workers' cores", "workers_cores", "{:.1f}"), ("img/s per worker core", "cpu_img_per_core_s", "{:,.0f}"),
    ("training thread run / runqueue ms/step",
     lambda st: (st["threads"].get("MainThread", {}).get("run_ms"), st["threads"].get("MainThread", {}).get("runqueue_ms")),
     "{}"),
    ("producer run / runqueue ms/step",
     lambda st: tuple(sum(v.get(k, 0.0) for n, v in st["threads"].items() if n.startswith("gpufeed-producer"))
                      for k in ("run_ms", "runqueue_ms")), "{}"),
    ("GPU share thread run ms/step",
     lambda st: round(sum(v.get("run_ms", 0.0) for n, v in st["threads"].items() if n.startswith("gpufeed-gpushare")), 2),
     "{}"),
    ("steal ms/step", "steal_ms_per_step", "{}"), ("host GB/s: JPEG read", "host_gb_s_jpeg_read", "{:.2f}"),
    ("pixels (upper bound)", "host_gb_s_pixels_upper", "{:.2f}"),
)


def stage_table(rows: dict) -> str:
    """Per row, rank count and rank: the per-stage report (`stages`)."""
    lines = []
    for name, runs in rows.items():
        for r in runs:
            for rank, st in enumerate(r.get("stages") or []):
                if not st:
                    continue
                cells = []
                for _, key, fmt in STAGE_COLUMNS:
                    value = key(st) if callable(key) else st.get(key)
                    cells.append("-" if value is None else fmt.format(value))
                lines.append([name.removesuffix("-bound"), r["world"], "yes" if r["bound"] else "no", rank, *cells])
    return common.table(["row", "ranks", "bound", "rank", *(c[0] for c in STAGE_COLUMNS)], lines)


def table(rows: dict) -> str:
    """Per row and rank count: per-GPU rate (the repeats), of one rank's and of the synthetic row's at
    the same rank count and binding, cores used and decode workers per rank."""
    lines = []
    for name, runs in rows.items():
        ceiling = rows.get("synthetic-bound" if name.endswith("-bound") else "synthetic")
        for r in runs:
            ref = next((c for c in ceiling or [] if c["world"] == r["world"]), None)
            of_ceiling = f"{r['mean_per_gpu'] / ref['mean_per_gpu']:.1%}" if ref and ref is not r else "-"
            lines.append([name.removesuffix("-bound"), r["world"], "yes" if r["bound"] else "no",
                          f"{r['mean_per_gpu']:,.0f} ({', '.join(f'{x:,.0f}' for x in r['repeats_per_gpu'])})",
                          f"{r['efficiency_vs_1']:.1%}", of_ceiling, ", ".join(map(str, r["cores_used"])),
                          ", ".join(str(w) for w in r["workers"])])
    return common.table(["row", "ranks", "bound", "per GPU img/s (repeats)", "of 1 rank", "of synthetic",
                         "CPU cores used per rank", "decode workers per rank"], lines)


if __name__ == "__main__":
    main()
