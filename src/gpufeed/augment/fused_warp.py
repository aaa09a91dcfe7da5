"""The warp pass in one GPU kernel (Triton): turns, shears, translations and padding of a batch.

Reads the box pass's output (float NCHW 0..255), takes every output pixel through the sample's
matrix to the point it samples (nearest or bilinear, zero outside, as `grid_sample`), puts the fill
where some op on the way looked outside its image, and writes either float 0..255 for the colour ops
or, when none follow, the normalised, cast and laid-out batch. It computes what `affine.warp` computes
with torch ops (which stays the CPU path and the reference), in one read and one write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpufeed.augment.affine import Warp
from gpufeed.augment.colour import constant

BLOCK = 512
MAX_BOUNDS = 4  # images a warp reads from (the box pass's output and up to 3 ops that fill)


@triton.jit
def rint(x):
    """Round half to even, as torch.round and grid_sample's nearest."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _point(mats, b, n, N, xs, ys):
    """Where output pixel centres (xs, ys) land in image b, as pixel indices (centre of pixel k at k)."""
    m = mats + (b * N + n) * 6
    u = tl.load(m) * xs + tl.load(m + 1) * ys + tl.load(m + 2) - 0.5
    v = tl.load(m + 3) * xs + tl.load(m + 4) * ys + tl.load(m + 5) - 0.5
    return u, v


@triton.jit
def _axis_inside(u, size, BILINEAR: tl.constexpr):
    if BILINEAR:
        lo = tl.floor(u)
        frac = u - lo
        a = ((lo >= 0) & (lo <= size - 1)).to(tl.float32)
        b = ((lo >= -1) & (lo <= size - 2)).to(tl.float32)
        return (1.0 - frac) * a + frac * b
    r = rint(u)
    return ((r >= 0) & (r <= size - 1)).to(tl.float32)


@triton.jit
def _size(sizes, b):
    return tl.load(sizes + 2 * b), tl.load(sizes + 2 * b + 1)


@triton.jit
def coverage(mats, sizes, n, N, xs, ys, START: tl.constexpr, B: tl.constexpr, BILINEAR: tl.constexpr):
    """How much of each output pixel comes from inside images START..B-1 (1 inside, 0 filled)."""
    cov = tl.full(xs.shape, 1.0, tl.float32)
    for b in tl.static_range(START, B):
        h, w = _size(sizes, b)
        u, v = _point(mats, b, n, N, xs, ys)
        cov = cov * _axis_inside(u, w, BILINEAR) * _axis_inside(v, h, BILINEAR)
    return cov


@triton.jit
def fill_in(val, cov, fill, c, BILINEAR: tl.constexpr, FILL_C: tl.constexpr):
    """Channel c's values with the fill put in where `coverage` says they came from outside: blended by
    the coverage at a bilinear fringe, else wherever less than half came from inside."""
    f = tl.load(fill + (c if FILL_C == 3 else 0))
    if BILINEAR:
        return cov * (val - f) + f
    return tl.where(cov < 0.5, f, val)


@triton.jit
def _tap(plane, r, c, H, W, mask):
    ok = mask & (r >= 0) & (r <= H - 1) & (c >= 0) & (c <= W - 1)
    return tl.load(plane + r * W + c, mask=ok, other=0.0)


@triton.jit
def _sample(plane, u, v, H, W, flipped, mask, BILINEAR: tl.constexpr):
    """One channel of `plane` (H×W float) at (u, v), zero outside; rows read upside down if `flipped`."""
    if BILINEAR:
        x0 = tl.floor(u)
        y0 = tl.floor(v)
        fx, fy = u - x0, v - y0
        c0, r0 = x0.to(tl.int32), y0.to(tl.int32)
        r0f = tl.where(flipped, H - 1 - r0, r0)
        r1f = tl.where(flipped, H - 2 - r0, r0 + 1)
        top = (1.0 - fx) * _tap(plane, r0f, c0, H, W, mask) + fx * _tap(plane, r0f, c0 + 1, H, W, mask)
        bottom = (1.0 - fx) * _tap(plane, r1f, c0, H, W, mask) + fx * _tap(plane, r1f, c0 + 1, H, W, mask)
        return (1.0 - fy) * top + fy * bottom
    c = rint(u).to(tl.int32)
    r = rint(v).to(tl.int32)
    return _tap(plane, tl.where(flipped, H - 1 - r, r), c, H, W, mask)


@triton.jit
def _warp_kernel(
    x,
    out,
    mats,
    sizes,
    vflip,
    fill,
    scale,
    shift,
    N,
    H,
    W,
    OH,
    OW,
    s_n,
    s_c,
    s_y,
    s_x,
    B: tl.constexpr,
    FIRST: tl.constexpr,
    BILINEAR: tl.constexpr,
    HAS_VFLIP: tl.constexpr,
    FILL_C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = p < OH * OW
    oy, ox = p // OW, p % OW
    xs, ys = ox.to(tl.float32) + 0.5, oy.to(tl.float32) + 0.5
    u, v = _point(mats, 0, n, N, xs, ys)
    flipped = tl.full([BLOCK], 0, tl.int1)
    if HAS_VFLIP:
        flipped = (tl.zeros([BLOCK], tl.int32) + tl.load(vflip + n).to(tl.int32)) != 0
    cov = coverage(mats, sizes, n, N, xs, ys, FIRST, B, BILINEAR)
    dst = out + n.to(tl.int64) * s_n + oy * s_y + ox * s_x
    src = x + n.to(tl.int64) * 3 * H * W
    for c in tl.static_range(3):
        val = _sample(src + c * H * W, u, v, H, W, flipped, mask, BILINEAR)
        if FIRST < B:
            val = fill_in(val, cov, fill, c, BILINEAR, FILL_C)
        val = val * tl.load(scale + c) + tl.load(shift + c)
        tl.store(dst + c * s_c, val.to(out.dtype.element_ty), mask=mask)


def supports(w: Warp) -> bool:
    """Whether the kernel covers this warp (else the torch path in `affine.warp` runs it)."""
    return w.resampling.padding == "constant" and len(w.sizes) <= MAX_BOUNDS


def sizes_of(w: Warp, device: torch.device) -> torch.Tensor:
    """The bounds' (h, w) back to back as int32 on `device`, made once per warp shape."""
    return constant(tuple(side for hw in w.sizes for side in hw), device, torch.int32)


def warp(
    y: torch.Tensor,
    w: Warp,
    vflip: torch.Tensor | None,
    fill: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:
    """Warp float NCHW 0..255 `y` (contiguous) into `out` (N, 3, *w.out_hw, any strides and float dtype):
    `out = warped * scale[c] + shift[c]`; `vflip` (N,) turns samples upside down first; `fill` (1 or 3
    values) goes where the ops filled (none when the resampling has no fill and one image is read)."""
    n, _, h, wd = y.shape
    oh, ow = w.out_hw
    first = 0 if w.resampling.fill is not None else 1
    if n:
        _warp_kernel[(n, triton.cdiv(oh * ow, BLOCK))](
            y,
            out,
            w.matrices.contiguous(),
            sizes_of(w, y.device),
            vflip if vflip is not None else y,
            fill,
            scale,
            shift,
            n,
            h,
            wd,
            oh,
            ow,
            *out.stride(),
            B=len(w.sizes),
            FIRST=first,
            BILINEAR=w.resampling.interpolation == "bilinear",
            HAS_VFLIP=vflip is not None,
            FILL_C=fill.numel(),
            BLOCK=BLOCK,
        )
    return out
