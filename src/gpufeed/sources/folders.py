"""An image folder as a source: an ImageFolder tree (labels follow the sorted class folder names) or a
flat folder (label -1), walked in sorted order, following links but never looping.

`walk_folder` lists it as plain paths and `Skip`s, one run a class folder, for a folder read in place
(`loader.folder`), which lists it at every open; `folder_source` makes the `Item`s pack reads."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from gpufeed.sources.entries import Entry, Item, Skip, Source, count_items

IMAGE_EXTS = frozenset(Image.registered_extensions())
IMAGE_WORDS, VIDEO_WORDS = "an image", "a video"  # what a file of other extensions is not, in its Skip
_name = operator.attrgetter("name")  # (a DirEntry's; sorting by it in C: a lambda cost a third more)


@dataclass
class Run:
    """The files under one class folder (or a flat folder's, or the root's own skips), in walk order:
    each an image's path, or a `Skip` saying why a file or folder was left out. A run walked by
    another process (`walk_folder`'s `apart`) also has the folders it walked, (device, inode) each,
    and may have its paths' looks (`headers.file_looks`)."""

    label: int
    found: list[str | Skip]
    dirs: list[tuple[int, int]] = field(default_factory=list)
    looks: np.ndarray | None = None

    def paths(self) -> list[str]:
        """Its images' paths, in order (what it found but the skips)."""
        return [f for f in self.found if type(f) is str]


def walk_run(directory: str, exts: frozenset[str], what: str) -> Run:
    """The run of one class folder walked on its own (no folder seen before it), with its folders."""
    seen: set[tuple[int, int]] = set()
    run = Run(-1, [])
    _walk(directory, seen, exts, run.found, what)
    run.dirs = list(seen)
    return run


@dataclass
class Walked:
    """A folder's classes (sorted folder names; none for a flat folder) and its files, a run a class."""

    classes: list[str]
    runs: list[Run]


def walk_folder(
    root: Path, exts: frozenset[str] = IMAGE_EXTS, apart: Callable[[list[str]], list[Run] | None] | None = None
) -> Walked:
    """The files of `exts` (images; `sources.videos.VIDEO_EXTS` for videos) under `root`: in class
    folders (labels by sorted name), or flat (label -1). `apart(class_folders)`: their runs walked
    elsewhere (by processes, for a large folder), or None to walk them here. A run walked apart is
    taken only where none of its folders was met before it in the walk's order (a link to another
    class's folder, or to the root); else that class is walked again here, so the walk is the same
    as one walked here in order."""
    what = IMAGE_WORDS if exts is IMAGE_EXTS else VIDEO_WORDS
    children = sorted(os.scandir(root), key=_name)
    class_dirs = [e for e in children if not e.name.startswith(".") and _is_dir(e)]
    seen: set[tuple[int, int]] = set()
    if not class_dirs:
        found: list[str | Skip] = []
        _walk(str(root), seen, exts, found, what)
        return Walked([], [Run(-1, found)])
    st = os.stat(root)
    seen.add((st.st_dev, st.st_ino))
    own: list[str | Skip] = []
    for e in children:
        if e.name.startswith("."):
            own.append(Skip(e.path, "hidden file or folder (dotfile)", fatal=False))
        elif not _is_dir(e):
            own.append(Skip(e.path, "not inside a class folder (ImageFolder layout)", fatal=False))
    runs = [Run(-1, own)]
    elsewhere = apart([d.path for d in class_dirs]) if apart is not None else None
    for label, d in enumerate(class_dirs):
        run = elsewhere[label] if elsewhere is not None else None
        if run is not None and seen.isdisjoint(run.dirs):
            seen.update(run.dirs)
            run.label = label
        else:
            run = Run(label, [])
            _walk(d.path, seen, exts, run.found, what)
        runs.append(run)
    return Walked([d.name for d in class_dirs], runs)


def folder_source(root: Path, exts: frozenset[str] = IMAGE_EXTS) -> Source:
    """`walk_folder(root, exts)` as a source's entries."""
    walked = walk_folder(root, exts)
    entries: list[Entry] = [
        f if isinstance(f, Skip) else Item(f, run.label, path=f) for run in walked.runs for f in run.found
    ]
    what = f"image folder {root} ({len(walked.classes)} classes)" if walked.classes else f"flat folder {root}"
    return Source(what, walked.classes, iter(entries), count_items(entries))


def _walk(directory: str, seen: set[tuple[int, int]], exts: frozenset[str], out: list[str | Skip], what: str) -> None:
    """Append the files of `exts` under `directory` to `out` (and a `Skip` for anything else: not `what`
    file), sorted, following symlinks but never looping. One loop appending to one list: a folder read in place is
    listed at every open, and a generator a level (and an object a file) took twice the time."""
    try:
        st = os.stat(directory)
        entries = sorted(os.scandir(directory), key=_name)
    except OSError as e:
        out.append(Skip(directory, f"unreadable directory: {e.strerror or e}"))
        return
    if (st.st_dev, st.st_ino) in seen:
        out.append(Skip(directory, "symlink loop: directory already visited"))
        return
    seen.add((st.st_dev, st.st_ino))
    for entry in entries:
        name = entry.name
        if name.startswith("."):
            out.append(Skip(entry.path, "hidden file or folder (dotfile)", fatal=False))
            continue
        if _is_dir(entry):
            _walk(entry.path, seen, exts, out, what)
            continue
        _, dot, ext = name.rpartition(".")  # (os.path.splitext takes three times as long)
        ext = dot + ext if dot else ""
        if ext.lower() in exts:
            out.append(entry.path)  # a broken or looping link fails when read, with the reason
        else:
            out.append(Skip(entry.path, f"not {what} file (extension {ext or 'none'!r})", fatal=False))


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether `entry` is a directory, following links; a link that cannot resolve is not."""
    try:
        return entry.is_dir()
    except OSError:
        return False
