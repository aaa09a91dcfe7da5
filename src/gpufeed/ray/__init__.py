"""Remote preprocessing on Ray: CPU workers anywhere decode and crop to fixed-size uint8, the
GPU host only copies the batches over the bus and augments them (`RayLoader`).

Needs the `[ray]` extra; importing this package without Ray raises an ImportError that says so.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError:
    raise ImportError("gpufeed.ray needs Ray: pip install 'gpufeed[ray]'") from None

from gpufeed.ray.feed import RayLoader
from gpufeed.ray.remote import fixed_size, read_store

__all__ = ["RayLoader", "fixed_size", "read_store"]
