"""JPEG decoding: hardware engines (nvImageCodec, optional), nvJPEG and CPU threads, scheduled together."""

from gpufeed.decode.base import Decoded
from gpufeed.decode.cpu import CpuDecoder
from gpufeed.decode.nvjpeg import NvJpegDecoder
from gpufeed.decode.scheduler import Scheduler

__all__ = ["CpuDecoder", "Decoded", "NvJpegDecoder", "Scheduler"]
