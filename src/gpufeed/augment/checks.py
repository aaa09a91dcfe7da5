"""Checks of the ops' parameters, run by their constructors: a bad value fails when the op is made,
with torchvision's wording where it has one, not at the first batch inside a kernel (or silently, as
inf, NaN or empty batches). Each returns the value in the form the op uses; `op` names the op in the
message. ValueError for a bad value, TypeError for a wrong type."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard

MAX_SIDE = 2**15
MAX_PIXELS = 2**28  # 16384²: an image's 3 channels stay within the kernels' int32 offsets


def _is_seq(value: object) -> TypeGuard[Sequence[Any]]:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def number(value: object, op: str, name: str) -> float:
    """A finite real number (a 0-d tensor or numpy scalar too)."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        out = float(value)  # type: ignore[arg-type]  # any object: float() decides, its TypeError is caught
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{op}: {name} should be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise ValueError(f"{op}: {name} should be finite, got {value!r}")
    return out


def integer(value: object, op: str, name: str, low: int | None = None, what: str = "") -> int:
    """An int (not a bool) of at least `low`; `what` words the bound in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} should be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{op}: {name} should be {what or f'at least {low}'}, got {value!r}")
    return int(value)


def probability(value: object, op: str, name: str = "p") -> float:
    """torchvision's _RandomApplyTransform check."""
    try:
        out = number(value, op, f"`{name}`")
    except ValueError:  # inf or NaN: outside the interval
        out = math.nan
    if not 0.0 <= out <= 1.0:
        raise ValueError(f"{op}: `{name}` should be a floating point value in the interval [0.0, 1.0], got {value!r}")
    return out


def size(value: object, op: str, name: str = "size", one_int: bool = False) -> int | tuple[int, int]:
    """torchvision's sizes: an int, or a sequence of 1 or 2 ints ((h, w)); one value in a sequence is
    (n, n), or with `one_int` the int n (Resize: the shorter side). At most MAX_SIDE a side and
    MAX_PIXELS an image: larger asks for a batch no GPU holds."""
    if _is_seq(value):
        if len(value) not in (1, 2):
            raise ValueError(f"{op}: Please provide only two dimensions (h, w) for {name}, got {value!r}")
        sides = [_side(v, op, name, value) for v in value]
        out = sides[0] if one_int and len(sides) == 1 else (sides[0], sides[-1])
    else:
        out = _side(value, op, name, value)
    h, w = (out, out) if isinstance(out, int) else out
    if max(h, w) > MAX_SIDE or h * w > MAX_PIXELS:
        raise ValueError(
            f"{op}: {name} {h}x{w} is over the bound of {MAX_SIDE} pixels a side and {MAX_PIXELS} pixels an image"
        )
    return out


def _side(v: object, op: str, name: str, whole: object) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{op}: {name} should be an int or a sequence of 1 or 2 ints, got {whole!r}")
    if v <= 0:
        raise ValueError(f"{op}: {name} values should be positive, got {whole!r}")
    return int(v)


def interval(
    value: object,
    op: str,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    open_low: bool = False,
    bounds: str = "",
) -> tuple[float, float]:
    """A (min, max) pair of finite numbers within low..high (above low with `open_low`); `bounds`
    words the range in the message."""
    if not _is_seq(value) or len(value) != 2:
        raise TypeError(f"{op}: {name} should be a sequence of two floats, got {value!r}")
    lo, hi = (number(v, op, name) for v in value)
    if lo > hi:
        raise ValueError(f"{op}: {name} should be of kind (min, max), got {value!r}")
    if lo < low or (open_low and lo <= low) or hi > high:
        raise ValueError(f"{op}: {bounds or name + ' values are out of range'}, got {value!r}")
    return lo, hi


def sequence(value: object, op: str, name: str, lengths: tuple[int, ...]) -> list:
    """torchvision's _check_sequence_input."""
    wanted = " or ".join(str(n) for n in lengths)
    if not _is_seq(value):
        raise TypeError(f"{op}: {name} should be a sequence of length {wanted}, got {value!r}")
    if len(value) not in lengths:
        raise ValueError(f"{op}: {name} should be a sequence of length {wanted}, got {value!r}")
    return list(value)


def angles(value: object, op: str, name: str, lengths: tuple[int, ...] = (2,)) -> list[tuple[float, float]]:
    """torchvision's _setup_angle: x is (-x, x); else (min, max) pairs, one per axis."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = number(value, op, name)
        if x < 0:
            raise ValueError(f"{op}: If {name} is a single number, it must be positive, got {value!r}")
        return [(-x, x)]
    flat = sequence(value, op, name, lengths)
    return [interval(flat[k : k + 2], op, name) for k in range(0, len(flat), 2)]


def channels(value: object, op: str, name: str) -> tuple[float, float, float]:
    """One value or one per channel (RGB), as three floats."""
    if isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0:
        values = [number(value, op, name)]
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        values = [number(v, op, name) for v in value]
    else:
        raise TypeError(f"{op}: {name} should be a number or a sequence of numbers, got {value!r}")
    if len(values) not in (1, 3):
        raise ValueError(f"{op}: {name} should be one value or one per channel (3), got {len(values)}: {value!r}")
    r, g, b = values * 3 if len(values) == 1 else values
    return r, g, b


def fill(value: object, op: str, name: str = "fill") -> object:
    """None, a number, or one number per channel (torchvision's types, without the dicts)."""
    if value is None:
        return None
    if not isinstance(value, (numbers.Number, tuple, list)):
        raise TypeError(
            f"{op}: Got inappropriate {name} arg, only Numbers, tuples and lists are allowed, got {value!r}"
        )
    channels(value, op, name)
    return value


def jitter(
    value: object,
    op: str,
    name: str,
    center: float = 1.0,
    bound: tuple[float, float] = (0, math.inf),
    clip_first_on_zero: bool = True,
) -> tuple[float, float] | None:
    """torchvision's ColorJitter._check_input: x is (center - x, center + x); None: no change."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = number(value, op, name)
        if x < 0:
            raise ValueError(f"{op}: If {name} is a single number, it must be non negative, got {value!r}")
        pair = [center - x, center + x]
        if clip_first_on_zero:
            pair[0] = max(pair[0], 0.0)
    elif _is_seq(value) and len(value) == 2:
        pair = [number(v, op, name) for v in value]
    else:
        raise TypeError(f"{op}: {name}={value!r} should be a single number or a sequence with length 2.")
    if not bound[0] <= pair[0] <= pair[1] <= bound[1]:
        raise ValueError(f"{op}: {name} values should be between {bound} and increasing, but got {pair}.")
    return None if pair[0] == pair[1] == center else (pair[0], pair[1])


def number_or_pair(value: object, op: str, name: str) -> tuple[float, float]:
    """torchvision's _setup_number_or_seq: x is (x, x), (x,) too."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = [value]
    if not _is_seq(value):
        raise TypeError(f"{op}: {name} should be a number or a sequence of numbers, got {value!r}")
    if len(value) not in (1, 2):
        raise ValueError(f"{op}: If {name} is a sequence its length should be 1 or 2, got {value!r}")
    values = [number(v, op, name) for v in value]
    return values[0], values[-1]


def kernel(value: object, op: str) -> tuple[int, int]:
    """GaussianBlur's kernel_size: odd positive ints, one or (x, y)."""
    given = list(value) if _is_seq(value) else [value]
    if len(given) not in (1, 2):
        raise ValueError(f"{op}: Kernel size should be a tuple/list of two integers, got {value!r}")
    ks = [integer(k, op, "kernel_size") for k in given]
    if any(k <= 0 or k % 2 == 0 for k in ks):
        raise ValueError(f"{op}: Kernel size value should be an odd and positive number, got {value!r}")
    return ks[0], ks[-1]
