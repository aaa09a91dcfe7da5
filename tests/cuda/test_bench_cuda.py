"""`gpufeed bench decoders --quick` on a real GPU: the GPU decoders are measured, not skipped."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpufeed.bench import run_bench
from gpufeed.decode.codecs import nvjpeg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engines() -> bool:
    """nvImageCodec installed and this GPU's JPEG engines usable through it."""
    try:
        from gpufeed.decode.codecs.nvimgcodec import NvImgCodecDecoder

        NvImgCodecDecoder(torch.device("cuda", torch.cuda.current_device()), "hw")
        return True
    except Exception:
        return False


def test_gpu_decoders_are_measured(tmp_path):
    run_bench(["decoders"], tmp_path, quick=True, device="cuda")
    figures = json.loads((tmp_path / "results.json").read_text())["experiments"]["decoders"]["figures"]
    speed = next(f for f in figures if f["name"] == "decode_throughput")
    every = next(s for name, s in speed["series"].items() if name.startswith("all "))
    rates = dict(zip(every["x"], every["median"]))
    wanted = ["nvJPEG batched (torchvision)"] if nvjpeg.problem() is None else []
    if _engines():
        wanted.append("hardware engines (nvImageCodec)")
    for name in wanted:
        assert rates[name] > 0 and math.isfinite(rates[name]), (name, rates)
