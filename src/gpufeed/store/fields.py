"""Reading a store's per-sample fields: memory maps checked at open, values for one sample or a batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.store import format as fmt
from gpufeed.store.format import StoreError


class FieldColumn:
    """One field of every sample: fixed-size kinds as one (N, *shape) memory map, variable-length ones
    as bytes plus offsets (checked in order and inside the data at open)."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        mapped: Callable[[str, tuple[int, ...]], np.ndarray],
        directory: Path,
        count: int,
        data_bytes: int,
    ):
        self.name, self.spec, self.kind = name, spec, spec["kind"]
        files = fmt.field_files(name, spec)
        self.path = directory / files[0]
        if self.kind in fmt.VARIABLE_KINDS:
            self.data = mapped(files[0], (data_bytes,))
            self.offsets = mapped(files[1], (count + 1,))
            ends = self.offsets
            bad = (np.diff(ends, prepend=0) < 0) | (ends > data_bytes)
            if self.kind == "boxes":
                bad |= ends % 16 != 0  # whole rows of four float32
            elif self.kind == "keypoints":
                bad |= ends % (12 * spec["points"]) != 0  # whole instances of points of three float32
            elif self.kind == "masks":
                bad |= ends % 4 != 0  # int32 words
            if bad.any():
                raise StoreError(
                    f"{directory / files[1]}: entry {int(np.argmax(bad))} is out of order, past the "
                    f"end of {files[0]} or not a whole row (damaged store)"
                )
        else:
            self.values = mapped(files[0], (count, *fmt.field_shape(spec)))

    @property
    def fixed(self) -> bool:
        return self.kind not in fmt.VARIABLE_KINDS

    def value(self, i: int) -> Any:
        """Sample i's value: a number, a numpy array (a copy; boxes: (k, 4) float32; keypoints: (k,
        points, 3) float32; masks: a label map (h, w) or instance masks (k, h, w) uint8), str, bytes,
        or the parsed JSON (None for a sample that had no value).

        Raises:
            StoreError: a text or JSON value that is not UTF-8 or not JSON (its bytes were damaged
                after packing; open does not hash them): the message names the file, field and sample.
        """
        if self.fixed:
            v = self.values[i]
            return np.array(v) if self.kind == "array" else v.item()
        raw = bytes(self.data[int(self.offsets[i]) : int(self.offsets[i + 1])])
        if self.kind == "boxes":
            return np.frombuffer(raw, dtype="<f4").reshape(-1, 4).copy()
        if self.kind == "keypoints":
            return np.frombuffer(raw, dtype="<f4").reshape(-1, self.spec["points"], 3).copy()
        if self.kind == "masks":
            runs = self.runs(i)
            if runs is None:
                return None
            planes = runs.decode().astype(self.spec["dtype"])
            return planes if self.spec["instances"] else planes[0]
        if self.kind == "bytes":
            return raw
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._damaged(i, f"not UTF-8 text ({e})") from None
        if self.kind == "str":
            return text
        if not raw:  # json: a sample that had no value
            return None
        try:
            return json.loads(text)
        except RecursionError:
            raise self._damaged(i, "not JSON (nested too deeply)") from None
        except ValueError as e:
            raise self._damaged(i, f"not JSON ({e})") from None

    def runs(self, i: int) -> fmt.MaskRuns | None:
        """A masks field's sample i as stored (None: the sample had none), checked (StoreError)."""
        raw = bytes(self.data[int(self.offsets[i]) : int(self.offsets[i + 1])])
        return fmt.parse_masks(raw, f"{self.path}: field {self.name!r} of sample {i}") if raw else None

    def _damaged(self, i: int, why: str) -> StoreError:
        return StoreError(
            f"{self.path}: field {self.name!r} of sample {i}: {why} (damaged store; gpufeed "
            "verify names the damaged files)"
        )

    def rows(self, indices: np.ndarray) -> np.ndarray | list:
        """The values of `indices`: one array (N, *shape) for fixed-size kinds, else a list."""
        if self.fixed:
            return self.values[indices]
        return [self.value(int(i)) for i in indices]
