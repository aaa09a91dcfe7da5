"""WebDataset-style tar shards as a source: members grouped by key (the name up to the first dot of the
basename), the image from a `jpg`/`jpeg`/`png`/`webp` member, the label from `cls`, fields from
`.json`, `.txt` and `.npy`. Read as a stream, never past a member's or the shard's end."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from gpufeed.sources.cells import tar_fields
from gpufeed.sources.entries import MAX_FILE_BYTES, Entry, Item, Skip, Source, is_int

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
TAR_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


@dataclass(frozen=True)
class Wanted:
    """What a tar sample is read for: the members it is made of (`exts`, in order of preference), the
    most bytes of one, and what to call it."""

    exts: tuple[str, ...]
    max_bytes: int
    what: str = "image"


def _images() -> Wanted:
    return Wanted(TAR_IMAGE_EXTS, MAX_FILE_BYTES)


def tar_source(text: str, shards: list[str], videos: Wanted | None = None) -> Source:
    """WebDataset shards' samples: each one's image member (or, with `videos`, the kind of member it
    names, e.g. `sources.videos.TAR_VIDEOS`), with its .cls label and .json/.txt/.npy fields."""
    entries = _tar_entries(shards, videos or _images())
    return Source(f"{len(shards)} tar shard(s) {text}", [], entries, None, kind="tar")


def _tar_entries(shards: list[str], wanted: Wanted) -> Iterator[Entry]:
    for shard in shards:
        try:
            size = os.path.getsize(shard)
            with tarfile.open(shard, mode="r|*") as tar:
                yield from _tar_samples(shard, tar, size, wanted)
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
    """A tar sample's label from its .cls member (-1 without one); ValueError if it is no integer, or
    one no store holds (below -1, past int64)."""
    if cls is None:
        return -1
    text = cls.decode("utf-8", "replace").strip()
    if not is_int(text):
        raise ValueError(f"label {text!r} in .cls is not an integer")
    if not -1 <= int(text) < 1 << 63:
        raise ValueError(f"label {text} in .cls is not a class index (0 and up, -1 for none)")
    return int(text)


def _tar_samples(shard: str, tar: tarfile.TarFile, size: int | None, kinds: Wanted | None = None) -> Iterator[Entry]:
    """Group consecutive members by WebDataset key (name up to the first dot of the basename). A member
    whose data the shard does not hold ends the shard there: the sample before it is kept (its members
    all came before), the member is skipped with the reason, and nothing is read past the file's end
    (`size`: the shard file's bytes, which bound an uncompressed shard's members)."""
    kinds = kinds or _images()
    end = size if getattr(tar.fileobj, "comptype", None) == "tar" else None
    key: str | None = None
    parts: dict[str, bytes] = {}
    for member in tar:
        named = None if member.isdir() else tar_key(member.name)
        wanted = named is not None and member.isfile() and member.size <= kinds.max_bytes
        data, cut = _member_data(tar, member, end, wanted)
        if cut is not None:
            if key is not None and (named is None or named[0] != key):
                yield _tar_sample(shard, key, parts, kinds)
            yield Skip(f"{shard}:{member.name}", cut)
            return
        if named is None:
            continue
        if not member.isfile():  # links, devices, FIFOs: nothing a sample is read from
            yield Skip(f"{shard}:{member.name}", "not a regular file in the tar (a link, device or FIFO)")
            continue
        if member.size > kinds.max_bytes:
            yield Skip(
                f"{shard}:{member.name}",
                f"{member.size} bytes, more than any {kinds.what} gpufeed packs ({kinds.max_bytes})",
            )
            continue
        member_key, ext = named
        if member_key != key and key is not None:
            yield _tar_sample(shard, key, parts, kinds)
            parts = {}
        key = member_key
        parts[ext] = data  # type: ignore[assignment]  # bytes: a wanted regular file, read whole (else `cut`)
    if key is not None:
        yield _tar_sample(shard, key, parts, kinds)


def _member_data(
    tar: tarfile.TarFile, member: tarfile.TarInfo, end: int | None, wanted: bool
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
        # in pieces: tarfile's read() of a member holds three copies of it (f: a regular file, or of a
        # type tarfile reads as one)
        while piece := f.read(1 << 20):  # type: ignore[union-attr]
            if wanted:
                kept.write(piece)
        return (kept.getvalue() if wanted else None), None
    except (OSError, tarfile.TarError, EOFError) as e:
        return None, f"{lost}, past the end of the shard or through damaged data ({e})"


def _tar_sample(shard: str, key: str, parts: dict[str, bytes], kinds: Wanted) -> Entry:
    name = f"{shard}:{key}"
    image = next((parts[e] for e in kinds.exts if e in parts), None)
    if image is None:
        return Skip(name, f"no {kinds.what} member ({'/'.join(kinds.exts)})")
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
