"""A CSV (`path,label,...`) or JSONL (`{"path": ..., "label": ...}`) list of images as a source; labels
may be integers or class names (not both: an error naming the rows), and further columns or keys are
the samples' fields. A row without a label (a JSONL row without "label", a CSV row of one cell) or
labelled -1 is unlabelled (-1); one whose label is there but missing (a blank cell, "NA", "N/A" and
the other cells pandas reads as missing, JSON null) is skipped with the reason, as is an integer
label no store holds (below -1, past int64)."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from gpufeed.sources.cells import MISSING, array_column, csv_column
from gpufeed.sources.entries import Entry, Item, Skip, Source, SourceError, count_items, is_int

INT64_MAX = (1 << 63) - 1


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
                yield from _jsonl_rows(path, f)
            else:
                yield from _csv_rows(path, f)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e})") from None


def _jsonl_rows(where: object, f) -> Iterator[tuple[int, object, object, dict | None]]:
    """As `_list_rows`, of a JSONL list (`where` names it); SourceError naming the line for one nested
    deeper than the JSON parser goes (a whole list is refused, as a COCO file or manifest is)."""
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            extra = {k: v for k, v in row.items() if k not in ("path", "label")}
            yield n, row["path"], row.get("label", -1), extra or None
        except RecursionError:
            raise SourceError(f"{where}: line {n}: not JSON (nested too deeply)") from None
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


def missing_label(label: object) -> bool:
    """Whether a row's label is there but missing: JSON null, or a blank or "NA"-like cell (`cells.MISSING`)."""
    return label is None or (isinstance(label, str) and label.strip() in MISSING)


def _lines(rows: list[tuple[int, object]]) -> str:
    shown = ", ".join(str(n) for n, _ in rows[:5])
    return f"line{'s' if len(rows) > 1 else ''} {shown}" + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")


def list_labels(
    rows: list[tuple[int, object, object, dict | None]], where: object
) -> tuple[list[str], Callable[[int, object], int]]:
    """A list's classes, and a row's label (given its number and label) as an int: integers as they
    are (no classes), else class names, numbered in sorted order; -1 is unlabelled in either. The
    label's ValueError says why a row is skipped (a missing label, an integer no store holds).
    SourceError naming the rows where labels mix integers and class names (which numbers would the
    integers be?)."""
    present = [(n, lab) for n, p, lab, _ in rows if p and not missing_label(lab)]
    numbers = [(n, lab) for n, lab in present if is_int(lab) and int(str(lab)) != -1]
    names = [(n, lab) for n, lab in present if not is_int(lab)]
    if numbers and names:
        raise SourceError(
            f"{where}: labels mix numbers ({_lines(numbers)}) and class names ({_lines(names)}), such as "
            f"{numbers[0][1]!r} and {names[0][1]!r}: give every row a class name, or every row a class index"
        )
    classes = sorted({str(lab) for _, lab in names})
    index = {c: i for i, c in enumerate(classes)}

    def label_of(n: int, lab: object) -> int:
        if missing_label(lab):
            raise ValueError(f"no label (line {n} of the list: {lab!r})")
        if not is_int(lab):
            return index[str(lab)]
        number = int(str(lab))
        if not -1 <= number <= INT64_MAX:
            raise ValueError(f"label {number} is not a class index (0 and up, -1 for none; line {n} of the list)")
        return number

    return classes, label_of


def list_source(path: Path) -> Source:
    rows = list(_list_rows(path))
    _typed_columns([r for r in rows if r[1]], csv_text=path.suffix.lower() != ".jsonl")
    classes, label_of = list_labels(rows, path)
    entries: list[Entry] = []
    for n, p, lab, extra in rows:
        if not p:
            # the reason _list_rows gave (a row with an empty path: its label)
            entries.append(Skip(f"{path}:{n}", lab or "malformed row (need path,label)"))  # type: ignore[arg-type]
            continue
        full = str((path.parent / str(p)) if not os.path.isabs(str(p)) else Path(str(p)))
        try:
            entries.append(Item(full, label_of(n, lab), path=full, fields=extra))
        except ValueError as e:
            entries.append(Skip(full, str(e)))
    return Source(f"list {path}", classes, iter(entries), count_items(entries), kind="list")
