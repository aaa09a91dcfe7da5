"""Values in a source besides its images: a CSV column's cells typed over all its rows, lists of numbers
as arrays, a tar sample's `.json`, `.txt` and `.npy` members. Packing stores them as fields."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

# the cells pandas reads as missing (its default na_values): a number column's gaps, stored as NaN
MISSING = frozenset(
    [
        "",
        "#N/A",
        "#N/A N/A",
        "#NA",
        "-1.#IND",
        "-1.#QNAN",
        "-NaN",
        "-nan",
        "1.#IND",
        "1.#QNAN",
        "<NA>",
        "N/A",
        "NA",
        "NULL",
        "NaN",
        "None",
        "n/a",
        "nan",
        "null",
    ]
)


def csv_column(cells: list[str]) -> list[Any]:
    """A CSV column's values, its kind decided over all its cells as pandas does: numbers when every
    cell present parses as one (ints while all are, floats otherwise; a missing cell, blank, "NA",
    "N/A", "null"..., is NaN and makes the column float), arrays when every cell is a JSON list of
    numbers of one shape (`array_column`), else the text of every cell as it is."""
    present = [c for c in cells if c not in MISSING]
    if present:
        for kind in (int, float):
            try:
                parsed = [kind(c) for c in present]
            except ValueError:
                continue
            if len(present) == len(cells):
                return parsed
            return [float("nan") if c in MISSING else float(c) for c in cells]
    if cells and all(c.startswith("[") for c in cells):
        try:
            arrays = array_column([json.loads(c) for c in cells])
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes: text
            arrays = None
        if arrays is not None:
            return arrays
    return cells


def array_column(values: list[Any]) -> list[np.ndarray] | None:
    """`values` as arrays of one dtype (bool, int64 or float64, the widest any needs) when every one
    is a (nested) list of numbers of one non-empty shape: embeddings and multi-hot labels in a JSONL
    or CSV list become an array field, as a `.npy` member or a dataset's array does; else None."""
    if not values or not all(isinstance(v, list) for v in values):
        return None
    arrays: list[np.ndarray] = []
    for v in values:
        try:
            a = np.array(v)
        except (ValueError, OverflowError):  # ragged, or an int past int64
            return None
        if a.dtype.kind not in "biuf" or a.size == 0 or (arrays and a.shape != arrays[0].shape):
            return None
        arrays.append(a)
    dtype = np.result_type(*(a.dtype for a in arrays))
    dtype = np.dtype(bool) if dtype.kind == "b" else np.dtype("<i8") if dtype.kind in "iu" else np.dtype("<f8")
    return [a.astype(dtype) for a in arrays]


def tar_fields(parts: dict[str, bytes]) -> dict[str, Any]:
    """The fields of a tar sample's members: `.json` parsed, `.txt` as text, `.npy` as an array;
    ValueError for a member that is none of these (the sample is skipped with it)."""
    out: dict[str, Any] = {}
    if "json" in parts:
        try:
            out["json"] = json.loads(parts["json"].decode("utf-8"))
        except RecursionError:
            raise ValueError("a .json member nested too deeply") from None
    if "txt" in parts:
        out["txt"] = parts["txt"].decode("utf-8")
    if "npy" in parts:
        out["npy"] = np.load(io.BytesIO(parts["npy"]), allow_pickle=False)
    return out
