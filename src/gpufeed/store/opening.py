"""Opening a store by where it is (`open_store`, exported as `gpufeed.open`): a store on this disk, a
sharded one, or one in a bucket. The one place that tells the kinds apart by their location and
manifest: the readers (`reader`, `sharded`, `remote`) import none of this."""

from __future__ import annotations

from pathlib import Path

from gpufeed.store import format as fmt
from gpufeed.store.format import Manifest
from gpufeed.store.locations import is_url
from gpufeed.store.reader import Store
from gpufeed.store.sharded import ShardedStore


def open_store(path: str | Path, **remote):
    """Open the store at `path` (exported as `gpufeed.open`): read and check its manifest, memory-map
    its data files and range-check its per-sample arrays. Nothing else is read. A sharded store
    (format version 4) opens as a `ShardedStore`, its shards when first used; a URL (`s3://`, `gs://`,
    any fsspec protocol) as a `RemoteStore`, reading its manifest, labels and sizes (`remote`:
    `cache_dir`, `cache_limit`, `storage_options`, see `gpufeed.store.remote`).

    Raises:
        StoreError: not a store, damaged (the file and entry named), or a newer format version.
    """
    if is_url(path):
        from gpufeed.store.remote import RemoteStore  # (its cache's machinery only where a URL asks for it)

        return RemoteStore(str(path), **remote)
    if remote:
        raise ValueError(f"{path}: {sorted(remote)} are for stores in a bucket (a URL)")
    manifest = Manifest.read(Path(path))
    if manifest.version >= fmt.SHARDED_SINCE:
        return ShardedStore(path, manifest)
    return Store(path)
