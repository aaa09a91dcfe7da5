"""Packing into a bucket: a sharded store packed in a local scratch folder, each shard uploaded as it is
finished, then the top files, the manifest last (a reader never sees a half store: no manifest, no
store). An existing store there is replaced only with `overwrite`, and only once the new store is
complete in the scratch folder (a mistyped or empty source, or any other failure of the pack, leaves
it as it was): then its manifest is removed (readers find no store rather than a mixed one), the new
store uploaded, and the old shards past the new ones removed."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufeed.logs import logger
from gpufeed.packing.report import PackReport
from gpufeed.store import format as fmt
from gpufeed.store.format import StoreError
from gpufeed.store.scratch import held_folder, reclaim

log = logger(__name__)
DEFAULT_SHARD_SIZE = "256MB"
SCRATCH = "gpufeed-pack-"  # a pack's scratch folder in TMPDIR: SCRATCH, its process id, "-", a random part


def reclaim_scratch() -> list[str]:
    """Remove the scratch folders in TMPDIR of packs to a bucket whose process is gone (killed: a
    store's worth each, left for good), never one a running pack holds (`store.scratch`); their names."""
    removed = reclaim(Path(tempfile.gettempdir()), re.escape(SCRATCH))
    if removed:
        log.info("gpufeed pack: removed %s, scratch folder(s) of packs gone", ", ".join(removed))
    return removed


def pack_to_url(
    pack_local: Callable[..., PackReport],
    source,
    url: str,
    *,
    overwrite: bool,
    shard_size,
    storage_options: dict | None,
    **settings: Any,
) -> PackReport:
    """`gpufeed.pack` with a URL destination (see its docstring): the same store, sharded, in the bucket.
    `pack_local(source, folder, shard_size=, on_shard=, **settings)` packs it in the scratch folder
    (`packer._pack_local`, passed in: the local pack is `packer`'s, which calls this one for a URL)."""
    from gpufeed.store.fetch import retried
    from gpufeed.store.locations import filesystem, shown, store_url

    url = store_url(url)
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    where = shown(url)
    replacing = retried(f"{where}/{fmt.MANIFEST}", lambda: fs.exists(f"{root}/{fmt.MANIFEST}"))
    if replacing and not overwrite:
        raise StoreError(f"{where}: destination exists (a gpufeed store); pass overwrite=True to replace it")

    def upload(name: str, folder: Path) -> None:
        for path in sorted(folder.iterdir()):
            retried(f"{where}/{name}/{path.name}", lambda: fs.put_file(str(path), f"{root}/{name}/{path.name}"))  # noqa: B023  retried() calls it at once

    reclaim_scratch()
    with held_folder(Path(tempfile.gettempdir()), SCRATCH) as scratch:
        local = scratch / "store"
        # a new store's shards go up as they are finished; one that replaces a store waits for the whole
        # pack (its shards' names are the old store's)
        report = pack_local(
            source,
            local,
            shard_size=shard_size or DEFAULT_SHARD_SIZE,
            on_shard=None if replacing else upload,
            overwrite=False,  # a new scratch folder
            storage_options=None,  # the bucket's (a URL source's own are not passed: as before)
            **settings,
        )
        manifest = fmt.Manifest.read(local)
        if replacing:  # (a removal that fails leaves the old store whole: said as it is, below not)
            retried(f"{where}/{fmt.MANIFEST}", lambda: fs.rm_file(f"{root}/{fmt.MANIFEST}"))
        try:
            if replacing:
                for shard in manifest.shards:
                    upload(shard["name"], local / shard["name"])
            for name in manifest.files:
                retried(f"{where}/{name}", lambda: fs.put_file(str(local / name), f"{root}/{name}"))  # noqa: B023  retried() calls it at once
            retried(f"{where}/{fmt.MANIFEST}", lambda: fs.put_file(str(local / fmt.MANIFEST), f"{root}/{fmt.MANIFEST}"))
        except StoreError as e:
            if replacing:  # said, so that nobody looks for the old store there
                raise StoreError(
                    f"{e}; the store that was at {where} is removed (its manifest first): pack again"
                ) from None
            raise
    _remove_stale_shards(fs, root, len(manifest.shards), where)
    report.dest = url  # type: ignore[assignment]  # a URL: the store is in the bucket
    return report


def _remove_stale_shards(fs, root: str, count: int, where: str) -> None:
    """Shards of a store this one replaced, past its own count (nothing reads them: the manifest names
    the new ones)."""
    try:
        listed = fs.ls(f"{root}/{fmt.SHARDS}", detail=False)
    except FileNotFoundError:
        return
    keep = {fmt.shard_name(k).split("/")[-1] for k in range(count)}
    for entry in listed:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if name not in keep:
            try:
                fs.rm(f"{root}/{fmt.SHARDS}/{name}", recursive=True)
            except OSError as e:
                log.warning(
                    "gpufeed pack: could not remove %s/%s/%s, left from the store it replaced (%s)",
                    where,
                    fmt.SHARDS,
                    name,
                    type(e).__name__,
                )
