"""Experiment 3: JPEG decoders: img/s on one core and on all, and quality vs size vs decode time."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from gpufeed.bench.common import Context, Figure, measure
from gpufeed.decode.base import Encoded
from gpufeed.decode.codecs import cpu, pixels
from gpufeed.processes import process_pool
from gpufeed.synth import encode_jpegs, natural_images

QUALITIES = (95, 90, 75, 50)
LIBJPEG = "nvImageCodec CPU (libjpeg-turbo)"


def _pil(data: bytes) -> None:
    np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _libjpeg(data: np.ndarray) -> None:
    pixels.whole(data)  # what `decode.codecs.cpu`'s threads decode whole JPEGs with


def _gpu_decoders(ctx: Context) -> tuple[dict, list[str]]:
    """(name -> decode(Encoded batch) on the GPU, why any is not measured)."""
    if not ctx.cuda:
        return {}, []
    from gpufeed.decode.codecs import nvjpeg
    from gpufeed.decode.codecs.nvimgcodec import NvImgCodecDecoder  # its nvImageCodec import waits for the constructor

    device = torch.device("cuda", torch.cuda.current_device())
    found, missing = {}, []
    try:
        found["nvJPEG batched (torchvision)"] = nvjpeg.NvJpegDecoder(device).decode
    except ImportError as e:
        missing.append(str(e))
    labels = {"hw": "hardware engines (nvImageCodec)", "cuda": "CUDA hybrid (nvImageCodec)"}
    for name, label in labels.items():
        try:
            found[label] = NvImgCodecDecoder(device, name).decode
        except Exception:  # noqa: BLE001  not installed or no engines
            missing.append(f"{label}: not installed or unavailable")
    return found, missing


def run(ctx: Context) -> list[Figure]:
    count = 8 if ctx.quick else 64
    images = natural_images(count)
    cores = os.cpu_count() or 1
    gpu, missing = _gpu_decoders(ctx)
    if not cpu.whole_by_nvimgcodec():
        missing.append(f"{LIBJPEG}: nvImageCodec not installed or unavailable")
    quality = Figure(
        "decode_quality",
        "JPEG quality vs file size vs decode time (500×375)",
        "mean file size (KB), quality 50 → 95",
        "decode time per image (ms)",
    )
    speed = Figure(
        "decode_throughput",
        f"JPEG decode throughput (500×375, quality 90, {cores} cores)",
        "decoder",
        "images/s",
        kind="bar",
    )
    speed.note = quality.note = "; ".join(f"not measured: {m}" for m in missing)
    for q in QUALITIES:
        datas = encode_jpegs(images, q)
        batch = Encoded.joined(datas)
        arrays = [np.frombuffer(d, np.uint8) for d in datas]
        kb = float(np.mean([len(d) for d in datas])) / 1e3
        reps = ctx.repeats()
        quality.line("Pillow").add(kb, [s / count * 1e3 for s in measure(lambda: list(map(_pil, datas)), reps, "cpu")])
        if cpu.whole_by_nvimgcodec():
            quality.line(LIBJPEG).add(
                kb, [s / count * 1e3 for s in measure(lambda: list(map(_libjpeg, arrays)), reps, "cpu")]
            )
        for name, dec in gpu.items():
            quality.line(name).add(kb, [s / count * 1e3 for s in measure(lambda: dec(batch), reps, "cuda")])
        if q == 90:
            _throughput(speed, datas, arrays, batch, gpu, cores, reps)
    return [quality, speed]


def _throughput(
    fig: Figure, datas: list[bytes], arrays: list[np.ndarray], batch: Encoded, gpu: dict, cores: int, reps: int
) -> None:
    n = len(datas)
    one, every = fig.line("one core"), fig.line(f"all {cores} cores")
    cpus: list[tuple[str, Callable[[Any], None], list[Any], Callable[[int], Executor]]] = [
        ("Pillow", _pil, datas, process_pool)
    ]
    if cpu.whole_by_nvimgcodec():
        cpus.append((LIBJPEG, _libjpeg, arrays, ThreadPoolExecutor))
    for name, fn, items, pool_cls in cpus:
        one.add(name, [n / s for s in measure(lambda: [fn(d) for d in items], reps, "cpu")])
        with pool_cls(cores) as pool:  # Pillow holds the GIL: processes; nvImageCodec lets go of it: threads
            every.add(name, [n / s for s in measure(lambda: list(pool.map(fn, items)), reps, "cpu")])
    for name, dec in gpu.items():
        every.add(name, [n / s for s in measure(lambda: dec(batch), reps, "cuda")])
        one.add(name, [float("nan")] * reps)
