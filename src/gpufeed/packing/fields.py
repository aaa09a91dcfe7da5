"""Per-sample fields while packing: what each source offers, and the writer of their data files.

Fields come from a CSV list's extra columns (numbers when a cell parses as one, else text), a
JSONL list's extra keys (JSON types as they are: lists and objects stay JSON), a tar sample's
`.json`, `.txt` and `.npy` members (under those names), and a dataset's dict keys besides its
image and label (numbers, strings, bytes, arrays and tensors, JSON values). A field's first value
fixes its kind (and an array's dtype and shape). Numbers and arrays must be in every sample from
the first one kept; text, bytes and JSON may be missing (stored empty: "", b"", null). A sample
that breaks this is skipped with the reason, like a bad image.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.packing.sinks import Appended, _write_array
from gpufeed.store import format as fmt
from gpufeed.store.writer import HashingWriter

INT64 = (-(1 << 63), (1 << 63) - 1)


def parse_cell(text: str) -> int | float | str:
    """A CSV cell as an int, else a float, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def tar_fields(parts: dict[str, bytes]) -> dict[str, Any]:
    """The fields of a tar sample's members: `.json` parsed, `.txt` as text, `.npy` as an array."""
    out: dict[str, Any] = {}
    if "json" in parts:
        out["json"] = json.loads(parts["json"].decode("utf-8"))
    if "txt" in parts:
        out["txt"] = parts["txt"].decode("utf-8")
    if "npy" in parts:
        out["npy"] = np.load(io.BytesIO(parts["npy"]), allow_pickle=False)
    return out


def classify(value: Any) -> tuple[str, Any]:
    """(kind, value to store): "number" (int or float, decided over all samples), "array", "str",
    "bytes" or "json"; ValueError for what no kind holds."""
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        value = int(value)
        if not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{value} does not fit in int64")
        return "number", value
    if isinstance(value, (float, np.floating)):
        return "number", float(value)
    if isinstance(value, str):
        return "str", value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        if dtype.str not in fmt.ARRAY_DTYPES:
            raise ValueError(f"an array of {value.dtype} (gpufeed stores bool, int, uint and float arrays)")
        if value.ndim > 8 or 0 in value.shape:
            raise ValueError(f"an array of shape {value.shape} (up to 8 dimensions, none empty)")
        return "array", np.ascontiguousarray(value, dtype=dtype)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a {type(value).__name__}, which is neither a number, string, bytes, array nor JSON "
                         f"({e})") from None
    return "json", value


class FieldsSink:
    """Checks each kept sample's fields against the first one's and writes them as they come (numbers
    are kept until the end, to choose int64 or float64)."""

    def __init__(self, work: Path):
        self.work = work
        self.kinds: dict[str, str] | None = None  # name -> kind, fixed by the first sample added
        self.arrays: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        self.numbers: dict[str, list] = {}
        self.writers: dict[str, Any] = {}
        self.count = 0

    def check(self, fields: dict[str, Any] | None) -> tuple[str | None, dict[str, tuple[str, Any]]]:
        """(the reason this sample cannot be added, or None; its classified values)."""
        fields = fields or {}
        bad = [n for n in fields if not fmt.valid_field_name(n)]
        if bad:
            return (f"field name {bad[0]!r} is not an identifier, or is one of {fmt.RESERVED}"), {}
        values = {}
        for name, value in fields.items():
            try:
                values[name] = classify(value)
            except ValueError as e:
                return f"field {name!r} is {e}", {}
        if self.kinds is None:
            return None, values
        missing = [n for n, kind in self.kinds.items() if n not in values and kind not in fmt.VARIABLE_KINDS]
        extra = [n for n, (kind, _) in values.items() if n not in self.kinds and kind not in fmt.VARIABLE_KINDS]
        if missing or extra:
            return ("its fields differ from the first sample's (numbers and arrays must be in every sample; text, "
                    "bytes and JSON may be missing): " + ", ".join(
                        [f"no {n!r}" for n in missing] + [f"an extra {n!r}" for n in extra])), {}
        for name, (kind, value) in values.items():
            known = self.kinds.get(name, kind)
            if kind != known:
                return f"field {name!r} is a {kind}, the first sample's is a {known}", {}
            if kind == "array" and (value.dtype, value.shape) != self.arrays[name]:
                dtype, shape = self.arrays[name]
                return (f"field {name!r} is a {value.dtype} array of shape {value.shape}, the first sample's is "
                        f"{dtype} of shape {shape}"), {}
        return None, values

    def add(self, values: dict[str, tuple[str, Any]]) -> None:
        """Append a checked sample's values (an empty value for a text, bytes or JSON field it lacks)."""
        if self.kinds is None:
            self.kinds = {}
        for name, (kind, value) in values.items():
            if name not in self.kinds:
                self._start(name, kind, value)
        for name, kind in self.kinds.items():
            if name not in values:
                self.writers[name].add(b"")
                continue
            value = values[name][1]
            if kind == "number":
                self.numbers[name].append(value)
            elif kind == "array":
                self.writers[name].write(value)
            else:
                data = value.encode("utf-8") if kind == "str" else (
                    json.dumps(value, allow_nan=False).encode("utf-8") if kind == "json" else value)
                self.writers[name].add(data)
        self.count += 1

    def _start(self, name: str, kind: str, value: Any) -> None:
        """A field's first value: its writer, with an empty value for each sample before (text, bytes
        and JSON only: `check` refuses numbers and arrays that start late)."""
        self.kinds[name] = kind
        files = fmt.field_files(name, {"kind": "str" if kind in fmt.VARIABLE_KINDS else "int"})
        if kind == "number":
            self.numbers[name] = []
        elif kind == "array":
            self.arrays[name] = (value.dtype, value.shape)
            self.writers[name] = HashingWriter(self.work / files[0])
        else:
            self.writers[name] = Appended(self.work, *files)
            for _ in range(self.count):
                self.writers[name].add(b"")

    def finish(self) -> tuple[dict[str, dict], dict[str, dict[str, Any]]]:
        """(manifest entries of the data files, the manifest's field specs)."""
        files, specs = {}, {}
        for name, kind in (self.kinds or {}).items():
            path = self.work / fmt.field_files(name, {"kind": "int"})[0]
            if kind == "number":
                values = self.numbers[name]
                whole = all(isinstance(v, int) for v in values)
                specs[name] = {"kind": "int" if whole else "float"}
                files[path.name] = _write_array(path, np.asarray(values, dtype="<i8" if whole else "<f8"))
            elif kind == "array":
                dtype, shape = self.arrays[name]
                specs[name] = {"kind": "array", "dtype": dtype.str, "shape": list(shape)}
                files[path.name] = self.writers[name].close()
            else:
                specs[name] = {"kind": kind}
                files |= self.writers[name].finish()
        return files, specs
