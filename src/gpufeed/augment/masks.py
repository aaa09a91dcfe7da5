"""Masks through a batch's geometry: the same crops, resizes, flips and warps as its pixels, nearest.

A mask is resampled from its stored runs (`store.format.MaskRuns`) on the batch's device (nothing
is decoded on the CPU): each output pixel takes the stored pixel under it, as the image's resampling
places it, its value found in the runs (on a GPU by `fused_masks`' kernels, elsewhere from the runs
expanded by torch ops).

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
from gpufeed.augment.pipeline import fused_kernels
from gpufeed.store.format import MaskRuns
from gpufeed.transfer.upload import upload

# torch dtypes of the store format's mask dtypes (`store.format.MASK_DTYPES`)
DTYPES = {"|u1": torch.uint8, "|i1": torch.int8, "<i2": torch.int16, "<i4": torch.int32}
_EXPANDED = 1 << 28  # bytes of expanded planes at once (a batch's samples go in groups under this)
_PIXELS = 1 << 24  # output pixels located at once (their float64 coordinates on the way: 128 MiB each)
# `_geometry`'s float64 columns a sample, as the mask kernel (`fused_masks`) reads them: x0, x scale,
# y0, y scale (the source box), flip, vflip, h, w; then per bound of a warp its 2x3 matrix and its h, w
GEOMETRY_COLUMNS = 8
BOUND_COLUMNS = 8


def stored_pixels(
    params: Params | None, hw: np.ndarray, device: torch.device, size: tuple[int, int] | None = None
) -> torch.Tensor:
    """(N, H, W) int64: per output pixel of each sample, the index y * w + x of the stored pixel it
    takes (its image being hw[i] = (h, w)), or -1 where it takes the fill. `params`: the samples'
    geometry on the host (None: no augment, the stored images as they are, at the top left of
    `size`, by default the largest of `hw`)."""
    # (the consumer's thread, every batch: what the host holds goes up in one copy that waits for nothing)
    if params is None:
        hw_t = upload(torch.from_numpy(np.ascontiguousarray(hw, np.float64)), device)
        h_i, w_i = hw_t[:, 0].view(-1, 1, 1), hw_t[:, 1].view(-1, 1, 1)
        height, width = size or ((int(hw[:, 0].max()), int(hw[:, 1].max())) if len(hw) else (1, 1))
        y = torch.arange(height, dtype=torch.float64, device=device).view(1, -1, 1).expand(len(hw), -1, width)
        x = torch.arange(width, dtype=torch.float64, device=device).view(1, 1, -1).expand(len(hw), height, -1)
        inside = (x < w_i) & (y < h_i)
        return torch.where(inside, y * w_i + x, -1).long()
    geo = upload(_geometry(params, hw), device)  # (N, columns): `_geometry`'s, as the kernel takes them
    x0, x_scale, y0, y_scale, flip, vflip, h_i, w_i = (c.view(-1, 1, 1) for c in geo[:, :GEOMETRY_COLUMNS].unbind(1))
    height, width = params.final_hw
    out_h, out_w = params.out_hw
    xs = torch.arange(width, dtype=torch.float64, device=device).view(1, 1, -1) + 0.5
    ys = torch.arange(height, dtype=torch.float64, device=device).view(1, -1, 1) + 0.5
    inside = torch.ones((len(hw), height, width), dtype=torch.bool, device=device)
    if params.warp is not None:  # back to the box pass's output, its nearest pixel's centre
        w = params.warp
        at = xs, ys  # every bound from the output pixel's centre, as the image's warp samples them
        for k, (h_k, w_k) in enumerate(w.sizes):
            first = GEOMETRY_COLUMNS + BOUND_COLUMNS * k
            a = [c.view(-1, 1, 1) for c in geo[:, first : first + 6].unbind(1)]  # its (2, 3) matrix, row by row
            u = a[0] * at[0] + a[1] * at[1] + a[2]
            v = a[3] * at[0] + a[4] * at[1] + a[5]
            if k == 0 and w.resampling.padding != "constant":
                u, v = _extend(u, w_k, w.resampling.padding), _extend(v, h_k, w.resampling.padding)
            ru, rv = torch.round(u - 0.5), torch.round(v - 0.5)  # half to even, as grid_sample's nearest
            inside &= (ru >= 0) & (ru <= w_k - 1) & (rv >= 0) & (rv <= h_k - 1)
            if k == 0:
                xs, ys = ru + 0.5, rv + 0.5
    xs = torch.where(flip != 0, out_w - xs, xs)
    if params.vflip is not None:
        ys = torch.where(vflip != 0, out_h - ys, ys)
    x = torch.floor(x0 + xs * x_scale)
    y = torch.floor(y0 + ys * y_scale)
    inside &= (x >= 0) & (x < w_i) & (y >= 0) & (y < h_i)
    return torch.where(inside, y * w_i + x, -1).long()


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
    (N, H, W) and ones. `runs`: each sample's stored planes (a label map: exactly one).

    On a GPU two Triton kernels (`fused_masks`) expand each plane's rows of changes and resample from
    them; elsewhere torch ops expand the runs into each sample's planes (padded to the batch's largest image
    plus one pixel of the fill) and gather. Samples go in groups that bound the memory on the way
    (`_PIXELS` output pixels located at once; `_EXPANDED` bytes of expanded planes)."""
    n = len(runs)
    hw = np.array([[r.h, r.w] for r in runs], np.int64).reshape(n, 2)
    counts = np.array([len(r) for r in runs], np.int64)
    height, width = params.final_hw if params is not None else (_most(hw[:, 0], 1), _most(hw[:, 1], 1))
    slots = _most(counts, 0) if instances else 1
    fill = 0 if instances else fill
    kernels = fused_kernels("fused_masks") if device.type == "cuda" else None
    out = torch.empty((n, slots, height, width), dtype=dtype, device=device)
    counts_t = upload(torch.from_numpy(counts), device)
    if kernels is not None:
        _in_kernel(kernels, runs, counts, params, hw, out, fill)
        return (out if instances else out[:, 0]), counts_t
    size = _most(hw[:, 0] * hw[:, 1], 1) + 1  # each plane padded, its last pixel the fill
    # samples in groups: the output pixels' stored pixels (float64 on the way) and the expanded planes bounded
    for a, b in _groups(n, height * width, _EXPANDED // (max(1, slots) * size * dtype.itemsize)):
        part = params.take(slice(a, b)) if params is not None else None
        where = stored_pixels(part, hw[a:b], device, (height, width)).reshape(b - a, -1)
        lengths, values = _expanded(runs[a:b], slots, size, fill)
        planes = torch.repeat_interleave(
            upload(torch.from_numpy(values), device, dtype),
            upload(torch.from_numpy(lengths), device),
            output_size=(b - a) * slots * size,
        ).view(b - a, slots, size)
        index = torch.where(where < 0, size - 1, where)[:, None, :].expand(-1, slots, -1)
        out[a:b] = torch.gather(planes, 2, index).view(b - a, slots, height, width)
    return (out if instances else out[:, 0]), counts_t


def _most(values: np.ndarray, empty: int) -> int:
    """The largest of `values` as an int, `empty` where there are none."""
    return int(np.max(values)) if values.size else empty


def _groups(n: int, pixels: int, samples: int | None = None) -> list[tuple[int, int]]:
    """Samples a..b in groups of at most `_PIXELS` output pixels (and `samples` samples)."""
    step = max(1, min(_PIXELS // max(1, pixels), samples or n))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _in_kernel(
    kernels, runs: list[MaskRuns], counts: np.ndarray, params: Params | None, hw: np.ndarray, out, fill: int
):
    """Every plane (and the zeros after each sample's count) written by the Triton kernels
    (`fused_masks`): the runs and plane boxes sent in one copy, the geometry in another; the kernel
    locates the stored pixels itself unless a warp pads otherwise than with a constant or no augment
    ran (then `stored_pixels` does, in groups)."""
    device = out.device
    height, width = out.shape[-2:]
    planes = kernels.Planes(runs, counts, hw, pin=device.type == "cuda")
    tables = planes.to(device)
    tables["dense"] = torch.empty(max(1, planes.size), dtype=out.dtype, device=device)
    kernels.expand(tables, tables["dense"], planes.most_runs)
    warp = params.warp if params is not None else None
    if params is not None and (
        warp is None or (warp.resampling.padding == "constant" and len(warp.sizes) <= kernels.MAX_BOUNDS)
    ):
        geo = upload(_geometry(params, hw), device)
        kernels.resample(geo, 0 if warp is None else len(warp.sizes), None, tables, out, fill, params.out_hw)
        return
    for a, b in _groups(len(runs), height * width):
        part = params.take(slice(a, b)) if params is not None else None
        where = stored_pixels(part, hw[a:b], device, (height, width)).reshape(b - a, -1).int()
        some = dict(tables, planes=tables["planes"][a : b + 1], widths=tables["widths"][a:b])
        kernels.resample(None, 0, where, some, out[a:b], fill, (height, width))


def _geometry(params: Params, hw: np.ndarray) -> torch.Tensor:
    """(N, columns) float64 per sample as `fused_masks` takes it and `stored_pixels` too (one copy up
    for either): the source box's origin and scale, flips, the stored size, then each warp bound's
    matrix and size. numpy: a batch's few small arrays, on the loader's thread."""
    out_h, out_w = params.out_hw
    b = params.boxes.cpu().numpy().astype(np.float64)
    n = len(b)
    vflip = params.vflip.cpu().numpy() if params.vflip is not None else np.zeros(n)
    columns = [
        b[:, 0],
        (b[:, 2] - b[:, 0]) / out_w,
        b[:, 1],
        (b[:, 3] - b[:, 1]) / out_h,
        params.flip.cpu().numpy(),
        vflip,
        hw[:, 0],
        hw[:, 1],
    ]
    if params.warp is not None:
        m = params.warp.matrices.cpu().numpy().astype(np.float64).reshape(len(params.warp.sizes), n, 6)
        for k, (h_k, w_k) in enumerate(params.warp.sizes):
            columns += [*m[k].T, np.full(n, h_k), np.full(n, w_k)]
    return torch.from_numpy(np.stack(columns, 1).astype(np.float64))


def _expanded(runs: list[MaskRuns], slots: int, size: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Run lengths and values that expand to (len(runs), slots, size): each plane's runs, then the fill
    to `size`; planes after a sample's count all fill."""
    lengths, values = [], []
    for r in runs:
        if len(r):
            run_lengths = r.lengths()
            # each plane: its runs, then one run of the fill to `size`
            at = np.insert(np.arange(len(r.ends)), np.cumsum(r.counts), -1)
            ln = np.where(at >= 0, run_lengths[np.maximum(at, 0)], size - r.h * r.w)
            vl = np.where(at >= 0, r.values[np.maximum(at, 0)], fill)
            lengths.append(ln)
            values.append(vl)
        if slots > len(r):
            lengths.append(np.full(slots - len(r), size, np.int64))
            values.append(np.full(slots - len(r), fill, np.int64))
    return np.concatenate(lengths).astype(np.int64), np.concatenate(values).astype(np.int64)
