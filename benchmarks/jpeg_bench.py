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
import tempfile
import time
from pathlib import Path

import torch

import gpufeed
from gpufeed.bench.common import cpu_seconds
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.synth import make_image_folder

OPS = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()]


def gpufeed_jpeg(store, epochs: int, batch: int, threads: int | None, decoders=("hw", "nvjpeg", "cpu"),
                 pipelines: int | None = None) -> dict:
    loader = gpufeed.Loader(store, batch_size=batch, device="cuda", augment=OPS, decode_threads=threads,
                            decoders=decoders, decode_pipelines=pipelines)
    for _ in loader:
        pass
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = loader.stats()["decoded_by"]
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _ in range(epochs):
        for _ in loader:
            pass
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    counts = {k: v - before.get(k, 0) for k, v in loader.stats()["decoded_by"].items()}
    return {"img_per_s": epochs * len(loader) * batch / wall, "cpu_cores_used": (cpu_seconds() - c0) / wall,
            "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9, "decoded_by": counts,
            "rates_img_per_s": loader.stats()["decoder_rates"], "decoders": loader.stats()["decoders"]}


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
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpufeed-jpeg-"))
    if not (work / "images").exists():
        make_image_folder(work / "images", per_class=a.n // 10, classes=10)
    report = gpufeed.pack(work / "images", work / "store", mode="jpeg", reencode=False, progress=False,
                          overwrite=True)
    store = gpufeed.open(work / "store")
    result = {"gpu": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "images": len(store),
              "kb_per_image": store.nbytes / len(store) / 1e3, "pack_img_per_s": report.images_per_s, "rows": {}}
    rows = result["rows"]
    rows["gpufeed jpeg, all decoders (default)"] = gpufeed_jpeg(store, a.epochs, a.batch, None)
    for pipelines, threads in ((2, 4), (3, 3), (3, 6), (4, 4)):
        rows[f"gpufeed jpeg, all decoders, {pipelines} pipelines, {threads} CPU threads"] = gpufeed_jpeg(
            store, a.epochs, a.batch, threads, pipelines=pipelines)
    rows["gpufeed jpeg, nvJPEG + CPU threads only"] = gpufeed_jpeg(store, a.epochs, a.batch, 4, ("nvjpeg", "cpu"))
    rows["torchvision batched nvJPEG + per-image RRC loop"] = torchvision_nvjpeg_loop(store, 20, a.batch)
    if a.trace:
        trace(store, a.batch, a.trace)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for name, r in rows.items():
        print(f"{name:50s} {r['img_per_s']:9.0f} img/s {r['cpu_cores_used']:5.1f} cores  {r.get('decoded_by', '')}")


if __name__ == "__main__":
    main()
