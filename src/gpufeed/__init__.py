"""gpufeed: image datasets onto the GPU at bus speed for PyTorch."""

from gpufeed import augment, nn
from gpufeed._version import __version__
from gpufeed.loader import Loader
from gpufeed.packing import PackError, PackReport, SourceError, pack
from gpufeed.store import Store, StoreError, VerifyResult, verify
from gpufeed.store import open_store as open

__all__ = [
    "Loader",
    "PackError",
    "PackReport",
    "SourceError",
    "Store",
    "StoreError",
    "VerifyResult",
    "__version__",
    "augment",
    "nn",
    "open",
    "pack",
    "verify",
]
