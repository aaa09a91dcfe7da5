"""Decoder rates alone and together (threads vs processes) on 500x375 JPEGs: where is the contention?

    PYTHONPATH=src python benchmarks/decode_probe.py
"""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.synth import encode_jpegs, natural_images


def pil(data: bytes) -> int:
    img = Image.open(io.BytesIO(data))
    return np.asarray(img).shape[0]


def tv_cpu(data: torch.Tensor) -> int:
    return decode_jpeg(data, mode=ImageReadMode.RGB).shape[1]


def rate(fn, items, pool) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, items))
    return len(items) / (time.perf_counter() - t0)


def main() -> None:
    datas = encode_jpegs(natural_images(64), 90)
    items = datas * 32  # 2048
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in items]
    out = {}
    for t in (1, 8, 16):
        with ThreadPoolExecutor(t) as pool:
            out[f"PIL threads x{t}"] = rate(pil, items, pool)
            out[f"torchvision CPU threads x{t}"] = rate(tv_cpu, tensors, pool)
    with ProcessPoolExecutor(16) as pool:
        rate(pil, items[:256], pool)
        out["PIL processes x16"] = rate(pil, items, pool)

    def nvjpeg(n_batches: int) -> float:
        t0 = time.perf_counter()
        for b in range(n_batches):
            decode_jpeg(tensors[(b * 256) % 2048:(b * 256) % 2048 + 256], device="cuda")
        torch.cuda.synchronize()
        return n_batches * 256 / (time.perf_counter() - t0)

    nvjpeg(2)
    out["nvJPEG batched alone"] = nvjpeg(16)
    for label, pool in (("threads", ThreadPoolExecutor(16)), ("processes", ProcessPoolExecutor(16))):
        rate(pil, items[:256], pool)
        result = {}
        bg = threading.Thread(target=lambda: result.update(cpu=rate(pil, items * 2, pool)))
        bg.start()
        result["gpu"] = nvjpeg(16)
        bg.join()
        out[f"together with PIL {label} x16: nvJPEG"] = result["gpu"]
        out[f"together with PIL {label} x16: PIL"] = result["cpu"]
        pool.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
