"""JPEG-store loader throughput alone (no model) vs. the usual GPU-decode recipes, on ImageNet-like JPEGs.

Workload (issue 4): `--n` generated 500x375 quality-90 JPEGs packed with mode="jpeg" keeping the
original bytes, RandomResizedCrop 224 + flip + normalize -> fp16 NCHW, batch 256, `--epochs` timed
epochs after a warm-up epoch. Rows: the Loader's defaults; chosen decoders and CPU decode workers
(`--grid DECODERS:WORKERS,...` instead of the standard ones); torchvision's batched nvJPEG
`decode_jpeg` + a per-image RandomResizedCrop loop; DALI where nvidia-dali is installed. Rows are
interleaved over `--repeats`; the table gives median (min-max) img/s.

    python benchmarks/jpeg_bench.py --n 10000 --out jpeg.json
    python benchmarks/jpeg_bench.py --workdir /tmp/tb10 --only defaults --tuning pipelines=2 --repeats 2

`--tuning KEY=VALUE,...`: the gpufeed rows' `gpufeed.decode.tuning.Tuning` fields (train_bench's
`jpeg:KEY=VALUE` settings). `--trace PATH`: a Chrome trace of 12 batches of the default loader.
`--workdir` keeps the images (its `images/`, train_bench's too) and packs `store/` there each run.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

import common
import feeds

SMOKE = dict(n=24, image="64x48", size=32, batch=4, epochs=1, device="cpu", only="defaults", workdir=None)


def _stage_seconds(stats: dict) -> dict:
    """The loader's seconds per stage, with the decode stage split into its GPU and CPU parts."""
    return stats["seconds"] | {f"decode.{k}": v for k, v in stats["decode_seconds"].items()}


def gpufeed_jpeg(a, store, workers: int | None, decoders: tuple[str, ...] | None) -> dict:
    """The gpufeed Loader on the store: a warm-up epoch, then `a.epochs` timed."""
    import gpufeed
    from gpufeed.bench.common import cpu_seconds, sync

    given = {"decoders": decoders} if decoders else {}
    loader = gpufeed.Loader(store, batch_size=a.batch, device=a.device, augment=feeds.ops(size=a.size),
                            num_workers=workers, tuning=a.tuned, **given)
    cuda = a.device.startswith("cuda")
    for _ in loader:
        pass
    sync(a.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = loader.stats()
    before, seconds = first["decoded_by"], _stage_seconds(first)
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(a.epochs):
        for _ in loader:
            pass
    sync(a.device)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0  # before close: the decode workers still run
    stats = loader.stats()
    used = peak = None
    if cuda:
        free, total = torch.cuda.mem_get_info()
        used, peak = (total - free) / 1e9, torch.cuda.max_memory_allocated() / 1e9
    loader.close()
    batches = a.epochs * len(loader)
    return {"img_per_s": batches * a.batch / wall, "cpu_cores_used": cpu / wall, "gpu_used_gb": used,
            "gpu_peak_gb": peak, "decoded_by": {k: v - before.get(k, 0) for k, v in stats["decoded_by"].items()},
            "rates_img_per_s": stats["decoder_rates"], "decoders": stats["decoders"],
            "stage_s_per_batch": {k: (v - seconds.get(k, 0)) / batches for k, v in _stage_seconds(stats).items()}}


def torchvision_nvjpeg_loop(a, store, batches: int = 20) -> dict:
    """Batched nvJPEG decode, then a per-image RandomResizedCrop loop (the common GPU recipe)."""
    from torchvision.io import decode_jpeg
    from torchvision.transforms import v2

    from gpufeed.bench.common import cpu_seconds

    rrc = v2.RandomResizedCrop(a.size, antialias=True)
    mean = torch.tensor(feeds.MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(feeds.STD, device="cuda").view(1, 3, 1, 1) * 255
    g = torch.Generator().manual_seed(0)

    def run(count):
        for _ in range(count):
            idx = torch.randperm(len(store), generator=g)[:a.batch]
            images = decode_jpeg([store.encoded(int(i)) for i in idx], device="cuda")
            crops = torch.stack([rrc(im) for im in images])
            flip = torch.rand(a.batch, device="cuda") < 0.5
            crops = torch.where(flip.view(-1, 1, 1, 1), crops.flip(3), crops)
            ((crops.float() - mean) / std).half()

    run(3)
    torch.cuda.synchronize()
    c0, t0 = cpu_seconds(), time.perf_counter()
    run(batches)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"img_per_s": batches * a.batch / wall, "cpu_cores_used": (cpu_seconds() - c0) / wall}


def dali(a, folder: Path, threads: int) -> dict:
    """feeds.dali_loader on the same JPEG files, timed over `a.epochs` after one."""
    from gpufeed.bench.common import cpu_seconds

    loader = feeds.dali_loader(folder, a.batch, threads, [m * 255 for m in feeds.MEAN],
                               [s * 255 for s in feeds.STD], a.size)

    def run(epochs: int) -> int:
        return sum(out[0]["images"].shape[0] for _ in range(epochs) for out in loader)

    run(1)
    torch.cuda.synchronize()
    c0, t0 = cpu_seconds(), time.perf_counter()
    images = run(a.epochs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info()
    return {"img_per_s": images / wall, "cpu_cores_used": (cpu_seconds() - c0) / wall,
            "gpu_used_gb": (total - free) / 1e9, "threads": threads}


def trace(a, store, path: str) -> None:
    """A Chrome trace of 12 batches of the default loader after a warm-up epoch: the loader's
    stage ranges on each pipeline thread show where a batch's time goes."""
    import gpufeed
    from gpufeed.bench.common import sync

    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if a.device.startswith("cuda") else []
    with gpufeed.Loader(store, batch_size=a.batch, device=a.device, augment=feeds.ops(size=a.size),
                        tuning=a.tuned) as loader:
        for _ in loader:
            pass
        with torch.profiler.profile(activities=activities) as prof:
            for k, _ in enumerate(loader):
                if k == 11:
                    break
            sync(a.device)
    prof.export_chrome_trace(path)


def rows(a, store, work: Path) -> dict:
    """name -> a function measuring that row once."""
    runs = {"gpufeed jpeg, defaults": lambda: gpufeed_jpeg(a, store, None, None)}
    cells = [("+".join(d), w) for d in (("hw", "nvjpeg", "cpu"), ("hw", "nvjpeg", "cuda", "cpu"), ("nvjpeg", "cpu"),
                                        ("hw", "cpu")) for w in (4, 12)]
    if a.grid:  # e.g. "nvjpeg+cpu:4,hw+nvjpeg+cpu:8": decoders, CPU decode workers
        cells = [(names, int(workers)) for names, workers in (cell.split(":") for cell in a.grid.split(","))]
    for names, workers in cells:
        runs[f"gpufeed jpeg, {names}, {workers} CPU workers"] = (
            lambda d=tuple(names.split("+")), w=workers: gpufeed_jpeg(a, store, w, d))
    if not a.grid and a.device.startswith("cuda"):
        runs["torchvision batched decode_jpeg + per-image RRC loop"] = lambda: torchvision_nvjpeg_loop(a, store)
        for threads in (8, 16) if feeds.has_dali() else ():
            runs[f"DALI, mixed decoder, {threads} threads"] = lambda t=threads: dali(a, work / "images", t)
    return {n: m for n, m in runs.items() if not a.only or any(word in n for word in a.only.split(","))}


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=10000, help="generated images (made once per --workdir)")
    p.add_argument("--image", default="500x375", help="generated images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's side")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workdir", default=None)
    p.add_argument("--trace", help="also write a torch.profiler Chrome trace of the default loader here")
    p.add_argument("--repeats", type=int, default=1, help="measure each row this many times, interleaved")
    p.add_argument("--only", help="run only the rows whose name holds one of these comma-separated words")
    p.add_argument("--grid", help="instead of the standard rows, the defaults and these loaders: comma-separated "
                                  "DECODERS:CPU_WORKERS, e.g. nvjpeg+cpu:4")
    p.add_argument("--tuning", default="", help="Tuning fields for the gpufeed rows, e.g. pipelines=2,gpu_min=0.3")
    a = common.parse(p, argv, SMOKE)
    bad = [cell for cell in (a.grid.split(",") if a.grid else []) if not re.fullmatch(r"[a-z+]+:\d+", cell)]
    if bad:
        p.error(f"--grid {bad[0]!r}: expected DECODERS:CPU_WORKERS, e.g. nvjpeg+cpu:4")
    a.tuned = feeds.tuning(feeds.settings(":" + a.tuning))
    import gpufeed

    with common.workdir(a.workdir, "gpufeed-jpeg-") as work:
        width, height = (int(x) for x in a.image.split("x"))
        if not (work / "images").exists():
            from gpufeed.synth import make_image_folder

            make_image_folder(work / "images", per_class=max(1, a.n // 10), classes=10, width=width, height=height)
        report = gpufeed.pack(work / "images", work / "store", mode="jpeg", reencode=False, progress=False,
                              overwrite=True)
        store = gpufeed.open(work / "store")
        chosen = rows(a, store, work)
        results: dict[str, list[dict]] = {}
        for _ in range(a.repeats):  # rows interleaved, so a drift of the machine touches each alike
            for name, measure in chosen.items():
                if a.device.startswith("cuda"):
                    torch.cuda.empty_cache()  # each row's GPU memory figure counts what it holds itself
                try:
                    r = measure()
                except Exception as e:  # an optional comparison that is not installed here, or a decoder missing
                    r = {"error": f"{type(e).__name__}: {e}"[:300]}
                results.setdefault(name, []).append(r)
                print(f"{name:62s}", r.get("error") or f"{r['img_per_s']:9.0f} img/s", flush=True)
        if a.trace:
            trace(a, store, a.trace)
        return common.write(a, __file__, results, table(results), a.device, images=len(store),
                            kb_per_image=store.nbytes / len(store) / 1e3, pack_img_per_s=report.images_per_s,
                            tuning=a.tuning)


def table(results: dict[str, list[dict]]) -> str:
    """Per row: median (min-max) img/s and CPU cores, GPU GB in use, images by decoder (first run)."""
    lines = []
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append([name, runs[0]["error"][:80], "-", "-", "-", "-"])
            continue
        lines.append([name, common.cell([r["img_per_s"] for r in ok]),
                      common.cell([r["cpu_cores_used"] for r in ok], "{:.1f}"),
                      common.cell([r.get("gpu_used_gb") for r in ok], "{:.1f}"),
                      " ".join(f"{k} {v}" for k, v in (ok[0].get("decoded_by") or {}).items()) or "-", len(ok)])
    return common.table(["row", "img/s", "CPU cores", "GPU GB", "decoded by (first run)", "runs"], lines)


if __name__ == "__main__":
    main()
