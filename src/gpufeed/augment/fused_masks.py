"""Masks resampled from their runs in one GPU kernel (Triton): what `augment.masks` computes with torch
ops (which stays the CPU path and the reference), without expanding the runs.

One program per (sample, block of output pixels). It locates each output pixel's stored pixel once
(`masks.stored_pixels`' arithmetic, in float64 with each operation rounded as torch rounds it, so
the pixels are the CPU's exactly), then writes every one of the sample's planes there, and zeros
in the slots after its count (the output needs no clearing first). A plane's value at a stored
pixel is found by a binary search over its run ends, but only where the pixel lies between the
plane's first and last run: before and after them (most of an instance mask's pixels: the
background around the object) the value is known, and a block none of whose pixels needs the
search skips it. The kernel writes each output byte once and reads little else: its time is about
the time to write the batch's masks.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 1024
STEPS_AT_LEAST = 12  # binary search steps: planes of up to 4095 runs (a Triton variant per count of steps)
# float64 columns per sample: x0, x scale, y0, y scale (the source box), flip, vflip, h, w
GEOMETRY = tl.constexpr(8)
PER_BOUND = tl.constexpr(8)  # float64 columns per sample and bound of a warp: its 2x3 matrix, then the bound's h, w


@triton.jit
def _rint(x):
    """Round half to even as torch.round does, exactly for any float64 x below 2**52 (from the floor:
    x - floor(x) is exact, where x + 0.5 would round)."""
    r = tl.floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _located(geo, n, offs, inside, W, out_h, out_w, COLUMNS: tl.constexpr, BOUNDS: tl.constexpr):
    """The stored pixel (y * w + x, int32) each output pixel `offs` of sample n takes, -1: the fill."""
    row = geo + n * COLUMNS
    xs = (offs % W).to(tl.float64) + 0.5
    ys = (offs // W).to(tl.float64) + 0.5
    bx, by = xs, ys
    for k in tl.static_range(BOUNDS):  # the warp's bounds, each from the output pixel's centre
        m = row + GEOMETRY + k * PER_BOUND
        u = tl.load(m) * xs + tl.load(m + 1) * ys + tl.load(m + 2)
        v = tl.load(m + 3) * xs + tl.load(m + 4) * ys + tl.load(m + 5)
        ru, rv = _rint(u - 0.5), _rint(v - 0.5)
        inside = inside & (ru >= 0) & (ru <= tl.load(m + 7) - 1) & (rv >= 0) & (rv <= tl.load(m + 6) - 1)
        if k == 0:  # the box pass's output: its nearest pixel's centre goes on through the box
            bx, by = ru + 0.5, rv + 0.5
    bx = tl.where(tl.load(row + 4) != 0, out_w - bx, bx)
    by = tl.where(tl.load(row + 5) != 0, out_h - by, by)
    x = tl.floor(tl.load(row) + bx * tl.load(row + 1))
    y = tl.floor(tl.load(row + 2) + by * tl.load(row + 3))
    h, w = tl.load(row + 6), tl.load(row + 7)
    inside = inside & (x >= 0) & (x < w) & (y >= 0) & (y < h)
    return tl.where(inside, y * w + x, -1.0).to(tl.int32)


@triton.jit
def _masks_kernel(
    geo,  # (N, COLUMNS) float64: `GEOMETRY` columns per sample, then `PER_BOUND` per bound of the warp
    where,  # (N, HW) int32: each output pixel's stored pixel when LOCATED is False (-1: the fill)
    planes,  # (N + 1,) int32: sample n's planes are planes[n]..planes[n + 1]
    first,  # (P + 1,) int32: plane p's runs are first[p]..first[p + 1] of ends and values
    edges,  # (P, 4) int32: each plane's first run's end, last run's start, first and last values
    ends,  # (R,) int32: every plane's run ends, plane after plane
    values,  # (R,) int32
    out,  # (N * slots, HW) of the output dtype
    slots,
    hw,
    W,
    out_h,
    out_w,
    fill,
    COLUMNS: tl.constexpr,
    BOUNDS: tl.constexpr,
    LOCATED: tl.constexpr,  # locate the stored pixels here (from `geo`), else read them from `where`
    STEPS: tl.constexpr,  # binary search steps: 2 ** STEPS > the most runs of a plane
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < hw
    if LOCATED:
        pixel = _located(geo, n, offs, inside, W, out_h, out_w, COLUMNS, BOUNDS)
    else:
        pixel = tl.load(where + n.to(tl.int64) * hw + offs, mask=inside, other=-1)
    p0 = tl.load(planes + n)
    count = tl.load(planes + n + 1) - p0
    for j in range(0, slots):
        value = tl.zeros([BLOCK], tl.int32) + fill
        if j < count:
            p = p0 + j
            first_end, last_start = tl.load(edges + p * 4), tl.load(edges + p * 4 + 1)
            value = tl.where(pixel < first_end, tl.load(edges + p * 4 + 2), tl.load(edges + p * 4 + 3))
            need = (pixel >= first_end) & (pixel < last_start)
            if tl.max(need.to(tl.int32), 0) > 0:  # the runs between the first and the last: searched
                lo = tl.zeros([BLOCK], tl.int32) + tl.load(first + p) + 1
                hi = tl.zeros([BLOCK], tl.int32) + tl.load(first + p + 1) - 1
                for _ in tl.static_range(STEPS):  # the first run whose end is past the pixel
                    mid = (lo + hi) // 2
                    go = need & (lo < hi)
                    end = tl.load(ends + mid, mask=go, other=0)
                    right = go & (end <= pixel)
                    lo = tl.where(right, mid + 1, lo)
                    hi = tl.where(go & ~right, mid, hi)
                value = tl.where(need, tl.load(values + lo, mask=need, other=0), value)
            value = tl.where(pixel >= 0, value, fill)
        row = (n * slots + j).to(tl.int64)
        tl.store(out + row * hw + offs, value.to(out.dtype.element_ty), mask=inside)


def resample(
    geo: torch.Tensor | None,
    bounds: int,
    where: torch.Tensor | None,
    planes: torch.Tensor,
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    most_runs: int,
    fill: int,
    out_hw: tuple[int, int],
) -> None:
    """Write every sample's planes (and zeros after its count) into `out` (N, slots, H, W). The stored
    pixels located from `geo` (float64, `GEOMETRY` + `bounds` * `PER_BOUND` columns per sample;
    `out_hw`: the box pass's output size), or read from `where` (N, H * W) int32 when `geo` is None.
    `runs`: first, edges, ends, values as `_masks_kernel` takes them, int32, on the output's device."""
    n, slots, height, width = out.shape
    if not n or not slots or not height * width:
        return
    first, edges, ends, values = runs
    # searched in steps of four more than needed at most: one compiled variant serves most batches
    steps = max(STEPS_AT_LEAST, -(-int(most_runs).bit_length() // 4) * 4)
    located = geo is not None
    grid = (n, triton.cdiv(height * width, BLOCK))
    _masks_kernel[grid](
        geo if located else where,
        where if where is not None else planes,
        planes,
        first,
        edges,
        ends,
        values,
        out.view(n * slots, height * width),
        slots,
        height * width,
        width,
        float(out_hw[0]),
        float(out_hw[1]),
        fill,
        COLUMNS=GEOMETRY.value + bounds * PER_BOUND.value,
        BOUNDS=bounds,
        LOCATED=located,
        STEPS=steps,
        BLOCK=BLOCK,
        enable_fp_fusion=False,  # each multiply and add rounded on its own, as torch's ops round them
    )


def plane_edges(first: np.ndarray, ends: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(P, 4) int32 per plane (its runs first[p]..first[p + 1]): the end of its first run, the start
    of its last, their values; pixels before the one and from the other on need no search."""
    a, b = first[:-1], first[1:]
    last_start = np.where(b - a >= 2, ends[np.maximum(b - 2, 0)], 0)
    return np.stack([ends[a], last_start, values[a], values[b - 1]], 1).astype(np.int32)
