"""How far the engines' YCbCr 4:2:0 planes, converted in the resize kernel, land from the same photos
decoded by the engines to RGB: per photo, the mean and largest difference in levels of 255 after
resizing whole images to 64x64. Needs a GPU with JPEG engines and nvImageCodec.

    PYTHONPATH=src python benchmarks/ycc_probe.py
"""

from __future__ import annotations

import numpy as np
import torch

from gpufeed.augment import fused
from gpufeed.decode.base import Encoded
from gpufeed.decode.nvimgcodec import NvImgCodecDecoder
from gpufeed.synth import encode_jpegs, photos

SIZES = [(375, 500), (101, 77), (64, 64), (333, 211), (100, 80), (101, 81)]


def resized(dec: NvImgCodecDecoder, batch: Encoded, planar: bool) -> torch.Tensor:
    dec.planar = planar
    part = dec.decode(batch)
    n = len(SIZES)
    on = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    boxes = torch.tensor([[0, 0, w, h] for h, w in SIZES], dtype=torch.float32, device="cuda").view(-1)
    out = torch.empty((n, 3, 64, 64), device="cuda")
    fused.resample_packed(part.base, on(part.offsets), on(part.sizes), on(part.strides), torch.arange(n, device="cuda"),
                          boxes, torch.zeros(n, device="cuda"), out, torch.ones(3, device="cuda"),
                          torch.zeros(3, device="cuda"))
    return out


def main() -> None:
    batch = Encoded.joined(encode_jpegs(photos(SIZES)))
    dec = NvImgCodecDecoder(torch.device("cuda"), "hw")
    levels = (resized(dec, batch, False) - resized(dec, batch, True)).abs()
    for k, (h, w) in enumerate(SIZES):
        print(f"{h}x{w}: mean {levels[k].mean().item():.2f}, largest {levels[k].max().item():.2f} levels")


if __name__ == "__main__":
    main()
