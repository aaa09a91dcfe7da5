"""The on-disk store: format (one module), atomic writing, O(1) reading, verification.

Reading needs torch; the format and the writer don't, so they import without it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FORMAT_VERSION": "gpufeed.store.format",
    "Manifest": "gpufeed.store.format",
    "StoreError": "gpufeed.store.format",
    "Store": "gpufeed.store.reader",
    "open_store": "gpufeed.store.reader",
    "VerifyResult": "gpufeed.store.integrity",
    "verify": "gpufeed.store.integrity",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpufeed.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
