"""JPEG decoding: hardware engines (nvImageCodec, optional), nvJPEG, CPU threads and CPU worker
processes, scheduled together. In layers, each importing only those below it:

- the bottom: `asks` (what a decoder is asked to decode of each image; numpy only), `base` (what
  decoders take and return: `Encoded`, `Decoded`), `tuning` (the JPEG path's measured settings);
- `codecs/`: the decoders, each decoding on one device (nvImageCodec's engines and CPU backend,
  nvJPEG, Pillow, a thread pool of them);
- `pool/`: the CPU decode worker processes and what crosses to them (job board, pipes, segments);
- `scheduling/`: how each batch is split between the GPU decoders and the CPU, and steered.

Names are imported on first use: the worker processes import only `asks`, `codecs.pixels` and
`pool.protocol`, without torch (`tests/test_layout.py` checks both)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see of the names imported on first use
    from gpufeed.decode.base import Decoded
    from gpufeed.decode.codecs.cpu import CpuDecoder
    from gpufeed.decode.codecs.nvjpeg import NvJpegDecoder
    from gpufeed.decode.scheduling.scheduler import Scheduler

_EXPORTS = {
    "CpuDecoder": "gpufeed.decode.codecs.cpu",
    "Decoded": "gpufeed.decode.base",
    "NvJpegDecoder": "gpufeed.decode.codecs.nvjpeg",
    "Scheduler": "gpufeed.decode.scheduling.scheduler",
}
# spelled out for static tools; tests/test_lint.py checks it is sorted(_EXPORTS)
__all__ = ["CpuDecoder", "Decoded", "NvJpegDecoder", "Scheduler"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpufeed.decode' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
