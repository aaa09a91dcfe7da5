"""The user's cache folder, where gpufeed keeps what outlives a process: a folder's index
(`loader.folder`), a bucket store's shards (`store.remote`), Triton's kernel-cache key
(`augment.triton_key`)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache() -> Path:
    """$XDG_CACHE_HOME/gpufeed, or ~/.cache/gpufeed (not made here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpufeed"
