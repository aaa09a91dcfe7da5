"""gpufeed: image datasets onto the GPU at bus speed for PyTorch.

Names are imported on first use, so packing workers (numpy + Pillow only) start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gpufeed._version import __version__

if TYPE_CHECKING:  # what type checkers see of the names imported on first use
    from gpufeed import augment, nn
    from gpufeed.loader import Clip, Loader
    from gpufeed.packing import PackError, PackReport, SourceError, pack
    from gpufeed.store import Store, StoreError, VerifyResult, verify
    from gpufeed.store import open_store as open

_EXPORTS = {
    "Clip": ("gpufeed.loader", "Clip"),
    "Loader": ("gpufeed.loader", "Loader"),
    "PackError": ("gpufeed.packing", "PackError"),
    "PackReport": ("gpufeed.packing", "PackReport"),
    "SourceError": ("gpufeed.packing", "SourceError"),
    "Store": ("gpufeed.store", "Store"),
    "StoreError": ("gpufeed.store", "StoreError"),
    "VerifyResult": ("gpufeed.store", "VerifyResult"),
    "augment": ("gpufeed.augment", None),
    "nn": ("gpufeed.nn", None),
    "open": ("gpufeed.store", "open_store"),
    "pack": ("gpufeed.packing", "pack"),
    "verify": ("gpufeed.store", "verify"),
}
# spelled out for static tools; tests/test_lint.py checks it is sorted(_EXPORTS + __version__)
__all__ = [
    "Clip",
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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpufeed' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return __all__
