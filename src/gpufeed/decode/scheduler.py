"""Split each batch between the decoders in proportion to their measured rates, run them at once.

The CPU threads start first (asynchronously), the GPU decodes its share meanwhile, and each
decoder's rate (images/s, an exponential average) sets the next batch's split, so both finish
together. Images nvJPEG rejects (CMYK, some progressive files) are decoded on the CPU instead.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import torch

from gpufeed.decode.base import Decoded
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.decode.nvjpeg import NvJpegDecoder


class Scheduler:
    """Decoders for one loader: nvJPEG (if on a GPU) and a CPU thread pool."""

    def __init__(self, device: torch.device, cpu_threads: int, use_gpu: bool):
        self.device = device
        self.cpu = CpuDecoder(cpu_threads)
        self.gpu = NvJpegDecoder(device) if use_gpu else None
        self.rates = {"nvjpeg": 10_000.0, "cpu": 300.0 * self.cpu.threads}
        self.counts: Counter = Counter()

    @property
    def names(self) -> list[str]:
        return ([self.gpu.name] if self.gpu else []) + [self.cpu.name]

    def gpu_share(self, n: int) -> int:
        if self.gpu is None:
            return 0
        g, c = self.rates["nvjpeg"], self.rates["cpu"]
        return min(n, round(n * g / (g + c)))

    def run(self, datas: list[torch.Tensor], shapes: torch.Tensor, boxes: torch.Tensor, out_hw: tuple[int, int],
            pin: bool) -> tuple[list[tuple[Decoded, list[int]]], dict[int, str]]:
        """Decode a batch: ([(part, batch positions of its images)], {position: reason it failed})."""
        n = len(datas)
        k = self.gpu_share(n)
        cpu_pos = list(range(k, n))
        t0 = time.perf_counter()
        futures = self.cpu.submit([datas[p] for p in cpu_pos], [_reduce_to(shapes[p], boxes[p], out_hw)
                                                                 for p in cpu_pos])
        parts, failed = [], {}
        if k:
            t_gpu = time.perf_counter()
            part = self.gpu.decode(datas[:k])
            torch.cuda.current_stream(self.device).synchronize()
            self._rate("nvjpeg", k - len(part.failed), time.perf_counter() - t_gpu)
            parts.append((part, part.kept(k)))
            if part.failed:  # rejected by nvJPEG: the CPU decodes them instead
                retry = sorted(part.failed)
                self.counts["cpu_fallback"] += len(retry)
                extra = self.cpu.collect(self.cpu.submit([datas[p] for p in retry], [None] * len(retry)),
                                         self.device, pin)
                parts.append((extra, [retry[i] for i in extra.kept(len(retry))]))
                failed.update({retry[i]: f"{part.failed[retry[i]]}; CPU: {why}" for i, why in extra.failed.items()})
        cpu_part = self.cpu.collect(futures, self.device, pin)
        self._rate("cpu", len(cpu_pos), self.cpu.last_done - t0)
        parts.append((cpu_part, [cpu_pos[i] for i in cpu_part.kept(len(cpu_pos))]))
        failed.update({cpu_pos[i]: why for i, why in cpu_part.failed.items()})
        self.counts["nvjpeg"] += k - len(parts[0][0].failed) if k else 0
        self.counts["cpu"] += len(cpu_pos) - len(cpu_part.failed)
        self.counts["failed"] += len(failed)
        return parts, failed

    def _rate(self, name: str, images: int, seconds: float) -> None:
        if images and seconds > 0:
            self.rates[name] = 0.7 * self.rates[name] + 0.3 * images / seconds

    def close(self) -> None:
        self.cpu.close()


def _reduce_to(shape: torch.Tensor, box: torch.Tensor, out_hw: tuple[int, int]) -> tuple[int, int] | None:
    """Size to ask libjpeg for when the crop is >= 2x the output both ways (DCT downscaling), else None."""
    h, w = int(shape[0]), int(shape[1])
    factor = min(float(box[2] - box[0]) / out_hw[1], float(box[3] - box[1]) / out_hw[0])
    if factor < 2:
        return None
    return math.ceil(w / factor), math.ceil(h / factor)
