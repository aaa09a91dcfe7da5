"""The on-disk store: format (one module), atomic writing, O(1) reading, verification."""

from gpufeed.store.format import FORMAT_VERSION, Manifest, StoreError
from gpufeed.store.reader import Store, open_store
from gpufeed.store.verify import VerifyResult, verify

__all__ = ["FORMAT_VERSION", "Manifest", "Store", "StoreError", "VerifyResult", "open_store", "verify"]
