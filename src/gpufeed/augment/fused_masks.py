"""Masks resampled from their runs in one GPU kernel (Triton): what `augment.masks` computes with torch
ops (which stays the CPU path and the reference), without expanding the runs.

One program per (plane, block of output pixels): each output pixel's stored pixel (`stored_pixels`,
shared by a sample's planes) is looked up by a binary search over the plane's run ends, and the run's
value is written, cast, into the batch: a read of the pixel index and a write per output pixel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
STEPS_AT_LEAST = 12  # binary search steps: planes of up to 4095 runs (a Triton variant per count of steps)


@triton.jit
def _masks_kernel(
    where,  # (N, HW) int32: the stored pixel each output pixel takes, -1: the fill
    ends,  # (R,) int32: every plane's run ends, plane after plane
    values,  # (R,) int32
    first,  # (P + 1,) int32: plane p's runs are first[p]..first[p + 1]
    owner,  # (P,) int32: the sample of each plane
    slot,  # (P,) int32: where each plane goes in the output's rows (sample * M + instance)
    out,  # (N * M, HW) of the output dtype
    hw,
    fill,
    STEPS: tl.constexpr,  # binary search steps: 2 ** STEPS > the most runs of a plane
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < hw
    sample = tl.load(owner + p).to(tl.int64)
    pixel = tl.load(where + sample * hw + offs, mask=inside, other=-1)
    lo0 = tl.load(first + p)
    hi0 = tl.load(first + p + 1)
    lo = tl.zeros([BLOCK], tl.int32) + lo0
    hi = tl.zeros([BLOCK], tl.int32) + hi0
    for _ in tl.static_range(STEPS):  # the first run whose end is past the pixel
        mid = (lo + hi) // 2
        go = lo < hi
        end = tl.load(ends + mid, mask=go, other=0)
        right = go & (end <= pixel)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(go & ~right, mid, hi)
    found = (pixel >= 0) & (lo < hi0)
    value = tl.load(values + lo, mask=found, other=0)
    value = tl.where(pixel >= 0, value, fill)
    row = tl.load(slot + p).to(tl.int64)
    tl.store(out + row * hw + offs, value.to(out.dtype.element_ty), mask=inside)


def resample(
    where: torch.Tensor,
    ends: torch.Tensor,
    values: torch.Tensor,
    first: torch.Tensor,
    owner: torch.Tensor,
    slot: torch.Tensor,
    out: torch.Tensor,
    most_runs: int,
    fill: int,
) -> None:
    """Write every plane's output pixels into `out` (rows `slot`); the tensors as `_masks_kernel`
    says, int32, on one CUDA device."""
    planes, hw = len(owner), where.shape[1]
    if not planes or not hw:
        return
    # searched in steps of four more than needed at most: one compiled variant serves most batches
    steps = max(STEPS_AT_LEAST, -(-int(most_runs).bit_length() // 4) * 4)
    grid = (planes, triton.cdiv(hw, BLOCK))
    _masks_kernel[grid](where, ends, values, first, owner, slot, out, hw, fill, STEPS=steps, BLOCK=BLOCK)
