"""An image folder as a source: an ImageFolder tree (labels follow the sorted class folder names) or a
flat folder (label -1), walked in sorted order, following links but never looping."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from gpufeed.sources.entries import Entry, Item, Skip, Source, count_items

IMAGE_EXTS = frozenset(Image.registered_extensions())
_name = operator.attrgetter("name")  # (a DirEntry's; sorting by it in C: a lambda cost a third more)


def _walk(directory: str, seen: set[tuple[int, int]], exts: frozenset[str] = IMAGE_EXTS) -> Iterator[str | Skip]:
    """Files of `exts` (images) under `directory`, sorted, following symlinks but never looping."""
    try:
        st = os.stat(directory)
        entries = sorted(os.scandir(directory), key=_name)
    except OSError as e:
        yield Skip(directory, f"unreadable directory: {e.strerror or e}")
        return
    if (st.st_dev, st.st_ino) in seen:
        yield Skip(directory, "symlink loop: directory already visited")
        return
    seen.add((st.st_dev, st.st_ino))
    for entry in entries:
        name = entry.name
        if name.startswith("."):
            yield Skip(entry.path, "hidden file or folder (dotfile)", fatal=False)
        elif _is_dir(entry):
            yield from _walk(entry.path, seen, exts)
        elif (ext := _extension(name)).lower() in exts:
            yield entry.path  # a broken or looping link fails when read, with the reason
        else:
            what = "an image" if exts is IMAGE_EXTS else "a video"
            yield Skip(entry.path, f"not {what} file (extension {ext or 'none'!r})", fatal=False)


def _extension(name: str) -> str:
    """`os.path.splitext(name)[1]` of a name that does not start with a dot, in a third of the time
    (a folder of 50,000 photos is walked each time it is read in place)."""
    _, dot, ext = name.rpartition(".")
    return dot + ext if dot else ""


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether `entry` is a directory, following links; a link that cannot resolve is not."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def folder_source(root: Path, exts: frozenset[str] = IMAGE_EXTS) -> Source:
    """The files of `exts` (images; `sources.videos.VIDEO_EXTS` for videos) under `root`: in class
    folders (labels by sorted name), or flat (label -1)."""
    children = sorted(os.scandir(root), key=_name)
    class_dirs = [e for e in children if not e.name.startswith(".") and _is_dir(e)]
    entries: list[Entry] = []
    seen: set[tuple[int, int]] = set()
    if not class_dirs:
        for found in _walk(str(root), seen, exts):
            entries.append(found if isinstance(found, Skip) else Item(found, -1, path=found))
        return Source(f"flat folder {root}", [], iter(entries), count_items(entries))
    seen.add((os.stat(root).st_dev, os.stat(root).st_ino))
    for e in children:
        if e.name.startswith("."):
            entries.append(Skip(e.path, "hidden file or folder (dotfile)", fatal=False))
        elif not _is_dir(e):
            entries.append(Skip(e.path, "not inside a class folder (ImageFolder layout)", fatal=False))
    classes = [d.name for d in class_dirs]
    for label, d in enumerate(class_dirs):
        for found in _walk(d.path, seen, exts):
            entries.append(found if isinstance(found, Skip) else Item(found, label, path=found))
    return Source(f"image folder {root} ({len(classes)} classes)", classes, iter(entries), count_items(entries))
