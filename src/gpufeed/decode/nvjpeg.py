"""Batched GPU JPEG decoding with nvJPEG, through `torchvision.io.decode_jpeg(list, device=...)`."""

from __future__ import annotations

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.decode.base import Decoded, Encoded, in_place


class NvJpegDecoder:
    """Decodes a list of JPEGs on the GPU in one batched call; images it rejects are reported."""

    name = "nvjpeg"

    def __init__(self, device: torch.device):
        self.device = device

    def decode(self, batch: Encoded, shapes: np.ndarray | None = None) -> Decoded:
        """Decode to CHW images on the device, addressed in place (`shapes`: the sizes the store
        records, see `in_place`)."""
        datas, failed = batch.tensors(), {}
        try:
            images = decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:  # one bad image fails the batch call: find it, keep the rest
            images = []
            for k, d in enumerate(datas):
                try:
                    images.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError as e:
                    failed[k] = f"nvJPEG: {e}".splitlines()[0]
        return in_place(images, failed, shapes)
