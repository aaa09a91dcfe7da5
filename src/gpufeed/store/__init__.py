"""The on-disk store: format (one module), atomic writing, O(1) reading, verification.

Reading needs torch; the format and the writer don't, so they import without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see of the names imported on first use
    from gpufeed.store.format import FORMAT_VERSION, Manifest, StoreError
    from gpufeed.store.integrity import VerifyResult, verify
    from gpufeed.store.opening import open_store
    from gpufeed.store.reader import Store

_EXPORTS = {
    "FORMAT_VERSION": "gpufeed.store.format",
    "Manifest": "gpufeed.store.format",
    "StoreError": "gpufeed.store.format",
    "Store": "gpufeed.store.reader",
    "open_store": "gpufeed.store.opening",
    "VerifyResult": "gpufeed.store.integrity",
    "verify": "gpufeed.store.integrity",
}
# spelled out for static tools; tests/test_lint.py checks it is sorted(_EXPORTS)
__all__ = ["FORMAT_VERSION", "Manifest", "Store", "StoreError", "VerifyResult", "open_store", "verify"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpufeed.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
