"""`open_input`: the one place a Loader's data is told apart by kind."""

from __future__ import annotations

from pathlib import Path

from gpufeed.loader.folder import FolderStore, is_folder_source
from gpufeed.loader.inputs.base import Input
from gpufeed.loader.inputs.folder import FolderInput
from gpufeed.loader.inputs.packed import PackedInput
from gpufeed.loader.inputs.sharded import ShardedInput
from gpufeed.store.locations import is_url
from gpufeed.store.opening import open_store
from gpufeed.store.reader import Store
from gpufeed.store.remote import RemoteStore
from gpufeed.store.sharded import ShardedStore


def reads_in_place(store: object) -> bool:
    """Whether `Loader(store)` reads images where they are (a folder, list or tar shards on this disk)."""
    return isinstance(store, (str, Path)) and not is_url(store) and is_folder_source(store)


def open_input(store, cache_dir=None, cache_limit=None, storage_options=None) -> Input:
    """The input a Loader reads: a store object as given; a folder, list or tar shards to read in place;
    else what `open_store` opens (a URL as a `RemoteStore`, read through its cache; a store on this
    disk, sharded or not)."""
    remote = {
        k: v
        for k, v in (("cache_dir", cache_dir), ("cache_limit", cache_limit), ("storage_options", storage_options))
        if v is not None
    }
    if isinstance(store, (Store, ShardedStore, FolderStore)):
        if remote:  # an opened store in a bucket has its cache already: they would go unused
            raise ValueError(
                f"{store.path}: {sorted(remote)} are for opening a store in a bucket by its URL (Loader(url, ...) "
                "or gpufeed.open(url, ...)), not for a store already opened"
            )
        opened = store
    elif not is_url(store) and is_folder_source(store):
        if remote:
            raise ValueError(f"{store}: {sorted(remote)} are for a store in a bucket (a URL)")
        opened = FolderStore(store)
    else:
        opened = open_store(store, **remote)
    if isinstance(opened, FolderStore):
        return FolderInput(opened)
    if isinstance(opened, RemoteStore):  # (a bucket's and a video store's inputs load only when used)
        from gpufeed.loader.inputs.remote import RemoteInput

        return RemoteInput(opened)
    if isinstance(opened, ShardedStore):
        return ShardedInput(opened)
    if opened.mode == "video":
        from gpufeed.loader.inputs.video import VideoInput

        return VideoInput(opened)
    return PackedInput(opened)
