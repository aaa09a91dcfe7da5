"""Sources in a bucket (any fsspec URL): tar shards (one, or a glob) streamed as local ones are, and
CSV/JSONL lists whose paths are relative to the list or URLs of their own. Packing reads them in its
own process: a tar member's or a listed image's bytes travel to the workers with the item, fetched a
group at a time (`FETCH_GROUP`, which fsspec fetches at once)."""

from __future__ import annotations

import glob
import io
import os
import tarfile
from collections.abc import Iterator

from gpufeed.sources.entries import Entry, Item, Skip, Source, SourceError, count_items
from gpufeed.sources.lists import _csv_rows, _jsonl_rows, _typed_columns, list_labels
from gpufeed.sources.tars import TAR_SUFFIXES, _tar_samples
from gpufeed.store.locations import filesystem, is_url, shown

FETCH_GROUP = 64  # listed images fetched at once


def remote_source(url: str, storage_options: dict | None = None) -> Source:
    """The source at `url`: tar shards (`.tar`, `.tar.gz`, `.tgz`, or a glob of them) or a `.csv` /
    `.jsonl` list; SourceError naming the URL (without credentials) where it can't be used."""
    fs, path = filesystem(url, storage_options)
    protocol = url.split("://", 1)[0]
    where = shown(url)
    lower = path.lower()
    try:
        if glob.has_magic(path):
            shards = sorted(fs.glob(path))
            if not shards:
                raise SourceError(f"{where}: no object matches this pattern")
            return Source(f"{len(shards)} tar shard(s) {where}", [], _tar_entries(fs, protocol, shards), None, "tar")
        if lower.endswith(TAR_SUFFIXES):
            return Source(f"1 tar shard {where}", [], _tar_entries(fs, protocol, [path]), None, "tar")
        if lower.endswith((".csv", ".jsonl")):
            return _list(fs, protocol, path, where)
    except FileNotFoundError:
        raise SourceError(f"{where}: no such object") from None
    raise SourceError(f"{where}: not a .csv/.jsonl list or .tar/.tar.gz/.tgz shard (or a glob of shards)")


def _tar_entries(fs, protocol: str, shards: list[str]) -> Iterator[Entry]:
    for shard in shards:
        name = f"{protocol}://{shard}"
        try:
            size = fs.size(shard)
            with fs.open(shard, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tar:
                yield from _tar_samples(shown(name), tar, size)
        except (OSError, tarfile.TarError, EOFError) as e:
            yield Skip(shown(name), f"unreadable tar shard (rest of shard lost): {e}")


def _list(fs, protocol: str, path: str, where: str) -> Source:
    """A list in a bucket: its rows typed as a local list's; each path relative to the list's folder,
    or a URL, or an absolute path on this machine."""
    jsonl = path.lower().endswith(".jsonl")
    try:
        text = fs.cat_file(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SourceError(f"{where}: not UTF-8 text ({e})") from None
    f = io.StringIO(text, newline="")
    rows = list(_jsonl_rows(where, f) if jsonl else _csv_rows(where, f))  # type: ignore[arg-type]
    _typed_columns([r for r in rows if r[1]], csv_text=not jsonl)
    classes, label_of = list_labels(rows, where)
    folder = f"{protocol}://{path.rsplit('/', 1)[0]}" if "/" in path else f"{protocol}://"
    entries: list[Entry] = []
    urls: list[str | None] = []  # per entry, where its bytes are fetched from (None: nothing to fetch)
    for n, p, lab, extra in rows:
        if not p:
            entries.append(Skip(f"{where}:{n}", str(lab) or "malformed row (need path,label)"))
            urls.append(None)
            continue
        text_path = str(p)
        full = text_path if is_url(text_path) or os.path.isabs(text_path) else f"{folder}/{text_path}"
        try:
            label = label_of(n, lab)
        except ValueError as e:  # a missing label, an integer no store holds
            entries.append(Skip(shown(full), str(e)))
            urls.append(None)
            continue
        entries.append(Item(shown(full), label, path=None if is_url(full) else full, fields=extra))
        urls.append(full if is_url(full) else None)
    return Source(f"list {where}", classes, _fetched(fs, entries, urls), count_items(entries), "list")


def _fetched(fs, entries: list[Entry], urls: list[str | None]) -> Iterator[Entry]:
    """The entries in order, each listed image's bytes fetched with `FETCH_GROUP` - 1 others (a fetch
    that fails is the item's skip, with why)."""
    for start in range(0, len(entries), FETCH_GROUP):
        group = list(zip(entries[start : start + FETCH_GROUP], urls[start : start + FETCH_GROUP]))
        wanted = [fs._strip_protocol(u) for _, u in group if u is not None]
        got = fs.cat(wanted, on_error="return") if wanted else {}
        for entry, url in group:
            if url is None or not isinstance(entry, Item):
                yield entry
                continue
            data = got.get(fs._strip_protocol(url))
            if isinstance(data, bytes):
                entry.data = data
                yield entry
            else:
                yield Skip(entry.name, f"unreadable: {type(data).__name__ if data is not None else 'missing'}")
