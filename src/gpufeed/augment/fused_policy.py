"""A policy's colour ops in one GPU kernel per slot (Triton): RandAugment, TrivialAugmentWide, AutoAugment.

One program is one block of one sample, so the op a sample drew for the slot is a branch taken by the
whole program: no grouping, no gather and scatter of the samples that drew each op. The ops that need
the whole image first (Contrast: the mean gray level; AutoContrast: each channel's range; Equalize:
each channel's histogram) get it from a statistics pass over the slot's input, run only when some
sample drew one of them. The last slot's kernel also fills again where the policy asks, normalises,
casts and lays out the batch. Same formulas as `colour` (the CPU path and the reference).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gpufeed.augment.affine import Warp
from gpufeed.augment.fused_warp import coverage, fill_in, rint, sizes_of
from gpufeed.augment.policies import ID

BLOCK = 512
STATS = 6 + 3 * 256  # per sample: 3 channel minima (as +inf's bits - bits), 3 maxima (bits), 3 histograms or tables
STATS_C: tl.constexpr = tl.constexpr(STATS)
BRIGHTNESS: tl.constexpr = tl.constexpr(ID["Brightness"])
COLOR: tl.constexpr = tl.constexpr(ID["Color"])
CONTRAST: tl.constexpr = tl.constexpr(ID["Contrast"])
SHARPNESS: tl.constexpr = tl.constexpr(ID["Sharpness"])
POSTERIZE: tl.constexpr = tl.constexpr(ID["Posterize"])
SOLARIZE: tl.constexpr = tl.constexpr(ID["Solarize"])
AUTOCONTRAST: tl.constexpr = tl.constexpr(ID["AutoContrast"])
EQUALIZE: tl.constexpr = tl.constexpr(ID["Equalize"])
INVERT: tl.constexpr = tl.constexpr(ID["Invert"])
COLOUR_OPS = tuple(range(ID["Brightness"], ID["Invert"] + 1))
NEEDS_STATS = (ID["Contrast"], ID["AutoContrast"], ID["Equalize"])


@triton.jit
def _stats_kernel(x, cols, col, ncols, gsum, ints, H, W, BLOCK: tl.constexpr):
    """Add this block's share to the statistics of its sample, for the op it drew (if it needs any)."""
    n = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = p < H * W
    op = tl.load(cols + n * ncols + col).to(tl.int32)
    src = x + n.to(tl.int64) * 3 * H * W + p
    mine = ints + n * STATS_C
    if op == CONTRAST:
        r = tl.load(src, mask=mask, other=0.0)
        g = tl.load(src + H * W, mask=mask, other=0.0)
        b = tl.load(src + 2 * H * W, mask=mask, other=0.0)
        tl.atomic_add(gsum + n, tl.sum(0.2989 * r + 0.587 * g + 0.114 * b, 0))
    if op == AUTOCONTRAST:
        for c in tl.static_range(3):
            v = tl.load(src + c * H * W, mask=mask, other=0.0)
            v = tl.where(v > 0.0, v, 0.0)  # no -0.0: its bits would not order
            low = tl.min(tl.where(mask, v, float("inf")), 0)
            tl.atomic_max(mine + c, 0x7F800000 - low.to(tl.int32, bitcast=True))  # +inf's bits - min's
            tl.atomic_max(mine + 3 + c, tl.max(v, 0).to(tl.int32, bitcast=True))
    if op == EQUALIZE:
        bins = tl.arange(0, 256)
        outside = BLOCK - tl.sum(mask.to(tl.int32), 0)
        for c in tl.static_range(3):
            v = tl.load(src + c * H * W, mask=mask, other=0.0)
            level = tl.minimum(tl.maximum(rint(v), 0.0), 255.0).to(tl.int32)
            counts = tl.histogram(tl.where(mask, level, 0), 256)
            counts = counts - tl.where(bins == 0, outside, 0)
            tl.atomic_add(mine + 6 + c * 256 + bins, counts)


@triton.jit
def _table_kernel(cols, col, ncols, ints, HW):
    """Each histogram of a sample that drew Equalize becomes its lookup table (PIL's, in place)."""
    n = tl.program_id(0) // 3
    c = tl.program_id(0) % 3
    op = tl.load(cols + n * ncols + col).to(tl.int32)
    if op == EQUALIZE:
        levels = tl.arange(0, 256)
        at = ints + n * STATS_C + 6 + c * 256 + levels
        hist = tl.load(at)
        last = tl.max(tl.where(hist > 0, levels, -1), 0)  # the highest level present
        step = (HW - tl.sum(tl.where(levels == last, hist, 0), 0)) // 255
        table = (tl.cumsum(hist, 0) - hist + step // 2) // tl.maximum(step, 1)
        table = tl.minimum(tl.maximum(table, 0), 255)
        tl.store(at, tl.where(step > 0, table, levels))


@triton.jit
def _sharpen(plane, v, f, oy, ox, H, W, mask):
    """Blend with torchvision's 3×3 smoothing (its border kept): f > 1 sharpens."""
    inner = mask & (oy >= 1) & (oy <= H - 2) & (ox >= 1) & (ox <= W - 2)
    at = plane + oy * W + ox
    around = tl.zeros(v.shape, tl.float32)
    for dy in tl.static_range(-1, 2):
        for dx in tl.static_range(-1, 2):
            if dy != 0 or dx != 0:
                around += tl.load(at + dy * W + dx, mask=inner, other=0.0)
    smooth = tl.where(inner, rint((around + 5.0 * v) / 13.0), v)
    return tl.minimum(tl.maximum(f * v + (1.0 - f) * smooth, 0.0), 255.0)


@triton.jit
def _recolour(v, c, op, m, gray, mean, mine, plane, oy, ox, H, W, mask):
    """Channel c's values `v` after the op the sample drew (Identity and geometric ops: unchanged)."""
    out = v
    f = 1.0 + m
    if op == BRIGHTNESS:
        out = tl.minimum(tl.maximum(v * f, 0.0), 255.0)
    elif op == COLOR:
        out = tl.minimum(tl.maximum(f * v + (1.0 - f) * gray, 0.0), 255.0)
    elif op == CONTRAST:
        out = tl.minimum(tl.maximum(f * v + (1.0 - f) * mean, 0.0), 255.0)
    elif op == SHARPNESS:
        out = _sharpen(plane, v, f, oy, ox, H, W, mask)
    elif op == POSTERIZE:
        bits = m.to(tl.int32)
        step = ((bits * 0 + 1) << (8 - bits)).to(tl.float32)  # exact powers of two
        out = tl.floor(rint(v) / step) * step
    elif op == SOLARIZE:
        out = tl.where(v >= 255.0 * m, 255.0 - v, v)
    elif op == AUTOCONTRAST:
        low = (0x7F800000 - tl.load(mine + c)).to(tl.float32, bitcast=True)
        high = tl.load(mine + 3 + c).to(tl.float32, bitcast=True)
        flat = high <= low
        scale = tl.where(flat, 1.0, 255.0 / tl.maximum(high - low, 1e-6))
        out = tl.minimum(tl.maximum((v - tl.where(flat, 0.0, low)) * scale, 0.0), 255.0)
    elif op == EQUALIZE:
        level = tl.minimum(tl.maximum(rint(v), 0.0), 255.0).to(tl.int32)
        out = tl.load(mine + 6 + c * 256 + level, mask=mask, other=0).to(tl.float32)
    elif op == INVERT:
        out = 255.0 - v
    return out


@triton.jit
def _colour_kernel(
    x,
    out,
    cols,
    col,
    ncols,
    gsum,
    ints,
    H,
    W,
    mats,
    sizes,
    N,
    fill,
    scale,
    shift,
    s_n,
    s_c,
    s_y,
    s_x,
    FINAL: tl.constexpr,
    B: tl.constexpr,
    BILINEAR: tl.constexpr,
    FILL_C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One slot's op on every sample; FINAL: then the refill (B > 0: the warp's images), the
    normalisation and the cast into `out`'s dtype and strides."""
    n = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = p < H * W
    oy, ox = p // W, p % W
    op = tl.load(cols + n * ncols + col).to(tl.int32)
    m = tl.load(cols + n * ncols + col + 1)
    src = x + n.to(tl.int64) * 3 * H * W
    r = tl.load(src + p, mask=mask, other=0.0)
    g = tl.load(src + H * W + p, mask=mask, other=0.0)
    b = tl.load(src + 2 * H * W + p, mask=mask, other=0.0)
    gray = 0.2989 * r + 0.587 * g + 0.114 * b
    mean = tl.load(gsum + n) / (H * W)
    mine = ints + n * STATS_C
    r = _recolour(r, 0, op, m, gray, mean, mine, src, oy, ox, H, W, mask)
    g = _recolour(g, 1, op, m, gray, mean, mine, src + H * W, oy, ox, H, W, mask)
    b = _recolour(b, 2, op, m, gray, mean, mine, src + 2 * H * W, oy, ox, H, W, mask)
    if FINAL and B > 0:
        again = tl.load(cols + n * ncols + col + 2) > 0.0  # the flag follows the last slot's columns
        xs, ys = ox.to(tl.float32) + 0.5, oy.to(tl.float32) + 0.5
        cov = coverage(mats, sizes, n, N, xs, ys, 0, B, BILINEAR)
        r = tl.where(again, fill_in(r, cov, fill, 0, BILINEAR, FILL_C), r)
        g = tl.where(again, fill_in(g, cov, fill, 1, BILINEAR, FILL_C), g)
        b = tl.where(again, fill_in(b, cov, fill, 2, BILINEAR, FILL_C), b)
    dst = out + n.to(tl.int64) * s_n + oy * s_y + ox * s_x
    ty = out.dtype.element_ty
    if FINAL:
        r = r * tl.load(scale) + tl.load(shift)
        g = g * tl.load(scale + 1) + tl.load(shift + 1)
        b = b * tl.load(scale + 2) + tl.load(shift + 2)
    tl.store(dst, r.to(ty), mask=mask)
    tl.store(dst + s_c, g.to(ty), mask=mask)
    tl.store(dst + 2 * s_c, b.to(ty), mask=mask)


def apply(
    y: torch.Tensor,
    pixel: torch.Tensor,
    first: int,
    choices: torch.Tensor,
    w: Warp | None,
    fill: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:
    """The policy's colour ops on float NCHW 0..255 `y` (contiguous), then its refill (where `w` filled),
    `* scale[c] + shift[c]` into `out`. The policy's columns of `pixel` (float32 on y's device) start
    at column `first`: (op, magnitude) per slot, then the refill flag; `choices` (N, slots) are the
    same op ids on the host, so passes no sample needs are skipped without a sync."""
    n, _, h, wd = y.shape
    slots = choices.shape[1]
    if not n:
        return out
    if pixel.stride(1) != 1:
        pixel = pixel.contiguous()
    ncols = pixel.stride(0)
    drawn = [set(choices[:, k].tolist()) for k in range(slots)]
    stats = [bool(d & set(NEEDS_STATS)) for d in drawn]
    if any(stats):
        gsum = torch.zeros(slots, n, device=y.device)
        ints = torch.zeros(slots, n, STATS, device=y.device, dtype=torch.int32)
    else:
        gsum, ints = _unused(y.device)
    grid = (n, triton.cdiv(h * wd, BLOCK))
    b = 0 if w is None else len(w.sizes)
    mats, sizes = _unused(y.device) if w is None else (w.matrices.contiguous(), sizes_of(w, y.device))
    for k in range(slots):
        col, last = first + 2 * k, k == slots - 1
        if not last and not drawn[k] & set(COLOUR_OPS):
            continue  # every sample drew Identity or a geometric op here
        gs, mine = (gsum[k], ints[k]) if stats[k] else _unused(y.device)
        if stats[k]:
            _stats_kernel[grid](y, pixel, col, ncols, gs, mine, h, wd, BLOCK=BLOCK)
            if ID["Equalize"] in drawn[k]:
                _table_kernel[(3 * n,)](pixel, col, ncols, mine, h * wd)
        dst = out if last else torch.empty_like(y)
        _colour_kernel[grid](
            y,
            dst,
            pixel,
            col,
            ncols,
            gs,
            mine,
            h,
            wd,
            mats,
            sizes,
            n,
            fill,
            scale,
            shift,
            *dst.stride(),
            FINAL=last,
            B=b if last else 0,
            BILINEAR=w is not None and w.resampling.interpolation == "bilinear",
            FILL_C=fill.numel(),
            BLOCK=BLOCK,
        )
        y = dst
    return out


@functools.lru_cache(maxsize=8)
def _unused(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins (float, int32) for tensors a kernel is passed but never reads: the statistics of a slot
    that needs none, the warp's matrices and sizes when there is no warp."""
    return torch.zeros(1, device=device), torch.zeros(1, device=device, dtype=torch.int32)
