"""Resolution schedules: the output size as a function of the epoch, as FFCV's ImageNet recipe trains
at low resolution first and ends at high resolution (progressive resizing).

A schedule is any callable epoch -> size (an int side or (h, w)); `Loader(resolution=...)` plans each
epoch with its augment chain at that size (`Augment.at_size`). The size is a pure function of the
epoch, so a resumed job (`load_state_dict`, at any world size) gets the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResolutionRamp:
    """`low` up to epoch `start`, then rising linearly to `high` at epoch `end`, and `high` after;
    each size rounded to a multiple of `multiple` (FFCV's recipe: 160 to 192 over its last epochs,
    multiples of 32)."""

    low: int
    high: int
    start: int
    end: int
    multiple: int = 32

    def __post_init__(self):
        numbers = (self.low, self.high, self.start, self.end, self.multiple)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers):
            raise TypeError(f"ResolutionRamp takes ints, got {self}")
        if not (min(self.low, self.high, self.multiple) > 0 and 0 <= self.start <= self.end):
            raise ValueError(f"ResolutionRamp needs 0 < low, 0 < high, 0 <= start <= end and multiple > 0, got {self}")

    def __call__(self, epoch: int) -> int:
        if epoch <= self.start or self.end == self.start:
            side = float(self.low if epoch <= self.start else self.high)
        else:
            side = self.low + (self.high - self.low) * min(1.0, (epoch - self.start) / (self.end - self.start))
        return max(self.multiple, round(side / self.multiple) * self.multiple)
