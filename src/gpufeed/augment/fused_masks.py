"""Masks resampled from their runs on the GPU (Triton): what `augment.masks` computes with torch ops
(which stays the CPU path and the reference), without expanding whole planes.

Two kernels. The first expands each plane only inside its box of changes (`_boxes`: the rows from
its second run to its last run of another value than its first's; elsewhere the plane has its
first run's value, as an instance mask's background above and below the object): one program per
block of those pixels, each pixel's value found by a binary search over the plane's run ends. The
second writes the batch: one program per (sample, block of output pixels) locates each output
pixel's stored pixel once (`masks.stored_pixels`' arithmetic, in float64 with each operation
rounded as torch rounds it, so the pixels are the CPU's exactly), then for each of the sample's
planes reads the expanded box there, or takes the first run's value outside it, and writes zeros
in the slots after the sample's count (the output needs no clearing first). Each output byte is
written once; the rest is small next to that.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from gpufeed.augment.masks import BOUND_COLUMNS, GEOMETRY_COLUMNS
from gpufeed.transfer.ring import pinned_empty
from gpufeed.transfer.upload import upload

BLOCK = 1024
STEPS_AT_LEAST = 8  # binary search steps: planes of up to 255 runs (a Triton variant per count of steps)
GEOMETRY = tl.constexpr(GEOMETRY_COLUMNS)  # float64 columns per sample, then `PER_BOUND` per warp bound (`masks`)
PER_BOUND = tl.constexpr(BOUND_COLUMNS)
BOX = tl.constexpr(8)  # int32 columns per plane: x0, x1, y0, y1 (its box of changes), w, offset, first value, 0
MAX_BOUNDS = 4  # warp bounds the kernel locates through (a compiled variant per count); more: `stored_pixels`


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
    """The stored pixel (x, y, int32) each output pixel `offs` of sample n takes, and whether it takes
    one (else the fill)."""
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
    return x.to(tl.int32), y.to(tl.int32), inside


@triton.jit
def _expand_kernel(
    boxes,  # (P, BOX) int32
    first,  # (P + 1,) int32: plane p's runs are first[p]..first[p + 1] of ends and values
    ends,  # (R,) int32: every plane's run ends, plane after plane
    values,  # (R,) int32
    block_plane,  # (B,) int32: the plane of each program
    block_start,  # (B,) int32: where in its plane's box the program starts
    dense,  # every plane's box, row by row, back to back, of the output dtype
    STEPS: tl.constexpr,  # binary search steps: 2 ** STEPS > the most runs of a plane
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    p = tl.load(block_plane + b)
    box = boxes + p * BOX
    x0, x1, y0, y1 = tl.load(box), tl.load(box + 1), tl.load(box + 2), tl.load(box + 3)
    w, offset = tl.load(box + 4), tl.load(box + 5)
    local = tl.load(block_start + b) + tl.arange(0, BLOCK)
    width = x1 - x0
    valid = local < width * (y1 - y0)
    pixel = (y0 + local // width) * w + x0 + local % width
    lo = tl.zeros([BLOCK], tl.int32) + tl.load(first + p)
    hi = tl.zeros([BLOCK], tl.int32) + tl.load(first + p + 1)
    for _ in tl.static_range(STEPS):  # the first run whose end is past the pixel
        mid = (lo + hi) // 2
        go = valid & (lo < hi)
        end = tl.load(ends + mid, mask=go, other=0)
        right = go & (end <= pixel)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(go & ~right, mid, hi)
    value = tl.load(values + lo, mask=valid, other=0)
    tl.store(dense + offset.to(tl.int64) + local, value.to(dense.dtype.element_ty), mask=valid)


@triton.jit
def _masks_kernel(
    geo,  # (N, COLUMNS) float64: `GEOMETRY` columns per sample, then `PER_BOUND` per bound of the warp
    where,  # (N, HW) int32: each output pixel's stored pixel when LOCATED is False (-1: the fill)
    widths,  # (N,) int32: each sample's stored width (for `where`)
    planes,  # (N + 1,) int32: sample n's planes are planes[n]..planes[n + 1]
    boxes,  # (P, BOX) int32
    dense,  # the planes' expanded boxes (`_expand_kernel`)
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
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < hw
    if LOCATED:
        x, y, taken = _located(geo, n, offs, inside, W, out_h, out_w, COLUMNS, BOUNDS)
    else:
        pixel = tl.load(where + n.to(tl.int64) * hw + offs, mask=inside, other=-1)
        w = tl.load(widths + n)
        taken = pixel >= 0
        y = tl.where(taken, pixel // w, 0)
        x = tl.where(taken, pixel - y * w, 0)
    p0 = tl.load(planes + n)
    count = tl.load(planes + n + 1) - p0
    for j in range(0, slots):
        value = tl.zeros([BLOCK], tl.int32) + fill
        if j < count:
            box = boxes + (p0 + j) * BOX
            x0, x1, y0, y1 = tl.load(box), tl.load(box + 1), tl.load(box + 2), tl.load(box + 3)
            offset = tl.load(box + 5).to(tl.int64)
            inbox = taken & (x >= x0) & (x < x1) & (y >= y0) & (y < y1)
            changed = tl.load(dense + offset + (y - y0) * (x1 - x0) + (x - x0), mask=inbox, other=0).to(tl.int32)
            value = tl.where(inbox, changed, tl.load(box + 6))
            value = tl.where(taken, value, fill)
        row = (n * slots + j).to(tl.int64)
        tl.store(out + row * hw + offs, value.to(out.dtype.element_ty), mask=inside)


def resample(
    geo: torch.Tensor | None,
    bounds: int,
    where: torch.Tensor | None,
    tables: dict[str, torch.Tensor],
    out: torch.Tensor,
    fill: int,
    out_hw: tuple[int, int],
) -> None:
    """Write every sample's planes (and zeros after its count) into `out` (N, slots, H, W). The stored
    pixels located from `geo` (float64, `GEOMETRY` + `bounds` * `PER_BOUND` columns per sample;
    `out_hw`: the box pass's output size), or read from `where` (N, H * W) int32 when `geo` is None.
    `tables`: `Planes.tables`' int32 tensors on the output's device, and "dense", the expanded boxes."""
    n, slots, height, width = out.shape
    if not n or not slots or not height * width:
        return
    located = geo is not None
    grid = (n, triton.cdiv(height * width, BLOCK))
    _masks_kernel[grid](
        geo if located else where,
        where if where is not None else tables["planes"],
        tables["widths"],
        tables["planes"],
        tables["boxes"],
        tables["dense"],
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
        BLOCK=BLOCK,
        enable_fp_fusion=False,  # each multiply and add rounded on its own, as torch's ops round them
    )


def expand(tables: dict[str, torch.Tensor], dense: torch.Tensor, most_runs: int) -> None:
    """Expand every plane's box of changes into `dense` (`Planes.size` elements)."""
    programs = len(tables["block_plane"])
    if not programs:
        return
    # searched in steps of two more than needed at most: one compiled variant serves most batches
    steps = max(STEPS_AT_LEAST, -(-int(most_runs).bit_length() // 2) * 2)
    _expand_kernel[(programs,)](
        tables["boxes"],
        tables["first"],
        tables["ends"],
        tables["values"],
        tables["block_plane"],
        tables["block_start"],
        dense,
        STEPS=steps,
        BLOCK=BLOCK,
    )


class Planes:
    """A batch's planes as the kernels take them, made on the host from the samples' runs straight into
    one page-locked buffer (on a GPU machine), sent in one copy: the runs' ends and values, and the
    small tables (`NAMES`). A few numpy calls per batch, none per run beyond the copy: this runs on the
    loader's thread. `size`: the elements of the expanded boxes."""

    NAMES = ("ends", "values", "planes", "widths", "first", "boxes", "block_plane", "block_start")

    def __init__(self, runs: list, counts: np.ndarray, hw: np.ndarray, pin: bool):
        """`counts`: each sample's planes; `hw`: (N, 2) int64, each sample's stored (h, w)."""
        some = [r for r in runs if len(r)]
        per_plane = np.concatenate([r.counts for r in some]) if some else np.zeros(0, np.int64)
        total = int(per_plane.sum())
        widths = hw[:, 1]
        # the most blocks the expansion can take: every plane's whole image
        most_blocks = int((np.repeat(-(-hw[:, 0] * hw[:, 1] // BLOCK), counts)).sum())
        planes = len(per_plane)
        room = 2 * total + 2 * len(runs) + 1 + planes + 1 + planes * BOX.value + 2 * most_blocks
        self.buffer = pinned_empty((room,), torch.int32, pin)
        host = self.buffer.numpy()
        ends, values = host[:total], host[total : 2 * total]
        if some:
            np.concatenate([r.ends for r in some], out=ends)
            np.concatenate([r.values for r in some], out=values)
        first = np.concatenate([[0], np.cumsum(per_plane)])
        boxes = _boxes(first, ends, values, np.repeat(widths, counts))
        area = (boxes[:, 1] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 2])
        boxes[:, 5] = np.cumsum(area) - area
        self.size = int(area.sum())
        blocks = -(-area // BLOCK)
        block_plane = np.repeat(np.arange(planes), blocks)
        block_start = (np.arange(len(block_plane)) - np.repeat(np.cumsum(blocks) - blocks, blocks)) * BLOCK
        self.most_runs = int(np.max(per_plane)) if per_plane.size else 1
        small = [np.concatenate([[0], np.cumsum(counts)]), widths, first, boxes.ravel(), block_plane, block_start]
        self.sizes = [total, total, *(len(t) for t in small)]
        np.concatenate(small, out=host[2 * total : sum(self.sizes)], casting="unsafe")

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The tables as int32 tensors on `device`, in one copy ("boxes" as (P, BOX))."""
        parts = upload(self.buffer[: sum(self.sizes)], device).split(self.sizes)
        out = dict(zip(self.NAMES, parts, strict=True))
        out["boxes"] = out["boxes"].view(-1, BOX.value)
        return out


def _boxes(first: np.ndarray, ends: np.ndarray, values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """(P, BOX) int64 per plane: its box of changes (x0, x1, y0, y1; empty where it has one run), its
    stored width, 0 (the offset, set by the caller), its first run's value.

    The box spans the rows from the second run's first pixel to the last pixel of the last run whose
    value is not the first's, the full width unless that is one row. Neighbouring runs differ in
    value, so those runs are the second one and the last or the one before it: a few operations per
    plane, none per run (this runs on the loader's thread for every batch)."""
    planes = len(first) - 1
    out = np.zeros((planes, BOX.value), np.int64)
    out[:, 4] = widths
    if not planes:
        return out
    a, last = first[:-1], first[1:] - 1
    base = values[a]
    out[:, 6] = base
    some = np.flatnonzero(last > a)  # planes of two runs or more
    if not len(some):
        return out
    a, last, w = a[some], last[some], widths[some]
    start = ends[a]  # the second run's first pixel
    end = ends[np.where(values[last] != base[some], last, last - 1)] - 1  # the last changed pixel
    y0, y1 = start // w, end // w + 1
    one_row = y1 - y0 == 1
    out[some, 0] = np.where(one_row, start % w, 0)
    out[some, 1] = np.where(one_row, end % w + 1, w)
    out[some, 2], out[some, 3] = y0, y1
    return out
