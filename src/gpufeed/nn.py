"""Modules to put in front of a model: normalise on the GPU, inside the graph."""

from __future__ import annotations

import torch
from torch import nn


class Normalize(nn.Module):
    """uint8 images in, normalised float out: `(x / 255 - mean) / std` per channel.

    Send uint8 over the bus and let the model do the float work (ONNX-exportable).
    `channels` is the dimension holding RGB: 1 for NCHW, -1 for NHWC.
    """

    def __init__(
        self,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        dtype: torch.dtype = torch.float32,
        channels: int = 1,
    ):
        super().__init__()
        self.scale: torch.Tensor
        self.shift: torch.Tensor
        shape = [1, 1, 1, 1]
        shape[channels] = 3
        std_t = torch.tensor(std, dtype=torch.float32).view(shape)
        mean_t = torch.tensor(mean, dtype=torch.float32).view(shape)
        self.register_buffer("scale", 1 / (255 * std_t))
        self.register_buffer("shift", -mean_t / std_t)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) * self.scale + self.shift).to(self.dtype)
