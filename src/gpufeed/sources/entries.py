"""What a source yields: `Item`s (an image, read from `path` or carried in `data`, with its label and
other fields) and `Skip`s (something left out, and why), in a deterministic order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

# the largest file or tar member pack reads: above the images datasets hold, and a bound on what one
# bad path or tar member can make a process hold (the sizes a header declares are checked against
# max_pixels before decoding)
MAX_FILE_BYTES = 256 << 20


class SourceError(Exception):
    """The source as a whole cannot be read; the message names it and says why."""


@dataclass
class Item:
    name: str  # a path, or shard:key for tar members; what reports show
    label: int
    path: str | None = None
    data: bytes | None = None
    fields: dict | None = None  # per-sample fields (see packing.fields); stays in the packing process
    # the (h, w) the source declares for the image (a COCO "images" entry's), the frame of its fields:
    # packing skips an image whose file's upright size is another, before its fields are read
    hw: tuple[int, int] | None = None

    def __getstate__(self) -> dict:
        """What a worker gets: not the fields, which only the packing process writes."""
        return {**self.__dict__, "fields": None}


@dataclass
class Skip:
    name: str
    reason: str
    fatal: bool = True  # False for things that are simply not images (dotfiles, .txt)


Entry = Item | Skip


@dataclass
class Source:
    description: str
    classes: list[str]
    entries: Iterator[Entry]
    total: int | None = None  # known up front for folders and lists, not for tar streams
    kind: str = field(default="folder")
    # a COCO file's categories, id -> name: its samples' per-instance "category" ids (gaps kept), which
    # the store records (`Store.categories`); `classes` holds the names in id order
    categories: dict[int, str] = field(default_factory=dict)


def count_items(entries: list[Entry]) -> int:
    return sum(isinstance(e, Item) for e in entries)


def is_int(value: object) -> bool:
    try:
        int(str(value))
        return True
    except ValueError:
        return False
