"""Keypoints through a batch's geometry: the same crops, resizes, flips and warps as its pixels.

Points are (x, y, visibility) in the stored image's pixels, K per instance. They go through what
boxes go through (`augment.boxes`): from the sample's source box to the resampled output, mirrored
with it, then through the inverse of a warp's matrix. Coordinates are continuous, as for boxes and
as torchvision resizes and crops KeyPoints: a mirror maps x to W - x (detectron2's flip), where
torchvision's `horizontal_flip` on KeyPoints maps it to W - 1 - x. A horizontal flip also swaps each
point with its mirror image's (`flip_index`: COCO's left and right eyes, ears, ...), as detectron2
does and torchvision does not. A point that leaves the output becomes not visible (0), its
coordinates kept; no instance is dropped, except those whose box a loader also drops.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpufeed.augment.boxes import moved_by, warp_inverse
from gpufeed.augment.params import Params


def check_flip_index(flip_index: Sequence[int] | None, points: int, where: str) -> np.ndarray | None:
    """`flip_index` as an array, checked to be a permutation of the store's `points` per instance that
    undoes itself (a point's mirror's mirror is the point); ValueError naming `where` otherwise."""
    if flip_index is None:
        return None
    order = np.asarray(flip_index)
    if (
        order.dtype.kind not in "iu"
        or order.shape != (points,)
        or not np.array_equal(np.sort(order), np.arange(points))
        or not np.array_equal(order[order], np.arange(points))
    ):
        raise ValueError(
            f"{where}: keypoint_flip must order the {points} keypoints of an instance (a permutation of "
            f"0..{points - 1}: the point each one becomes when mirrored, which mirrored again is itself), "
            f"got {list(flip_index)}"
        )
    return order


def transform_keypoints(
    points: list[np.ndarray], params: Params, flip_index: np.ndarray | None = None
) -> list[np.ndarray]:
    """Each sample's (k, K, 3) keypoints through `params` (a batch's parameters, on the host), all of
    the batch's at once."""
    counts = np.array([len(p) for p in points], np.int64)
    width = next((p.shape[1] for p in points if p.ndim == 3), 1)
    if not counts.sum():
        return [np.zeros((0, width, 3), np.float32) for _ in points]
    owner = np.repeat(np.arange(len(points)), counts)
    p = np.concatenate([np.asarray(x, np.float64).reshape(-1, width, 3) for x in points if len(x)])
    out_h, out_w = params.out_hw
    src = params.boxes.double().numpy()[owner]  # (I, 4): each instance's sample's source box
    p[..., 0] = (p[..., 0] - src[:, None, 0]) * (out_w / (src[:, 2] - src[:, 0]))[:, None]
    p[..., 1] = (p[..., 1] - src[:, None, 1]) * (out_h / (src[:, 3] - src[:, 1]))[:, None]
    rows = params.flip.numpy().astype(bool)[owner]
    p[rows, :, 0] = out_w - p[rows, :, 0]
    if flip_index is not None:
        p[rows] = p[rows][:, flip_index]
    if params.vflip is not None:
        rows = params.vflip.numpy().astype(bool)[owner]
        p[rows, :, 1] = out_h - p[rows, :, 1]
    # cropped away: the warp below only moves the fill around them. Inclusive of the far edges: a point
    # on x = 0 is mirrored onto x = W
    outside = (p[..., 0] < 0) | (p[..., 0] > out_w) | (p[..., 1] < 0) | (p[..., 1] > out_h)
    final_h, final_w = out_h, out_w
    if params.warp is not None:  # through the inverse of the warp (output pixels -> the box pass's)
        inverse = warp_inverse(params)[owner]
        p[..., :2] = moved_by(inverse, p[..., :2])
        final_h, final_w = params.final_hw
    outside |= (p[..., 0] < 0) | (p[..., 0] > final_w) | (p[..., 1] < 0) | (p[..., 1] > final_h)
    p[..., 2] = np.where(outside, 0, p[..., 2])
    return np.split(p.astype(np.float32), np.cumsum(counts)[:-1])
