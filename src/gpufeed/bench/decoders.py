"""Experiment 3: JPEG decoders: img/s on one core and on all, and quality vs size vs decode time."""

from __future__ import annotations

import io
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.bench.common import Context, Figure, measure
from gpufeed.decode.base import Encoded
from gpufeed.synth import encode_jpegs, natural_images

QUALITIES = (95, 90, 75, 50)


def _pil(data: bytes) -> None:
    np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _torchvision(data: torch.Tensor) -> None:
    decode_jpeg(data, mode=ImageReadMode.RGB)


def _gpu_decoders(ctx: Context) -> dict:
    """name -> decode(Encoded batch) on the GPU."""
    if not ctx.cuda:
        return {}
    found = {"torchvision decode_jpeg on cuda (batched)": lambda b: decode_jpeg(b.tensors(), mode=ImageReadMode.RGB,
                                                                                device="cuda")}
    from gpufeed.decode.nvimgcodec import NvImgCodecDecoder  # its nvImageCodec import waits for the constructor

    labels = {"hw": "hardware engines (nvImageCodec)", "cuda": "CUDA hybrid (nvImageCodec)"}
    for name, label in labels.items():
        try:
            found[label] = NvImgCodecDecoder(torch.device("cuda", torch.cuda.current_device()), name).decode
        except Exception:  # not installed or no engines: the figure's note says so
            pass
    return found


def run(ctx: Context) -> list[Figure]:
    count = 16 if ctx.quick else 64
    images = natural_images(count)
    cores = os.cpu_count() or 1
    gpu = _gpu_decoders(ctx)
    quality = Figure("decode_quality", "JPEG quality vs file size vs decode time (500×375)",
                     "mean file size (KB), quality 50 → 95", "decode time per image (ms)")
    speed = Figure("decode_throughput", f"JPEG decode throughput (500×375, quality 90, {cores} cores)",
                   "decoder", "images/s", kind="bar")
    if ctx.cuda and len(gpu) < 3:
        speed.note = quality.note = "nvImageCodec decoders not measured: not installed or unavailable"
    for q in QUALITIES:
        datas = encode_jpegs(images, q)
        batch = Encoded.joined(datas)
        tensors = batch.tensors()
        kb = float(np.mean([len(d) for d in datas])) / 1e3
        reps = ctx.repeats()
        quality.line("Pillow").add(kb, [s / count * 1e3 for s in measure(lambda: [_pil(d) for d in datas], reps, "cpu")])
        quality.line("torchvision (libjpeg-turbo)").add(
            kb, [s / count * 1e3 for s in measure(lambda: [_torchvision(t) for t in tensors], reps, "cpu")])
        for name, dec in gpu.items():
            quality.line(name).add(kb, [s / count * 1e3 for s in measure(lambda: dec(batch), reps, "cuda")])
        if q == 90:
            _throughput(speed, datas, batch, gpu, cores, reps)
    return [quality, speed]


def _throughput(fig: Figure, datas: list[bytes], batch: Encoded, gpu: dict, cores: int, reps: int) -> None:
    n, tensors = len(datas), batch.tensors()
    one, every = fig.line("one core"), fig.line(f"all {cores} cores")
    for name, fn, pool_cls in (("Pillow", _pil, ProcessPoolExecutor), ("torchvision (libjpeg-turbo)", _torchvision,
                                                                          ThreadPoolExecutor)):
        items = datas if fn is _pil else tensors
        one.add(name, [n / s for s in measure(lambda: [fn(d) for d in items], reps, "cpu")])
        with pool_cls(cores) as pool:  # Pillow holds the GIL: processes; libjpeg-turbo via torch: threads
            every.add(name, [n / s for s in measure(lambda: list(pool.map(fn, items)), reps, "cpu")])
    for name, dec in gpu.items():
        every.add(name, [n / s for s in measure(lambda: dec(batch), reps, "cuda")])
        one.add(name, [float("nan")] * reps)
