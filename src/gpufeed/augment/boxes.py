"""Bounding boxes through a batch's geometry: the same crops, resizes, flips and warps as its pixels.

Boxes are xyxy in the stored image's pixels. The box pass maps them from the sample's source box to
the resampled output and mirrors them with it; a warp maps their four corners through the inverse
of its matrix and keeps the enclosing box, as torchvision does for BoundingBoxes. Boxes are clipped
to the output and those narrower or lower than `min_size` pixels are dropped (torchvision's
SanitizeBoundingBoxes); a batch comes back as a zero-padded (N, M, 4) tensor and the counts.
"""

from __future__ import annotations

import numpy as np
import torch

from gpufeed.augment.pipeline import Params


def transform_boxes(boxes: list[np.ndarray], params: Params, min_size: float = 1.0) -> list[np.ndarray]:
    """Each sample's (k, 4) float boxes through `params` (a batch's parameters, on the host)."""
    out_h, out_w = params.out_hw
    src = params.boxes.double().numpy()
    flip = params.flip.numpy().astype(bool)
    vflip = params.vflip.numpy().astype(bool) if params.vflip is not None else np.zeros(len(boxes), bool)
    inverse = None
    if params.warp is not None:
        m = params.warp.matrices[0].double().numpy()  # (N, 2, 3): output pixels -> box pass output
        full = np.concatenate([m, np.broadcast_to([[[0.0, 0.0, 1.0]]], (len(m), 1, 3))], 1)
        inverse = np.linalg.inv(full)
    final_h, final_w = params.final_hw
    result = []
    for k, b in enumerate(boxes):
        b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
        x1, y1, x2, y2 = src[k]
        sx, sy = out_w / (x2 - x1), out_h / (y2 - y1)
        b = (b - [x1, y1, x1, y1]) * [sx, sy, sx, sy]
        if flip[k]:
            b = np.stack([out_w - b[:, 2], b[:, 1], out_w - b[:, 0], b[:, 3]], 1)
        if vflip[k]:
            b = np.stack([b[:, 0], out_h - b[:, 3], b[:, 2], out_h - b[:, 1]], 1)
        b = np.clip(b, 0, [out_w, out_h, out_w, out_h])
        if inverse is not None:
            corners = np.stack([b[:, [0, 1]], b[:, [2, 1]], b[:, [0, 3]], b[:, [2, 3]]], 1)  # (k, 4, 2)
            moved = corners @ inverse[k, :2, :2].T + inverse[k, :2, 2]
            b = np.concatenate([moved.min(1), moved.max(1)], 1)
            b = np.clip(b, 0, [final_w, final_h, final_w, final_h])
        keep = (b[:, 2] - b[:, 0] >= min_size) & (b[:, 3] - b[:, 1] >= min_size)
        result.append(b[keep].astype(np.float32))
    return result


def padded(boxes: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, M, 4) float32 boxes, zero after each sample's count, and the counts (N,) int64, on `device`."""
    counts = np.array([len(b) for b in boxes], dtype=np.int64)
    out = np.zeros((len(boxes), int(counts.max(initial=0)), 4), dtype=np.float32)
    for k, b in enumerate(boxes):
        out[k, : len(b)] = b
    return torch.from_numpy(out).to(device), torch.from_numpy(counts).to(device)
