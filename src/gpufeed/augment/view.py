"""The geometry of a batch while its ops are drawn: where each sample's view lies in its source.

Crops, resizes and flips only move an axis-aligned source box per sample (the box pass: one
resampling of the source). The first op that turns, shears or pads starts a warp: every later op
composes into per-sample matrices, sampled in one more pass over the box pass's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch


@dataclass
class Resampling:
    """How the warp pass samples ("nearest" or "bilinear", torchvision's choices for its affine ops) and
    what it puts where no source pixel lands (`fill`: one value or one per channel, 0..255; None: the
    sampler's zero padding, as torchvision without a fill). `padding`: how the box pass's output
    extends past its edges when the first op that warps is a RandomCrop padding it another way than
    with the fill ("edge", "reflect", "symmetric")."""

    interpolation: str | None = "nearest"  # None: any (integer shifts, as RandomCrop's padding)
    fill: tuple[float, ...] | None = None
    padding: str = "constant"

    def __post_init__(self):
        if self.interpolation not in ("nearest", "bilinear", None):
            raise ValueError(f"interpolation must be 'nearest' or 'bilinear', got {self.interpolation!r}")

    def merge(self, other: Resampling) -> Resampling:
        """One warp pass for both, or ValueError. A fill of zeros and no fill agree unless a bilinear
        op asked for one of them explicitly (its fringe blends differently)."""
        modes = {m for m in (self.interpolation, other.interpolation) if m}
        strict = {r.interpolation for r in (self, other)} == {"bilinear"}
        fills = {f if strict or (f is not None and any(f)) else None for f in (self.fill, other.fill)}
        if len(modes) > 1 or len(fills) > 1:
            raise ValueError(
                f"ops that warp the image must agree on interpolation and fill (one warp pass "
                f"serves them all): {self} vs {other}"
            )
        lead = self if self.interpolation else other
        return Resampling(
            lead.interpolation, lead.fill if lead.interpolation else self.fill or other.fill, self.padding
        )


def fill_tuple(fill: float | Sequence[float] | None) -> tuple[float, ...] | None:
    if fill is None:
        return None
    if isinstance(fill, (tuple, list)):
        return tuple(float(f) for f in fill)
    return (float(fill),)  # type: ignore[arg-type]  # checks.fill lets only numbers, tuples and lists through


@dataclass
class Bound:
    """An image some op read from: `matrix` (N, 3, 3) takes the current view's coordinates to that
    image's, where points outside its `hw` get the fill."""

    matrix: torch.Tensor
    hw: tuple[int, int]


@dataclass
class View:
    """Where the current (virtual) image lies in the source, for every sample of a batch.

    Crops, resizes and flips only move an axis-aligned source box (the box pass). The first op that
    turns, shears or pads the image starts a warp: from then on every op composes into per-sample
    matrices taking the view's coordinates (x right, y down, pixel k spans k..k+1) to the box pass's
    output, `bounds[0]`, and to every image an op that fills read from (the later bounds)."""

    boxes: torch.Tensor  # float64 (N, 4): x1, y1, x2, y2 in source pixels
    flip: torch.Tensor  # bool (N,): mirrored relative to the source
    height: int | torch.Tensor  # a tensor (N,) while samples still differ in size (jpeg sources)
    width: int | torch.Tensor
    vflip: torch.Tensor | None = None  # bool (N,): upside down relative to the source (None: never)
    bounds: list[Bound] = field(default_factory=list)
    resampling: Resampling | None = None

    @property
    def uniform(self) -> bool:
        return isinstance(self.height, int) and isinstance(self.width, int)

    @property
    def n(self) -> int:
        return self.boxes.shape[0]

    def crop(
        self,
        top: torch.Tensor,
        left: torch.Tensor,
        h: torch.Tensor,
        w: torch.Tensor,
        out_h: int | torch.Tensor,
        out_w: int | torch.Tensor,
    ) -> View:
        """Crop rows top..top+h, cols left..left+w of the current view (per sample), output out_h×out_w
        (one size, or per-sample sizes while the samples still differ)."""
        if self.bounds:
            a = matrices(self.n, sx=w.double() / out_w, sy=h.double() / out_h, tx=left.double(), ty=top.double())
            return self.then(a, int(out_h), int(out_w))
        sx = (self.boxes[:, 2] - self.boxes[:, 0]) / self.width
        sy = (self.boxes[:, 3] - self.boxes[:, 1]) / self.height
        left = torch.where(self.flip, self.width - (left + w), left).double()
        top = top if self.vflip is None else torch.where(self.vflip, self.height - (top + h), top)
        x1 = self.boxes[:, 0] + left * sx
        y1 = self.boxes[:, 1] + top.double() * sy
        boxes = torch.stack([x1, y1, x1 + w.double() * sx, y1 + h.double() * sy], 1)
        return replace(self, boxes=boxes, height=out_h, width=out_w)

    def mirror(self, horizontal: torch.Tensor | None, vertical: torch.Tensor | None) -> View:
        """Mirror the samples where `horizontal` (left-right) or `vertical` (upside down) is True."""
        if self.bounds:
            height, width = self.need_one_size()
            h = torch.zeros(self.n, dtype=torch.bool) if horizontal is None else horizontal
            v = torch.zeros(self.n, dtype=torch.bool) if vertical is None else vertical
            one = torch.ones(self.n, dtype=torch.float64)
            a = matrices(
                self.n,
                sx=torch.where(h, -one, one),
                sy=torch.where(v, -one, one),
                tx=h.double() * width,
                ty=v.double() * height,
            )
            return self.then(a, height, width)
        out = self
        if horizontal is not None:
            out = replace(out, flip=out.flip ^ horizontal)
        if vertical is not None:
            out = replace(out, vflip=vertical if out.vflip is None else out.vflip ^ vertical)
        return out

    def need_one_size(self) -> tuple[int, int]:
        """(height, width), the one size of the samples, or ValueError."""
        h, w = self.height, self.width
        if not (isinstance(h, int) and isinstance(w, int)):  # not self.uniform
            raise ValueError(
                "rotations, affine ops, padding and policies need images of one size: put "
                "RandomResizedCrop, Resize((h, w)) or CenterCrop before them"
            )
        return h, w

    def then(
        self, a: torch.Tensor, out_h: int, out_w: int, resampling: Resampling | None = None, fills: bool = False
    ) -> View:
        """Compose `a` (N, 3, 3: the new view's coordinates to the current view's, out_h×out_w) into the
        warp; `fills`: points that `a` takes outside the current view get the fill (turns, pads)."""
        hw = self.need_one_size()
        merged = self.resampling
        if resampling is not None:
            merged = resampling if merged is None else merged.merge(resampling)
        bounds = [Bound(b.matrix @ a, b.hw) for b in self.bounds]
        if fills or not bounds:
            bounds.append(Bound(a, hw))
        return replace(self, height=out_h, width=out_w, bounds=bounds, resampling=merged)


def matrices(n: int, sx=1.0, sy=1.0, tx=0.0, ty=0.0) -> torch.Tensor:
    """(n, 3, 3) float64 matrices x' = sx * x + tx, y' = sy * y + ty (numbers or per-sample tensors)."""
    m = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    m[:, 0, 0], m[:, 1, 1], m[:, 0, 2], m[:, 1, 2] = sx, sy, tx, ty
    return m


def pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def full(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), float(value), dtype=torch.float64)


def column(size: int | torch.Tensor, n: int) -> torch.Tensor:
    """A per-sample float64 column of an image dimension (uniform int or per-sample tensor)."""
    return size.double() if isinstance(size, torch.Tensor) else full(n, size)
