"""JPEG-store loader throughput vs. the usual GPU-decode recipe, on ImageNet-like JPEGs.

Workload (issue 4): ~10k 500x375 quality-90 JPEGs packed with mode="jpeg" keeping the original
bytes, RandomResizedCrop 224 + flip + normalize -> fp16 NCHW, batch 256, >= 2 epochs after a
warm-up epoch.

    PYTHONPATH=src python benchmarks/jpeg_bench.py --n 10000 --out jpeg.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import gpufeed
from gpufeed.bench.common import cpu_seconds
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.synth import make_image_folder

OPS = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()]


def _stage_seconds(stats: dict) -> dict:
    """The loader's seconds per stage, with the decode stage split into its GPU and CPU parts."""
    return stats["seconds"] | {f"decode.{k}": v for k, v in stats["decode_seconds"].items()}


def gpufeed_jpeg(store, epochs: int, batch: int, workers: int | None, decoders: tuple[str, ...] | None) -> dict:
    given = {"decoders": decoders} if decoders else {}
    loader = gpufeed.Loader(store, batch_size=batch, device="cuda", augment=OPS, num_workers=workers, **given)
    for _ in loader:
        pass
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    first = loader.stats()
    before, seconds = first["decoded_by"], _stage_seconds(first)
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(epochs):
        for _ in loader:
            pass
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0  # before close: the decode workers still run
    stats, (free, total) = loader.stats(), torch.cuda.mem_get_info()
    loader.close()
    counts = {k: v - before.get(k, 0) for k, v in stats["decoded_by"].items()}
    return {"img_per_s": epochs * len(loader) * batch / wall, "cpu_cores_used": cpu / wall,
            "gpu_used_gb": (total - free) / 1e9, "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
            "decoded_by": counts, "rates_img_per_s": stats["decoder_rates"], "decoders": stats["decoders"],
            "stage_s_per_batch": {k: (v - seconds.get(k, 0)) / (epochs * len(loader))
                                  for k, v in _stage_seconds(stats).items()}}


def torchvision_nvjpeg_loop(store, batches: int, batch: int) -> dict:
    """Batched nvJPEG decode, then a per-image RandomResizedCrop loop (the common GPU recipe)."""
    from torchvision.io import decode_jpeg
    from torchvision.transforms import v2

    rrc = v2.RandomResizedCrop(224, antialias=True)
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    g = torch.Generator().manual_seed(0)

    def run(count):
        for _ in range(count):
            idx = torch.randperm(len(store), generator=g)[:batch]
            images = decode_jpeg([store.encoded(int(i)) for i in idx], device="cuda")
            crops = torch.stack([rrc(im) for im in images])
            flip = torch.rand(batch, device="cuda") < 0.5
            crops = torch.where(flip.view(-1, 1, 1, 1), crops.flip(3), crops)
            ((crops.float() - mean) / std).half()

    run(3)
    torch.cuda.synchronize()
    c0, t0 = cpu_seconds(), time.perf_counter()
    run(batches)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"img_per_s": batches * batch / wall, "cpu_cores_used": (cpu_seconds() - c0) / wall}


def dali_loader(folder: Path, batch: int, threads: int, mean, std):
    """NVIDIA DALI on the JPEG files under `folder`, the issue's reference recipe: mixed decoder with the
    random crop fused in (`decoders.image_random_crop`), resize 224, flip + normalize (`mean`, `std`
    in 0-255) -> fp16 CHW, as torch tensors. An optional comparison: needs the nvidia-dali wheel for
    this CUDA, never a gpufeed dependency."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device(), seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(folder), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW", mean=list(mean),
                                          std=list(std), mirror=fn.random.coin_flip())
        return images, labels.gpu()

    return DALIGenericIterator([pipe()], ["images", "labels"], reader_name="reader", auto_reset=True,
                               last_batch_policy=LastBatchPolicy.DROP)


def dali(folder: Path, epochs: int, batch: int, threads: int) -> dict:
    """`dali_loader` on the same JPEG files, timed over `epochs` after one."""
    loader = dali_loader(folder, batch, threads, [0.485 * 255, 0.456 * 255, 0.406 * 255],
                         [0.229 * 255, 0.224 * 255, 0.225 * 255])

    def run(epochs: int) -> int:
        count = 0
        for _ in range(epochs):
            for out in loader:
                count += out[0]["images"].shape[0]
        return count

    run(1)
    torch.cuda.synchronize()
    c0, t0 = cpu_seconds(), time.perf_counter()
    images = run(epochs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    total = torch.cuda.mem_get_info()[1]
    return {"img_per_s": images / wall, "cpu_cores_used": (cpu_seconds() - c0) / wall,
            "gpu_used_gb": (total - torch.cuda.mem_get_info()[0]) / 1e9, "threads": threads}


def trace(store, batch: int, path: str) -> None:
    """A Chrome trace of 12 batches of the default loader after a warm-up epoch: the loader's
    stage ranges on each pipeline thread show where a batch's time goes."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with gpufeed.Loader(store, batch_size=batch, device="cuda", augment=OPS) as loader:
        for _ in loader:
            pass
        with torch.profiler.profile(activities=activities) as prof:
            for k, _ in enumerate(loader):
                if k == 11:
                    break
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="jpeg_bench.json")
    p.add_argument("--trace", help="also write a torch.profiler Chrome trace of the default loader here")
    p.add_argument("--repeats", type=int, default=1, help="measure each row this many times, interleaved")
    p.add_argument("--only", help="run only the rows whose name holds one of these comma-separated words")
    p.add_argument("--grid", help="instead of the standard rows, the defaults and these loaders: comma-separated "
                                  "DECODERS:CPU_WORKERS, e.g. nvjpeg+cpu:4")
    p.add_argument("--pipelines", type=int, help="JPEG pipelines on the GPU (gpufeed.loader.jpeg.PIPELINES_ON_GPU)")
    p.add_argument("--switch-interval", type=float,
                   help="sys.setswitchinterval(SECONDS) for this run (Python's default: 0.005)")
    a = p.parse_args()
    if a.pipelines is not None:
        if a.pipelines < 1:
            p.error(f"--pipelines must be 1 or more, got {a.pipelines}")
        from gpufeed.loader import jpeg as jpeg_path

        jpeg_path.PIPELINES_ON_GPU = a.pipelines
    if a.switch_interval is not None:
        if a.switch_interval <= 0:
            p.error(f"--switch-interval must be a positive number of seconds, got {a.switch_interval}")
        sys.setswitchinterval(a.switch_interval)
    bad = [cell for cell in (a.grid.split(",") if a.grid else []) if not re.fullmatch(r"[a-z+]+:\d+", cell)]
    if bad:
        p.error(f"--grid {bad[0]!r}: expected DECODERS:CPU_WORKERS, e.g. nvjpeg+cpu:4")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpufeed-jpeg-"))
    if not (work / "images").exists():
        make_image_folder(work / "images", per_class=a.n // 10, classes=10)
    report = gpufeed.pack(work / "images", work / "store", mode="jpeg", reencode=False, progress=False,
                          overwrite=True)
    store = gpufeed.open(work / "store")
    result = {"gpu": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "images": len(store),
              "kb_per_image": store.nbytes / len(store) / 1e3, "pack_img_per_s": report.images_per_s, "rows": {}}
    rows = result["rows"]
    runs = {"gpufeed jpeg, defaults": lambda: gpufeed_jpeg(store, a.epochs, a.batch, None, None)}
    for decoders in (("hw", "nvjpeg", "cpu"), ("hw", "nvjpeg", "cuda", "cpu"), ("nvjpeg", "cpu"), ("hw", "cpu")):
        for workers in (4, 12):
            runs[f"gpufeed jpeg, {'+'.join(decoders)}, {workers} CPU workers"] = (
                lambda d=decoders, w=workers: gpufeed_jpeg(store, a.epochs, a.batch, w, d))
    runs["torchvision batched decode_jpeg + per-image RRC loop"] = lambda: torchvision_nvjpeg_loop(store, 20, a.batch)
    for threads in (8, 16):
        runs[f"DALI, mixed decoder, {threads} threads"] = lambda t=threads: dali(work / "images", a.epochs, a.batch, t)
    if a.grid:  # e.g. "nvjpeg+cpu:4,hw+nvjpeg+cpu:8": decoders, CPU decode workers
        runs = {"gpufeed jpeg, defaults": runs["gpufeed jpeg, defaults"]}
        for cell in a.grid.split(","):
            names, workers = cell.split(":")
            runs[f"gpufeed jpeg, {names}, {workers} CPU workers"] = (
                lambda d=tuple(names.split("+")), w=int(workers): gpufeed_jpeg(store, a.epochs, a.batch, w, d))
    chosen = {n: m for n, m in runs.items() if not a.only or any(word in n for word in a.only.split(","))}
    for repeat in range(a.repeats):  # rows interleaved, so a drift of the machine touches each alike
        for name, measure in chosen.items():
            torch.cuda.empty_cache()  # each row's GPU memory figure counts what it holds itself
            try:
                r = measure()
            except Exception as e:  # an optional comparison that is not installed here, or a decoder missing
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.setdefault(name, []).append(r)
            stages = " ".join(f"{k} {v * 1e3:.1f}" for k, v in r.get("stage_s_per_batch", {}).items())
            line = r.get("error") or (f"{r['img_per_s']:9.0f} img/s {r['cpu_cores_used']:5.1f} cores "
                                      f"{r.get('decoded_by', '')} ms/batch: {stages}")
            print(f"{name:62s} {line}", flush=True)
    for name, runs_of_row in rows.items():
        rates = [r["img_per_s"] for r in runs_of_row if "img_per_s" in r]
        if rates:
            print(f"{name:62s} median {statistics.median(rates):9.0f} img/s (min {min(rates):.0f}, max "
                  f"{max(rates):.0f}, {len(rates)} runs)")
    if a.trace:
        trace(store, a.batch, a.trace)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
