"""Enumerate what to pack from a folder, a CSV/JSONL list or WebDataset-style tar shards.

A source yields `Item`s (an image to pack, read by a worker from `path` or carried in
`data`) and `Skip`s (something left out, with the reason) in a deterministic order.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Union

from PIL import Image

from gpufeed.packing.fields import array_column, csv_column, tar_fields

IMAGE_EXTS = frozenset(Image.registered_extensions())
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
TAR_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class SourceError(Exception):
    """The source as a whole cannot be read; the message names it and says why."""


@dataclass
class Item:
    name: str  # a path, or shard:key for tar members; what reports show
    label: int
    path: str | None = None
    data: bytes | None = None
    fields: dict | None = None  # per-sample fields (see packing.fields); stays in the packing process

    def __getstate__(self) -> dict:
        """What a worker gets: not the fields, which only the packing process writes."""
        return {**self.__dict__, "fields": None}


@dataclass
class Skip:
    name: str
    reason: str
    fatal: bool = True  # False for things that are simply not images (dotfiles, .txt)


Entry = Union[Item, Skip]


@dataclass
class Source:
    description: str
    classes: list[str]
    entries: Iterator[Entry]
    total: int | None = None  # known up front for folders and lists, not for tar streams
    kind: str = field(default="folder")


def open_source(source: str | os.PathLike) -> Source:
    """Recognise `source` and return its entries; raises SourceError if it cannot be used."""
    text = os.fspath(source)
    if glob.has_magic(text):
        shards = sorted(glob.glob(text))
        if not shards:
            raise SourceError(f"{text}: no file matches this pattern")
        return _tar_source(text, shards)
    path = Path(text)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    if path.is_dir():
        return _folder_source(path)
    lower = path.name.lower()
    if lower.endswith(TAR_SUFFIXES):
        return _tar_source(text, [text])
    if lower.endswith((".csv", ".jsonl")):
        return _list_source(path)
    raise SourceError(f"{path}: not a folder, .csv/.jsonl list or .tar/.tar.gz/.tgz shard")


def _walk(directory: str, seen: set[tuple[int, int]]) -> Iterator[str | Skip]:
    """Image files under `directory`, sorted, following symlinks but never looping."""
    try:
        st = os.stat(directory)
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        yield Skip(directory, f"unreadable directory: {e.strerror or e}")
        return
    if (st.st_dev, st.st_ino) in seen:
        yield Skip(directory, "symlink loop: directory already visited")
        return
    seen.add((st.st_dev, st.st_ino))
    for e in entries:
        ext = os.path.splitext(e.name)[1]
        if e.name.startswith("."):
            yield Skip(e.path, "hidden file or folder (dotfile)", fatal=False)
        elif _is_dir(e):
            yield from _walk(e.path, seen)
        elif ext.lower() in IMAGE_EXTS:
            yield e.path  # a broken or looping link fails when read, with the reason
        else:
            yield Skip(e.path, f"not an image file (extension {ext or 'none'!r})", fatal=False)


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether `entry` is a directory, following links; a link that cannot resolve is not."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _folder_source(root: Path) -> Source:
    children = sorted(os.scandir(root), key=lambda e: e.name)
    class_dirs = [e for e in children if not e.name.startswith(".") and _is_dir(e)]
    entries: list[Entry] = []
    seen: set[tuple[int, int]] = set()
    if not class_dirs:
        for found in _walk(str(root), seen):
            entries.append(found if isinstance(found, Skip) else Item(found, -1, path=found))
        return Source(f"flat folder {root}", [], iter(entries), _count(entries))
    seen.add((os.stat(root).st_dev, os.stat(root).st_ino))
    for e in children:
        if e.name.startswith("."):
            entries.append(Skip(e.path, "hidden file or folder (dotfile)", fatal=False))
        elif not _is_dir(e):
            entries.append(Skip(e.path, "not inside a class folder (ImageFolder layout)", fatal=False))
    classes = [d.name for d in class_dirs]
    for label, d in enumerate(class_dirs):
        for found in _walk(d.path, seen):
            entries.append(found if isinstance(found, Skip) else Item(found, label, path=found))
    return Source(f"image folder {root} ({len(classes)} classes)", classes, iter(entries), _count(entries))


def _count(entries: list[Entry]) -> int:
    return sum(isinstance(e, Item) for e in entries)


def _list_rows(path: Path) -> Iterator[tuple[int, object, object, dict | None]]:
    """(row number, path, label, other fields) of each row of a CSV or JSONL list: a JSONL row's
    other keys, a CSV row's other columns (their text: `_list_source` types each column over all its
    rows) when a header (path,label,...) names them. A malformed row has no path, and the reason in
    place of the label. SourceError for a file that is not UTF-8 text or not CSV the csv module reads
    (a cell over its 128 KiB limit), naming the line, and for a header naming a column twice."""
    try:
        # utf-8-sig: the byte-order mark Excel writes is no part of the header
        with open(path, newline="", encoding="utf-8-sig") as f:
            if path.suffix.lower() == ".jsonl":
                yield from _jsonl_rows(f)
            else:
                yield from _csv_rows(path, f)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e})") from None


def _jsonl_rows(f) -> Iterator[tuple[int, object, object, dict | None]]:
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            extra = {k: v for k, v in row.items() if k not in ("path", "label")}
            yield n, row["path"], row.get("label", -1), extra or None
        except (ValueError, KeyError, TypeError, AttributeError):
            yield n, None, "malformed row (need path,label)", None


def _csv_rows(path: Path, f) -> Iterator[tuple[int, object, object, dict | None]]:
    names: list[str] = []
    reader = csv.reader(f)
    try:
        for n, row in enumerate(reader, 1):
            if n == 1 and [c.strip().lower() for c in row[:2]] == ["path", "label"]:
                names = [c.strip() for c in row[2:]]
                header = ["path", "label", *names]
                twice = next((c for k, c in enumerate(header) if c in header[:k]), None)
                if twice is not None:
                    raise SourceError(f"{path}: column {twice!r} is named twice in the header")
                continue
            if row:
                if names and len(row) - 2 != len(names):
                    yield n, None, f"{len(row)} cells, the header names {len(names) + 2}", None
                    continue
                extra = {k: v.strip() for k, v in zip(names, row[2:])}
                yield n, row[0].strip(), row[1].strip() if len(row) > 1 else -1, extra or None
    except csv.Error as e:
        raise SourceError(f"{path}: line {reader.line_num}: unreadable CSV ({e})") from None


def _typed_columns(rows: list[tuple[int, object, object, dict | None]], csv_text: bool) -> None:
    """Give each field of the listed samples its kind, decided over all of them (in place): a CSV
    column by `csv_column`; a JSONL key in every row whose values are lists of numbers of one shape
    becomes arrays (`array_column`). A first row's blank cell or a ragged list can't decide alone."""
    extras = [extra or {} for _, _, _, extra in rows]
    for name in dict.fromkeys(k for extra in extras for k in extra):
        if not all(name in extra for extra in extras):
            continue
        values = [extra[name] for extra in extras]
        typed = csv_column(values) if csv_text else array_column(values)
        for extra, value in zip(extras, typed or values):
            extra[name] = value


def _list_source(path: Path) -> Source:
    rows = list(_list_rows(path))
    _typed_columns([r for r in rows if r[1]], csv_text=path.suffix.lower() != ".jsonl")
    raw_labels = [lab for _, p, lab, _ in rows if p]
    numeric = all(_is_int(lab) for lab in raw_labels)
    classes = [] if numeric else sorted({str(lab) for lab in raw_labels})
    index = {c: i for i, c in enumerate(classes)}
    entries: list[Entry] = []
    for n, p, lab, extra in rows:
        if not p:
            entries.append(Skip(f"{path}:{n}", lab or "malformed row (need path,label)"))
            continue
        full = str((path.parent / str(p)) if not os.path.isabs(str(p)) else Path(str(p)))
        entries.append(Item(full, int(lab) if numeric else index[str(lab)], path=full, fields=extra))
    return Source(f"list {path}", classes, iter(entries), _count(entries), kind="list")


def _is_int(value: object) -> bool:
    try:
        int(str(value))
        return True
    except ValueError:
        return False


def _tar_source(text: str, shards: list[str]) -> Source:
    return Source(f"{len(shards)} tar shard(s) {text}", [], _tar_entries(shards), None, kind="tar")


# the largest file or tar member pack reads: above the images datasets hold, and a bound on what one
# bad path or tar member can make a process hold (the sizes a header declares are checked against
# max_pixels before decoding)
MAX_FILE_BYTES = 256 << 20


def _tar_entries(shards: list[str]) -> Iterator[Entry]:
    for shard in shards:
        try:
            with tarfile.open(shard, mode="r|*") as tar:
                yield from _tar_samples(shard, tar)
        except (OSError, tarfile.TarError, EOFError) as e:
            yield Skip(shard, f"unreadable tar shard (rest of shard lost): {e}")


def tar_key(name: str) -> tuple[str, str] | None:
    """(sample key, lower-case extension) of a tar member, WebDataset's way (the key runs to the first
    dot of the basename); None for hidden members."""
    directory, base = os.path.split(name)
    if base.startswith("."):
        return None
    stem, _, ext = base.partition(".")
    return os.path.join(directory, stem), ext.lower()


def tar_label(cls: bytes | None) -> int:
    """A tar sample's label from its .cls member (-1 without one); ValueError if it is no integer."""
    if cls is None:
        return -1
    text = cls.decode("utf-8", "replace").strip()
    if not _is_int(text):
        raise ValueError(f"label {text!r} in .cls is not an integer")
    return int(text)


def _tar_samples(shard: str, tar: tarfile.TarFile) -> Iterator[Entry]:
    """Group consecutive members by WebDataset key (name up to the first dot of the basename). A member
    whose data the shard does not hold ends the shard there: the sample before it is kept (its members
    all came before), the member is skipped with the reason, and nothing is read past the file's end."""
    end = os.path.getsize(shard) if getattr(tar.fileobj, "comptype", None) == "tar" else None
    key, parts = None, {}
    for member in tar:
        named = None if member.isdir() else tar_key(member.name)
        wanted = named is not None and member.isfile() and member.size <= MAX_FILE_BYTES
        data, cut = _member_data(tar, member, end, wanted)
        if cut is not None:
            if key is not None and (named is None or named[0] != key):
                yield _tar_sample(shard, key, parts)
            yield Skip(f"{shard}:{member.name}", cut)
            return
        if named is None:
            continue
        if not member.isfile():  # links, devices, FIFOs: nothing a sample is read from
            yield Skip(f"{shard}:{member.name}", "not a regular file in the tar (a link, device or FIFO)")
            continue
        if member.size > MAX_FILE_BYTES:
            yield Skip(f"{shard}:{member.name}", f"{member.size} bytes, more than any image gpufeed packs "
                                                 f"({MAX_FILE_BYTES})")
            continue
        member_key, ext = named
        if member_key != key and key is not None:
            yield _tar_sample(shard, key, parts)
            parts = {}
        key = member_key
        parts[ext] = data
    if key is not None:
        yield _tar_sample(shard, key, parts)


def _member_data(tar: tarfile.TarFile, member: tarfile.TarInfo, end: int | None, wanted: bool
                 ) -> tuple[bytes | None, str | None]:
    """(the member's bytes if `wanted`, else None; why the shard ends at this member, else None).

    A plain shard (`end`: its size in bytes) shows a member running past its end from the header
    alone. In a compressed one the data shows only by reading it, so a member not wanted is read
    through here in 1 MiB pieces: tarfile's own skip over it would go on reading empty blocks for
    the whole declared size (1 PiB: forever) and then lose the sample before it."""
    if not (member.isreg() or member.type not in tarfile.SUPPORTED_TYPES):  # links, dirs: no data
        return None, None
    lost = f"unreadable tar shard (rest of shard lost): {member.size} bytes declared"
    if end is not None and member.offset_data + member.size > end:
        return None, f"{lost}, past the end of the shard ({end} bytes: truncated or damaged)"
    if end is not None and not wanted:
        return None, None  # tarfile skips it within the file
    try:
        f, kept = tar.extractfile(member), io.BytesIO()
        while piece := f.read(1 << 20):  # in pieces: tarfile's read() of a member holds three copies of it
            if wanted:
                kept.write(piece)
        return (kept.getvalue() if wanted else None), None
    except (OSError, tarfile.TarError, EOFError) as e:
        return None, f"{lost}, past the end of the shard or through damaged data ({e})"


def _tar_sample(shard: str, key: str, parts: dict[str, bytes]) -> Entry:
    name = f"{shard}:{key}"
    image = next((parts[e] for e in TAR_IMAGE_EXTS if e in parts), None)
    if image is None:
        return Skip(name, f"no image member ({'/'.join(TAR_IMAGE_EXTS)})")
    label = -1
    try:
        label = tar_label(parts.get("cls"))
    except ValueError as e:
        return Skip(name, str(e))
    try:
        fields = tar_fields(parts)
    except (ValueError, OSError, EOFError) as e:  # bad JSON, text that is not UTF-8, a .npy numpy refuses
        return Skip(name, f"unreadable .json, .txt or .npy member: {e}")
    return Item(name, label, data=image, fields=fields or None)
