"""Masks through a batch's geometry: the same crops, resizes, flips and warps as its pixels, nearest.

A mask is resampled straight from its stored runs (`store.format.MaskRuns`) on the batch's device:
each output pixel finds the stored pixel under it, as the image's resampling places it, and a binary
search over the runs gives that pixel's value. Nothing is decoded at the stored size, on the CPU or
the GPU.

Where the stored pixel is: the output pixel's centre goes back through the inverse of a warp to the
box pass's output, where it takes the nearest pixel (rounding half to even, as `grid_sample` does
for the image), then from that pixel's centre through the flips and the source box to the stored
image, whose pixel under it is taken (torchvision's NEAREST_EXACT: floor((x + 0.5) * scale), so
a mask stays on its image; torchvision's v2 transforms resize a Mask with NEAREST, floor(x * scale),
half a pixel off the image they resample with the same call, so they differ there on purpose). A
pixel that the image takes from outside the stored image or from a warp's fill gets the mask's
fill: `fill` for a label map (an ignore index, say 255), 0 for instance masks.
"""

from __future__ import annotations

import numpy as np
import torch

from gpufeed.augment.affine import _extend
from gpufeed.augment.params import Params
from gpufeed.store.format import MaskRuns

# torch dtypes of the store format's mask dtypes (`store.format.MASK_DTYPES`)
DTYPES = {"|u1": torch.uint8, "|i1": torch.int8, "<i2": torch.int16, "<i4": torch.int32}
_CHUNK = 1 << 24  # output pixels searched at once (bounds the int64 keys' memory to 128 MiB)


def stored_pixels(params: Params | None, hw: np.ndarray, device: torch.device) -> torch.Tensor:
    """(N, H, W) int64: per output pixel of each sample, the index y * w + x of the stored pixel it
    takes (its image being hw[i] = (h, w)), or -1 where it takes the fill. `params`: the batch's
    geometry on the host (None: no augment, the stored images as they are, all hw alike)."""
    h_i = torch.as_tensor(hw[:, 0], dtype=torch.float64, device=device).view(-1, 1, 1)
    w_i = torch.as_tensor(hw[:, 1], dtype=torch.float64, device=device).view(-1, 1, 1)
    if params is None:
        height, width = (int(x) for x in hw.max(0)) if len(hw) else (1, 1)
        y = torch.arange(height, dtype=torch.float64, device=device).view(1, -1, 1).expand(len(hw), -1, width)
        x = torch.arange(width, dtype=torch.float64, device=device).view(1, 1, -1).expand(len(hw), height, -1)
        inside = (x < w_i) & (y < h_i)
        return torch.where(inside, y * w_i + x, -1).long()
    height, width = params.final_hw
    out_h, out_w = params.out_hw
    xs = torch.arange(width, dtype=torch.float64, device=device).view(1, 1, -1) + 0.5
    ys = torch.arange(height, dtype=torch.float64, device=device).view(1, -1, 1) + 0.5
    inside = torch.ones((len(hw), height, width), dtype=torch.bool, device=device)
    if params.warp is not None:  # back to the box pass's output, its nearest pixel's centre
        w = params.warp
        m = w.matrices.to(device, torch.float64)
        for k, (h_k, w_k) in enumerate(w.sizes):
            a = m[k].view(-1, 6, 1, 1).unbind(1)  # (N, 2, 3) -> six (N, 1, 1) columns
            u = a[0] * xs + a[1] * ys + a[2]
            v = a[3] * xs + a[4] * ys + a[5]
            if k == 0 and w.resampling.padding != "constant":
                u, v = _extend(u, w_k, w.resampling.padding), _extend(v, h_k, w.resampling.padding)
            ru, rv = torch.round(u - 0.5), torch.round(v - 0.5)  # half to even, as grid_sample's nearest
            inside &= (ru >= 0) & (ru <= w_k - 1) & (rv >= 0) & (rv <= h_k - 1)
            if k == 0:
                xs, ys = ru + 0.5, rv + 0.5
    flip = params.flip.to(device).view(-1, 1, 1).bool()
    xs = torch.where(flip, out_w - xs, xs)
    if params.vflip is not None:
        ys = torch.where(params.vflip.to(device).view(-1, 1, 1).bool(), out_h - ys, ys)
    b = params.boxes.to(device, torch.float64)
    x = torch.floor(b[:, 0, None, None] + xs * ((b[:, 2] - b[:, 0]) / out_w)[:, None, None])
    y = torch.floor(b[:, 1, None, None] + ys * ((b[:, 3] - b[:, 1]) / out_h)[:, None, None])
    inside &= (x >= 0) & (x < w_i) & (y >= 0) & (y < h_i)
    return torch.where(inside, y * w_i + x, -1).long().expand(len(hw), height, width)


def transform_masks(
    runs: list[MaskRuns],
    params: Params | None,
    device: torch.device,
    instances: bool,
    dtype: torch.dtype,
    fill: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's masks through the batch's geometry, on `device`: instance masks as one (N, M,
    H, W) tensor (zeros after each sample's count) and the counts (N,); a label map per sample as
    (N, H, W) and ones. `runs`: each sample's stored planes (a label map: exactly one)."""
    n = len(runs)
    hw = np.array([[r.h, r.w] for r in runs], np.int64).reshape(n, 2)
    where = stored_pixels(params, hw, device).reshape(n, -1)
    height, width = (
        params.final_hw if params is not None else (int(hw[:, 0].max(initial=1)), int(hw[:, 1].max(initial=1)))
    )
    counts = np.array([len(r) for r in runs], np.int64)
    planes = int(counts.sum())
    out = torch.empty((planes, height * width), dtype=dtype, device=device)
    if planes:
        per_plane = np.concatenate([r.counts for r in runs if len(r)])
        plane_of_run = np.repeat(np.arange(planes, dtype=np.int64), per_plane)
        # one sorted sequence for every plane: a run's end, offset by its plane's index << 32
        ends = np.concatenate([r.ends for r in runs if len(r)]).astype(np.int64) + (plane_of_run << 32)
        ends_t = torch.from_numpy(ends).to(device)
        values_t = torch.from_numpy(np.concatenate([r.values for r in runs if len(r)])).to(device)
        owner = torch.from_numpy(np.repeat(np.arange(n), counts)).to(device)
        step = max(1, _CHUNK // max(1, height * width))
        for a in range(0, planes, step):
            b = min(planes, a + step)
            pixel = where[owner[a:b]]  # (planes, H * W)
            key = pixel + (torch.arange(a, b, device=device, dtype=torch.int64) << 32)[:, None]
            run = torch.searchsorted(ends_t, key, right=True).clamp_(max=len(ends) - 1)
            value = values_t[run]
            out[a:b] = torch.where(pixel >= 0, value, fill if not instances else 0).to(dtype)
    counts_t = torch.from_numpy(counts).to(device)
    if not instances:
        return out.view(n, height, width), counts_t
    batch = torch.zeros((n, int(counts.max(initial=0)), height, width), dtype=dtype, device=device)
    rows = np.repeat(np.arange(n), counts)
    slots = np.arange(planes) - np.repeat(np.cumsum(counts) - counts, counts)
    if planes:
        batch[torch.from_numpy(rows).to(device), torch.from_numpy(slots).to(device)] = out.view(planes, height, width)
    return batch, counts_t
