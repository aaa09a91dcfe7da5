"""Packing: enumerate a source, decode and fit images on all cores, write a store."""

from gpufeed.packing.packer import PackError, PackReport, pack
from gpufeed.sources import SourceError

__all__ = ["PackError", "PackReport", "SourceError", "pack"]
