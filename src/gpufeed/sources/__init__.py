"""What a dataset is read from: an image folder, a CSV/JSONL list or tar shards, as `Item`s and `Skip`s.

`gpufeed.pack` packs them; a `Loader` given a folder, list or shards reads them in place
(`loader.folder`). Neither imports the other: both read this package.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from gpufeed.sources.coco import coco_source, is_coco
from gpufeed.sources.entries import MAX_FILE_BYTES, Entry, Item, Skip, Source, SourceError
from gpufeed.sources.folders import IMAGE_EXTS, folder_source
from gpufeed.sources.lists import list_source
from gpufeed.sources.tars import TAR_IMAGE_EXTS, TAR_SUFFIXES, tar_key, tar_label, tar_source
from gpufeed.store.locations import is_url

__all__ = [
    "IMAGE_EXTS",
    "MAX_FILE_BYTES",
    "TAR_IMAGE_EXTS",
    "TAR_SUFFIXES",
    "Entry",
    "Item",
    "Skip",
    "Source",
    "SourceError",
    "open_source",
    "tar_key",
    "tar_label",
]


def open_source(
    source: str | os.PathLike,
    storage_options: dict | None = None,
    images: str | os.PathLike | None = None,
    videos: bool = False,
) -> Source:
    """Recognise `source` and return its entries; raises SourceError if it cannot be used. A URL (tar
    shards or a list in a bucket, any fsspec URL; `storage_options` are fsspec's) is read through
    fsspec (`sources.remote`). A COCO annotation file (.json) reads its images from `images`.
    `videos`: a folder's or tar's videos (a local folder, list or tar shards), not its images."""
    text = os.fspath(source)
    if videos:
        return _video_source(text)
    if is_url(text):
        from gpufeed.sources.remote import remote_source  # fsspec only where it is asked for

        return remote_source(text, storage_options)
    if glob.has_magic(text):
        shards = sorted(glob.glob(text))
        if not shards:
            raise SourceError(f"{text}: no file matches this pattern")
        return tar_source(text, shards)
    path = Path(text)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    if path.is_dir():
        return folder_source(path)
    lower = path.name.lower()
    if lower.endswith(TAR_SUFFIXES):
        return tar_source(text, [text])
    if lower.endswith((".csv", ".jsonl")):
        return list_source(path)
    if is_coco(path):
        return coco_source(path, images)
    raise SourceError(f"{path}: not a folder, .csv/.jsonl list, COCO .json or .tar/.tar.gz/.tgz shard")


def _video_source(text: str) -> Source:
    """A folder of videos (class folders or flat), a .csv/.jsonl list of them (path,label and, for
    a clip range in seconds, start and end columns) or tar shards with a video member per sample."""
    from gpufeed.sources.videos import TAR_VIDEOS, VIDEO_EXTS

    if is_url(text):
        raise SourceError(f"{text}: videos are packed from this machine's files (a folder, list or tar shards)")
    shards = sorted(glob.glob(text)) if glob.has_magic(text) else None
    if shards is not None:
        if not shards:
            raise SourceError(f"{text}: no file matches this pattern")
        return tar_source(text, shards, TAR_VIDEOS)
    path = Path(text)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    if path.is_dir():
        return folder_source(path, VIDEO_EXTS)
    lower = path.name.lower()
    if lower.endswith(TAR_SUFFIXES):
        return tar_source(text, [text], TAR_VIDEOS)
    if lower.endswith((".csv", ".jsonl")):
        return list_source(path)
    raise SourceError(f"{path}: not a folder of videos, .csv/.jsonl list or .tar shard")
