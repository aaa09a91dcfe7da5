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

from gpufeed.augment.params import Params
from gpufeed.transfer.upload import upload


def moved_by(m: np.ndarray, points: np.ndarray) -> np.ndarray:
    """(K, P, 2) points each through its row's affine `m` (K, 3, 3): written out (np.einsum took five
    times as long for a batch's keypoints, and matmul rounds otherwise)."""
    x, y = points[..., 0], points[..., 1]
    return np.stack(
        [
            m[:, None, 0, 0] * x + m[:, None, 0, 1] * y + m[:, None, 0, 2],
            m[:, None, 1, 0] * x + m[:, None, 1, 1] * y + m[:, None, 1, 2],
        ],
        -1,
    )


def warp_inverse(params: Params) -> np.ndarray:
    """(N, 3, 3) per sample: the box pass's output pixels to the warp's output (the inverse of its
    matrices, which map output pixels to the box pass's output); `params.warp` is set."""
    m = params.warp.matrices[0].double().numpy()  # type: ignore[union-attr]  # (N, 2, 3)
    return np.linalg.inv(np.concatenate([m, np.broadcast_to([[[0.0, 0.0, 1.0]]], (len(m), 1, 3))], 1))


def transform_boxes(boxes: list[np.ndarray], params: Params, min_size: float = 1.0) -> list[np.ndarray]:
    """Each sample's (k, 4) float boxes through `params` (a batch's parameters, on the host), all of
    the batch's boxes at once."""
    return transform_boxes_kept(boxes, params, min_size)[0]


def transform_boxes_kept(
    boxes: list[np.ndarray], params: Params, min_size: float = 1.0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`transform_boxes`, and per sample which of its boxes were kept (a bool mask each): what a
    sample's other per-instance values (its keypoints) keep too."""
    counts = np.array([len(b) for b in boxes], np.int64)
    owner = np.repeat(np.arange(len(boxes)), counts)
    b = np.concatenate([np.asarray(x, np.float64).reshape(-1, 4) for x in boxes]) if counts.sum() else np.zeros((0, 4))
    out_h, out_w = params.out_hw
    src = params.boxes.double().numpy()[owner]
    scale = np.stack([out_w / (src[:, 2] - src[:, 0]), out_h / (src[:, 3] - src[:, 1])], 1)[:, [0, 1, 0, 1]]
    b = (b - src[:, [0, 1, 0, 1]]) * scale
    flips = [(params.flip, out_w, [2, 1, 0, 3], [True, False, True, False])]
    if params.vflip is not None:
        flips.append((params.vflip, out_h, [0, 3, 2, 1], [False, True, False, True]))
    for flag, size, order, mirrored in flips:
        rows = flag.numpy().astype(bool)[owner]
        b[rows] = np.where(mirrored, size - b[rows][:, order], b[rows][:, order])
    b = np.clip(b, 0, [out_w, out_h, out_w, out_h])
    if params.warp is not None:  # the corners through the inverse of the warp, then their enclosing box
        inverse = warp_inverse(params)[owner]
        corners = b[:, [[0, 1], [2, 1], [0, 3], [2, 3]]]  # (K, 4 corners, 2)
        moved = moved_by(inverse, corners)
        final_h, final_w = params.final_hw
        b = np.clip(np.concatenate([moved.min(1), moved.max(1)], 1), 0, [final_w, final_h, final_w, final_h])
    keep = (b[:, 2] - b[:, 0] >= min_size) & (b[:, 3] - b[:, 1] >= min_size)
    kept = np.bincount(owner[keep], minlength=len(boxes))
    return np.split(b[keep].astype(np.float32), np.cumsum(kept)[:-1]), np.split(keep, np.cumsum(counts)[:-1])


def padded(
    values: list[np.ndarray], device: torch.device, rest: tuple[int, ...] = (4,), fill: float = 0, dtype=np.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's (k, *rest) values in one (N, M, *rest) tensor, `fill` after each sample's count
    (boxes: float32 zeros), and the counts (N,) int64, on `device`."""
    counts = np.array([len(v) for v in values], dtype=np.int64)
    out = np.full((len(values), (int(np.max(counts)) if counts.size else 0), *rest), fill, dtype=dtype)
    rows = np.repeat(np.arange(len(values)), counts)
    slots = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    if len(rows):
        out[rows, slots] = np.concatenate([np.asarray(v).reshape(-1, *rest) for v in values])
    return upload(torch.from_numpy(out), device), upload(torch.from_numpy(counts), device)
