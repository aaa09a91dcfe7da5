"""Ops that turn, shear, scale or shift the image inside its frame, and the warp pass that samples
them.

RandomAffine and RandomRotation follow torchvision's parameters, draws and matrices (centre of
the image, angles in degrees, counter-clockwise for RandomRotation). Their matrices compose with
the crops, resizes, flips and policy ops around them into one matrix per sample, so a batch is
warped in one `grid_sample` call; where a point left the image of some op on the way, it gets the
fill, as torchvision's one pass per op would give it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as tf

from gpufeed.augment import checks
from gpufeed.augment.colour import constant
from gpufeed.augment.view import Resampling, View, fill_tuple


def inverse_affine(
    angle: torch.Tensor,
    tx: torch.Tensor,
    ty: torch.Tensor,
    scale: torch.Tensor,
    shear_x: torch.Tensor,
    shear_y: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
) -> torch.Tensor:
    """(N, 3, 3) float64 matrices from output to input coordinates, both measured from the image centre,
    of torchvision's affine: rotation by `angle`, scale, shears (degrees) about the centre offset
    (cx, cy), then the translation (tx, ty). Every argument is an (N,) float64 tensor."""
    rot, sx, sy = torch.deg2rad(angle), torch.deg2rad(shear_x), torch.deg2rad(shear_y)
    a = torch.cos(rot - sy) / torch.cos(sy)
    b = -(a * torch.tan(sx) + torch.sin(rot))
    c = torch.sin(rot - sy) / torch.cos(sy)
    d = torch.cos(rot) - c * torch.tan(sx)
    m = torch.zeros(len(angle), 3, 3, dtype=torch.float64)
    m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = d / scale, -b / scale, -c / scale, a / scale
    m[:, 0, 2] = cx - m[:, 0, 0] * (cx + tx) - m[:, 0, 1] * (cy + ty)
    m[:, 1, 2] = cy - m[:, 1, 0] * (cx + tx) - m[:, 1, 1] * (cy + ty)
    m[:, 2, 2] = 1
    return m


def from_centre(m: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The same map in the view's coordinates (origin at the top-left corner)."""
    shift = torch.eye(3, dtype=torch.float64)
    shift[0, 2], shift[1, 2] = width / 2, height / 2
    back = torch.eye(3, dtype=torch.float64)
    back[0, 2], back[1, 2] = -width / 2, -height / 2
    return shift @ m @ back


def interpolation_mode(interpolation: object) -> str:
    """torchvision's InterpolationMode or its name."""
    return str(getattr(interpolation, "value", interpolation))


class _Turn:
    """What RandomAffine and RandomRotation share: a per-sample angle drawn first, the centre, the
    warp settings. `_matrix` gives the op's inverse matrix from the angle (and its other draws)."""

    center: Sequence[float] | None
    interpolation: str
    fill: float | Sequence[float]
    _degrees: tuple[float, float]

    def _check(self, op: str) -> None:
        """What both take besides the angles: center (x, y), interpolation, fill."""
        if self.center is not None:
            for c in checks.sequence(self.center, op, "center", (2,)):
                checks.number(c, op, "center")
        Resampling(interpolation_mode(self.interpolation))
        checks.fill(self.fill, op)

    def __call__(self, view: View, g: torch.Generator) -> View:
        h, w = view.need_one_size()
        angle = _uniform(view.n, self._degrees, g)
        zero = torch.zeros(view.n, dtype=torch.float64)
        if self.center is None:
            cx = cy = zero
        else:
            cx, cy = zero + float(self.center[0]) - w / 2, zero + float(self.center[1]) - h / 2
        m = self._matrix(view, angle, cx, cy, g)
        resampling = Resampling(interpolation_mode(self.interpolation), fill_tuple(self.fill))
        return view.then(from_centre(m, h, w), h, w, resampling, fills=True)

    def _matrix(
        self, view: View, angle: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, g: torch.Generator
    ) -> torch.Tensor:
        raise NotImplementedError  # each op says


def _uniform(n: int, bounds: tuple[float, float], g: torch.Generator) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float64).uniform_(*bounds, generator=g)


@dataclass
class RandomAffine(_Turn):
    """Rotate by an angle in `degrees`, shift by up to `translate` (fractions of width, height), scale
    by a factor in `scale` and shear by angles in `shear` (x range, or x then y ranges), all drawn
    per sample, about the image centre or `center` (x, y); uncovered pixels get `fill` (0..255)."""

    degrees: float | Sequence[float]
    translate: Sequence[float] | None = None
    scale: Sequence[float] | None = None
    shear: float | Sequence[float] | None = None
    interpolation: str = "nearest"
    fill: float | Sequence[float] = 0
    center: Sequence[float] | None = None

    def __post_init__(self):
        op = "RandomAffine"
        self._degrees = checks.angles(self.degrees, op, "degrees")[0]
        self._shear = [] if self.shear is None else checks.angles(self.shear, op, "shear", (2, 4))  # x, then y
        if self.translate is not None:
            shift = [checks.number(t, op, "translate") for t in checks.sequence(self.translate, op, "translate", (2,))]
            if not all(0 <= t <= 1 for t in shift):
                raise ValueError(f"{op}: translation values should be between 0 and 1, got {self.translate!r}")
        if self.scale is not None:
            checks.interval(self.scale, op, "scale", low=0, open_low=True, bounds="scale values should be positive")
        self._check(op)

    def _matrix(
        self, view: View, angle: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, g: torch.Generator
    ) -> torch.Tensor:
        n, zero = view.n, torch.zeros(view.n, dtype=torch.float64)
        h, w = view.need_one_size()  # (one size: __call__ checked)
        tx = ty = zero
        if self.translate is not None:
            tx = torch.round(_uniform(n, (-self.translate[0] * w, self.translate[0] * w), g))
            ty = torch.round(_uniform(n, (-self.translate[1] * h, self.translate[1] * h), g))
        scale = _uniform(n, (self.scale[0], self.scale[1]), g) if self.scale is not None else zero + 1
        shears = [_uniform(n, r, g) for r in self._shear] + [zero, zero]
        return inverse_affine(angle, tx, ty, scale, shears[0], shears[1], cx, cy)


@dataclass
class RandomRotation(_Turn):
    """Rotate counter-clockwise by an angle drawn per sample in `degrees`, about the image centre or
    `center` (x, y), keeping the size; uncovered pixels get `fill` (0..255)."""

    degrees: float | Sequence[float]
    interpolation: str = "nearest"
    expand: bool = False
    center: Sequence[float] | None = None
    fill: float | Sequence[float] = 0

    def __post_init__(self):
        if self.expand:
            raise ValueError("RandomRotation(expand=True) is not supported: a batch keeps one size")
        self._degrees = checks.angles(self.degrees, "RandomRotation", "degrees")[0]
        self._check("RandomRotation")

    def _matrix(
        self, view: View, angle: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, g: torch.Generator
    ) -> torch.Tensor:
        zero = torch.zeros(view.n, dtype=torch.float64)
        return inverse_affine(-angle, zero, zero, zero + 1, zero, zero, cx, cy)  # counter-clockwise


@dataclass
class Warp:
    """The warp pass of a batch: matrices (B, N, 2, 3) from output pixel coordinates to the box pass's
    output (first) and to every image a filling op read from (the rest), of `sizes`."""

    matrices: torch.Tensor
    sizes: list[tuple[int, int]]
    out_hw: tuple[int, int]
    resampling: Resampling
    refill: bool = False  # a policy fills again after its colour ops: warp() returns where it filled

    def to(self, device, non_blocking: bool = False) -> Warp:
        return replace(self, matrices=self.matrices.to(device, non_blocking=non_blocking))


@dataclass
class Filled:
    """Where the warp pass filled (mask (N, 1, H, W): 1 inside, 0 filled, fractions at a bilinear
    fringe) and with what, so a policy can fill again after recolouring."""

    mask: torch.Tensor
    fill: torch.Tensor  # (1, C or 1, 1, 1)
    mode: str

    def apply(self, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.mask if mask is None else mask
        if self.mode == "nearest":
            return torch.where(mask < 0.5, self.fill.expand_as(y), y)
        return mask * (y - self.fill) + self.fill

    def again(self, y: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """Fill again the samples where `samples` (N,) is 1."""
        return torch.where(samples.view(-1, 1, 1, 1) > 0, self.apply(y), y)


def _inside(x: torch.Tensor, y: torch.Tensor, hw: tuple[int, int], mode: str) -> torch.Tensor:
    """How much of each sample point (pixel coordinates) `grid_sample` draws from inside an h×w image."""
    weights = []
    for u, size in ((x - 0.5, hw[1]), (y - 0.5, hw[0])):
        if mode == "nearest":
            r = torch.round(u)
            weights.append(((r >= 0) & (r <= size - 1)).to(u.dtype))
        else:
            lo = torch.floor(u)
            frac = u - lo
            weights.append((1 - frac) * ((lo >= 0) & (lo <= size - 1)) + frac * ((lo >= -1) & (lo <= size - 2)))
    return weights[0] * weights[1]


def _extend(u: torch.Tensor, size: int, mode: str) -> torch.Tensor:
    """Coordinates past an image of `size` pixels moved in, as padding `mode` extends it: "edge"
    repeats the border pixel, "symmetric" mirrors including it, "reflect" mirrors about it."""
    if mode == "edge":
        return u.clamp(0.5, size - 0.5)
    if mode == "symmetric":
        v = torch.remainder(u, 2 * size)
        return torch.where(v > size, 2 * size - v, v)
    if size == 1:
        return torch.full_like(u, 0.5)
    v = torch.remainder(u - 0.5, 2 * (size - 1))  # reflect: in pixel-centre units
    return torch.where(v > size - 1, 2 * (size - 1) - v, v) + 0.5


def warp(y: torch.Tensor, w: Warp) -> tuple[torch.Tensor, Filled | None]:
    """Warp float NCHW `y` (the box pass's output) to w.out_hw and put in the fill; also returns where
    it filled when a policy will need it again (else None)."""
    oh, ow = w.out_hw
    m = w.matrices.to(y.dtype)
    xs = torch.arange(ow, device=y.device, dtype=y.dtype) + 0.5
    ys = (torch.arange(oh, device=y.device, dtype=y.dtype) + 0.5)[:, None]
    col = lambda r, c: m[:, :, r, c, None, None]  # noqa: E731
    px = col(0, 0) * xs + col(0, 1) * ys + col(0, 2)  # (B, N, oh, ow)
    py = col(1, 0) * xs + col(1, 1) * ys + col(1, 2)
    h, wd = w.sizes[0]
    if w.resampling.padding != "constant":  # the box pass's output extended by edge or mirror
        px[0], py[0] = _extend(px[0], wd, w.resampling.padding), _extend(py[0], h, w.resampling.padding)
    grid = torch.stack([px[0] * (2 / wd) - 1, py[0] * (2 / h) - 1], -1)
    mode = w.resampling.interpolation or "nearest"
    out = tf.grid_sample(y, grid, mode=mode, padding_mode="zeros", align_corners=False)
    fill = constant(w.resampling.fill or (0.0,), y.device, y.dtype)
    inside = [_inside(px[k], py[k], w.sizes[k], mode)[:, None] for k in range(len(w.sizes))]
    first = 0 if w.resampling.fill is not None else 1  # no fill: the sampler's zero padding, as torchvision
    filled = Filled(math.prod(inside[1:], start=inside[0]), fill, mode)
    if len(inside) > first:
        out = filled.apply(out, math.prod(inside[first + 1 :], start=inside[first]))
    return out, filled if w.refill else None
