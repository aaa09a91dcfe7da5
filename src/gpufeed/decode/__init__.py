"""JPEG decoding: hardware engines (nvImageCodec, optional), nvJPEG, CPU threads and CPU worker
processes, scheduled together. Names are imported on first use: the worker processes import only
`decode.pixels` and `decode.protocol`, without torch."""

from __future__ import annotations

import importlib

_EXPORTS = {"CpuDecoder": "gpufeed.decode.cpu", "Decoded": "gpufeed.decode.base",
            "NvJpegDecoder": "gpufeed.decode.nvjpeg", "Scheduler": "gpufeed.decode.scheduler"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpufeed.decode' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
