"""Small host tensors to the device without waiting for it: a batch's targets, tables and counts."""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host tensor `t` on `device` (as `dtype`). To a GPU it goes through page-locked memory from
    torch's caching host allocator, asynchronously: a copy from pageable memory first waits for all
    the work queued on the stream (in a training loop, the whole step before), so the host could
    not prepare the next batch while the GPU trains on this one."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":  # (on a GPU already: nothing to pin)
        return t.to(device)
    if not t.is_pinned():
        try:
            t = t.pin_memory()
        except RuntimeError:  # no page-locked memory (said once where the loader's ring is made)
            return t.to(device)
    return t.to(device, non_blocking=True)
