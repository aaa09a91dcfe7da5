"""One GPU kernel for the whole geometric + normalise part of the pipeline (Triton).

uint8 pixels in (a uniform NHWC batch, or images of different sizes in HWC or CHW layout packed
in one buffer), per-sample box + flip, out: normalised fp16/bf16/fp32 NCHW or NHWC.
The sampling is roi_align's (aligned=True, adaptive sampling ratio): bilinear at bin centres
when upscaling, the mean of ceil(scale)² bilinear samples per output pixel when downscaling,
so it agrees with the CPU path (`pipeline.Augment.apply` on CPU tensors) to float rounding.
Reads each needed source byte from cache once and writes each output element once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# output pixels per program: the fastest of 256, 512, 1024 (`benchmarks/augment_chain_bench.py --parts
# kernel`; docs/benchmarks.md, "Kernels, copies and CPU decoding")
BLOCK = 512


@triton.jit
def _tap(src, p00, p01, p10, p11, w00, w01, w10, w11, valid):
    """One channel of the four-neighbour blend; 0 outside the image like roi_align."""
    v = (
        w00 * tl.load(src + p00, mask=valid, other=0).to(tl.float32)
        + w01 * tl.load(src + p01, mask=valid, other=0).to(tl.float32)
        + w10 * tl.load(src + p10, mask=valid, other=0).to(tl.float32)
        + w11 * tl.load(src + p11, mask=valid, other=0).to(tl.float32)
    )
    return tl.where(valid, v, 0.0)


@triton.jit
def _corners(y, x, H, W):
    """roi_align's bilinear taps at (y, x) of an H x W plane: rows, columns and the four weights."""
    y = tl.maximum(y, 0.0)
    x = tl.maximum(x, 0.0)
    y0 = tl.minimum(y.to(tl.int32), H - 1)
    x0 = tl.minimum(x.to(tl.int32), W - 1)
    y = tl.where(y0 >= H - 1, y0.to(tl.float32), y)
    x = tl.where(x0 >= W - 1, x0.to(tl.float32), x)
    y1 = tl.minimum(y0 + 1, H - 1)
    x1 = tl.minimum(x0 + 1, W - 1)
    ly, lx = y - y0, x - x0
    hy, hx = 1.0 - ly, 1.0 - lx
    return y0, x0, y1, x1, hy * hx, hy * lx, ly * hx, ly * lx


@triton.jit
def _inside(y, x, H, W, mask):
    """Where roi_align samples at all: within one pixel of an H x W image (0 further out)."""
    return mask & (y >= -1.0) & (y <= H) & (x >= -1.0) & (x <= W)


@triton.jit
def _bilinear(src, base, y, x, H, W, sy, sx, sc, mask):
    """Bilinear sample of the 3 channels at (y, x) with roi_align's border rules."""
    valid = _inside(y, x, H, W, mask)
    y0, x0, y1, x1, w00, w01, w10, w11 = _corners(y, x, H, W)
    p00 = base + y0 * sy + x0 * sx
    p01 = base + y0 * sy + x1 * sx
    p10 = base + y1 * sy + x0 * sx
    p11 = base + y1 * sy + x1 * sx
    r = _tap(src, p00, p01, p10, p11, w00, w01, w10, w11, valid)
    g = _tap(src, p00 + sc, p01 + sc, p10 + sc, p11 + sc, w00, w01, w10, w11, valid)
    b = _tap(src, p00 + 2 * sc, p01 + 2 * sc, p10 + 2 * sc, p11 + 2 * sc, w00, w01, w10, w11, valid)
    return r, g, b


@triton.jit
def _plane(src, base, y, x, H, W, valid):
    """Bilinear sample of one contiguous H x W uint8 plane at (y, x)."""
    y0, x0, y1, x1, w00, w01, w10, w11 = _corners(y, x, H, W)
    return _tap(
        src, base + y0 * W + x0, base + y0 * W + x1, base + y1 * W + x0, base + y1 * W + x1, w00, w01, w10, w11, valid
    )


@triton.jit
def _ycc420(src, base, y, x, H, W, mask):
    """RGB at (y, x) of a JPEG's YCbCr 4:2:0 planes (Y H x W, then Cb and Cr at half size, rounded
    up): Y sampled as `_bilinear` samples RGB, the chroma planes bilinearly at the same point with the
    JPEG's centred chroma siting (as libjpeg's fancy upsampling interpolates them), then JFIF's full-range
    conversion, clamped. Where the decoder would have done this per pixel before the resampling, it
    differs by rounding and where a clamp falls."""
    valid = _inside(y, x, H, W, mask)
    CH, CW = (H + 1) // 2, (W + 1) // 2
    luma = _plane(src, base, y, x, H, W, valid)
    cy, cx = (y + 0.5) * 0.5 - 0.5, (x + 0.5) * 0.5 - 0.5
    cb = _plane(src, base + H * W, cy, cx, CH, CW, valid) - 128.0
    cr = _plane(src, base + H * W + CH * CW, cy, cx, CH, CW, valid) - 128.0
    r = tl.minimum(tl.maximum(luma + 1.402 * cr, 0.0), 255.0)
    g = tl.minimum(tl.maximum(luma - 0.344136 * cb - 0.714136 * cr, 0.0), 255.0)
    b = tl.minimum(tl.maximum(luma + 1.772 * cb, 0.0), 255.0)
    return tl.where(valid, r, 0.0), tl.where(valid, g, 0.0), tl.where(valid, b, 0.0)


@triton.jit
def _one_sample(
    src, base, H, W, sy, sx, sc, boxes, flip, scale, shift, out, n, OH, OW, s_n, s_c, s_y, s_x, BLOCK: tl.constexpr
):
    """Output pixels of block program_id(1) of sample n: roi_align of its box, flipped, affine, stored."""
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = p < OH * OW
    oy, ox = p // OW, p % OW
    bx = tl.where(tl.load(flip + n) != 0, OW - 1 - ox, ox)
    x1 = tl.load(boxes + n * 4 + 0) - 0.5
    y1 = tl.load(boxes + n * 4 + 1) - 0.5
    roi_w = tl.load(boxes + n * 4 + 2) - 0.5 - x1
    roi_h = tl.load(boxes + n * 4 + 3) - 0.5 - y1
    bin_w, bin_h = roi_w / OW, roi_h / OH
    gw = tl.maximum(tl.math.ceil(roi_w / OW), 1.0)
    gh = tl.maximum(tl.math.ceil(roi_h / OH), 1.0)
    r = tl.zeros([BLOCK], tl.float32)
    g = tl.zeros([BLOCK], tl.float32)
    b = tl.zeros([BLOCK], tl.float32)
    iy = 0.0
    while iy < gh:  # one program is one sample: its own grid, no masked work
        y = y1 + oy * bin_h + (iy + 0.5) * bin_h / gh
        ix = 0.0
        while ix < gw:
            x = x1 + bx * bin_w + (ix + 0.5) * bin_w / gw
            if sc == 0:  # `decode.base.YCC420`: YCbCr 4:2:0 planes
                vr, vg, vb = _ycc420(src, base, y, x, H, W, mask)
            else:
                vr, vg, vb = _bilinear(src, base, y, x, H, W, sy, sx, sc, mask)
            r += vr
            g += vg
            b += vb
            ix += 1.0
        iy += 1.0
    count = gh * gw
    dst = out + n.to(tl.int64) * s_n + oy * s_y + ox * s_x
    ty = out.dtype.element_ty
    tl.store(dst, (r / count * tl.load(scale) + tl.load(shift)).to(ty), mask=mask)
    tl.store(dst + s_c, (g / count * tl.load(scale + 1) + tl.load(shift + 1)).to(ty), mask=mask)
    tl.store(dst + 2 * s_c, (b / count * tl.load(scale + 2) + tl.load(shift + 2)).to(ty), mask=mask)


@triton.jit
def _resample_kernel(
    src,
    index,
    boxes,
    flip,
    scale,
    shift,
    out,
    H,
    W,
    OH,
    OW,
    s_n,
    s_c,
    s_y,
    s_x,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A uniform NHWC batch; with HAS_INDEX, sample n is row index[n] of the whole store."""
    n = tl.program_id(0)
    if HAS_INDEX:  # noqa: SIM108  a constexpr branch: Triton compiles only the taken side
        base = tl.load(index + n).to(tl.int64) * H * W * 3
    else:
        base = n.to(tl.int64) * H * W * 3
    _one_sample(src, base, H, W, W * 3, 3, 1, boxes, flip, scale, shift, out, n, OH, OW, s_n, s_c, s_y, s_x, BLOCK)


@triton.jit
def _varsize_kernel(
    src, offsets, sizes, strides, rows, boxes, flip, scale, shift, out, OH, OW, s_n, s_c, s_y, s_x, BLOCK: tl.constexpr
):
    """Images of different sizes and layouts: image i starts at src + offsets[i] (offsets may point
    into other allocations than `src`'s), is sizes[i] = (H, W) with element strides[i] = (c, y, x)
    (c = 0: YCbCr 4:2:0 planes, `decode.base.YCC420`), is cropped by boxes[rows[i]] and written to out[rows[i]]."""
    i = tl.program_id(0)
    n = tl.load(rows + i)
    base = tl.load(offsets + i)
    H = tl.load(sizes + 2 * i).to(tl.int32)  # int32 or int64 given
    W = tl.load(sizes + 2 * i + 1).to(tl.int32)
    sc = tl.load(strides + 3 * i)
    sy = tl.load(strides + 3 * i + 1)
    sx = tl.load(strides + 3 * i + 2)
    _one_sample(src, base, H, W, sy, sx, sc, boxes, flip, scale, shift, out, n, OH, OW, s_n, s_c, s_y, s_x, BLOCK)


def _output(n: int, out_hw: tuple[int, int], dtype: torch.dtype, device, channels_last: bool) -> torch.Tensor:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty((n, 3, *out_hw), dtype=dtype, device=device, memory_format=fmt)


def resample_normalize(
    images: torch.Tensor,
    boxes: torch.Tensor,
    flip: torch.Tensor,
    out_hw: tuple[int, int],
    scale: torch.Tensor,
    shift: torch.Tensor,
    dtype: torch.dtype,
    channels_last: bool,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out = resample(images[index])[c] * scale[c] + shift[c]` as `dtype`, NCHW (or channels_last).

    With `index`, sample k is read straight from row index[k] of `images` (no gathered copy).
    """
    images = images if images.is_contiguous() else images.contiguous()
    _, h, w, _ = images.shape
    out = _output(len(boxes), out_hw, dtype, images.device, channels_last)
    if len(boxes):
        _resample_kernel[(len(boxes), triton.cdiv(out_hw[0] * out_hw[1], BLOCK))](
            images,
            boxes if index is None else index,
            boxes,
            flip,
            scale,
            shift,
            out,
            h,
            w,
            *out_hw,
            *out.stride(),
            HAS_INDEX=index is not None,
            BLOCK=BLOCK,
        )
    return out


def resample_packed(
    src: torch.Tensor,
    offsets: torch.Tensor,
    sizes: torch.Tensor,
    strides: torch.Tensor,
    rows: torch.Tensor,
    boxes: torch.Tensor,
    flip: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:
    """Like `resample_normalize` for images of different sizes: image i is at element offsets[i]
    from `src`, sizes[i] = (H, W) int32 or int64, strides[i] = (c, y, x) int64 elements; it is cropped by
    boxes[rows[i]] and written to out[rows[i]] (out: (N, 3, OH, OW)). strides[i] = (0, W, 1): YCbCr
    4:2:0 planes (`decode.base.YCC420`)."""
    oh, ow = out.shape[2], out.shape[3]
    if len(rows):
        _varsize_kernel[(len(rows), triton.cdiv(oh * ow, BLOCK))](
            src, offsets, sizes, strides, rows, boxes, flip, scale, shift, out, oh, ow, *out.stride(), BLOCK=BLOCK
        )
    return out
