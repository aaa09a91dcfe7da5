"""Automatic augmentation policies: RandAugment, TrivialAugmentWide and AutoAugment.

Each sample draws its own ops and magnitudes with torchvision's spaces and distributions. The
geometric ones (shears, translations, rotations) compose into the warp pass with the ops before
them; the colour ones then run op by op on the samples that drew each op (grouped on the device
by a sort whose group sizes the host already knows: no Python loop over samples, no sync). A
sample that drew a colour op before a geometric one has its fill put back after the colour ops,
as torchvision's order would leave it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpufeed.augment import checks, colour
from gpufeed.augment.affine import Filled, from_centre, interpolation_mode, inverse_affine
from gpufeed.augment.view import Resampling, View, fill_tuple

OPS = (
    "Identity",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
    "Posterize",
    "Solarize",
    "AutoContrast",
    "Equalize",
    "Invert",
)
ID = {name: k for k, name in enumerate(OPS)}
GEOMETRIC = frozenset(range(ID["ShearX"], ID["Rotate"] + 1))
SIGNED = frozenset(range(ID["ShearX"], ID["Sharpness"] + 1))
KERNELS = {
    ID["Brightness"]: lambda y, m: colour.brightness(y, 1 + m),
    ID["Color"]: lambda y, m: colour.saturation(y, 1 + m),
    ID["Contrast"]: lambda y, m: colour.contrast(y, 1 + m),
    ID["Sharpness"]: lambda y, m: colour.sharpness(y, 1 + m),
    ID["Posterize"]: lambda y, m: colour.posterize(y, m),
    ID["Solarize"]: lambda y, m: colour.solarize(y, 255 * m),
    ID["AutoContrast"]: colour.autocontrast,
    ID["Equalize"]: colour.equalize,
    ID["Invert"]: colour.invert,
}


def magnitudes(wide: bool, bins: int, height: int, width: int) -> torch.Tensor:
    """(len(OPS), bins) float64: each op's magnitude per bin (0 for ops without one); `wide`: the
    TrivialAugmentWide space, else RandAugment's and AutoAugment's."""
    table = torch.zeros(len(OPS), bins, dtype=torch.float64)
    line = lambda top: torch.linspace(0.0, top, bins, dtype=torch.float64)  # noqa: E731
    table[ID["ShearX"]] = table[ID["ShearY"]] = line(0.99 if wide else 0.3)
    table[ID["TranslateX"]] = line(32.0 if wide else 150.0 / 331.0 * width)
    table[ID["TranslateY"]] = line(32.0 if wide else 150.0 / 331.0 * height)
    table[ID["Rotate"]] = line(135.0 if wide else 30.0)
    for name in ("Brightness", "Color", "Contrast", "Sharpness"):
        table[ID[name]] = line(0.99 if wide else 0.9)
    table[ID["Posterize"]] = (8 - torch.arange(bins, dtype=torch.float64) / ((bins - 1) / (6 if wide else 4))).round()
    table[ID["Solarize"]] = torch.linspace(1.0, 0.0, bins, dtype=torch.float64)
    return table


class _Policy:
    """Per-sample op ids and signed magnitudes for each of `slots` (drawn by `_choose`), their warp,
    and their colour ops. Columns: (op id, magnitude) per slot, then the refill flag."""

    interpolation: str
    fill: float | Sequence[float] | None
    slots: int

    def _check(self, bins: int | None = None) -> None:
        """The warp settings, and num_magnitude_bins (2 at least: the magnitudes step by 1 / (bins - 1))."""
        op = type(self).__name__
        Resampling(interpolation_mode(self.interpolation))
        checks.fill(self.fill, op)
        if bins is not None:
            checks.integer(bins, op, "num_magnitude_bins", 2, "at least 2")

    @property
    def width(self) -> int:
        return 2 * self.slots + 1

    def _choose(self, n: int, h: int, w: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # each policy says

    def sample(self, view: View, g: torch.Generator) -> tuple[View, torch.Tensor, torch.Tensor]:
        """(the view with this policy's geometry composed in, the columns, the op ids (N, slots) int8 for
        the host)."""
        (h, w), n = view.need_one_size(), view.n
        ops, mags = self._choose(n, h, w, g)  # (n, slots) int64 and float64
        flip = torch.rand(n, self.slots, generator=g) <= 0.5
        signed = torch.tensor([k in SIGNED for k in range(len(OPS))])[ops]
        mags = torch.where(signed & flip, -mags, mags)
        resampling = Resampling(interpolation_mode(self.interpolation), fill_tuple(self.fill))
        geometric = torch.tensor([k in GEOMETRIC for k in range(len(OPS))])[ops]
        for k in range(self.slots):
            if bool(geometric[:, k].any()):
                view = view.then(
                    from_centre(self._matrix(ops[:, k], mags[:, k], h, w), h, w), h, w, resampling, fills=True
                )
        recoloured = torch.zeros(n, dtype=torch.bool)
        refill = torch.zeros(n, dtype=torch.bool)
        for k in range(self.slots):
            refill |= recoloured & geometric[:, k]
            recoloured |= (ops[:, k] != ID["Identity"]) & ~geometric[:, k]
        cols = torch.stack([ops.double(), mags], 2).reshape(n, -1)
        return view, torch.cat([cols, refill.double()[:, None]], 1), ops.to(torch.int8)

    @staticmethod
    def _matrix(ops: torch.Tensor, m: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Torchvision's affine for each sample's op: shears about the top-left corner, translations by
        whole pixels, rotations about the centre (counter-clockwise); the identity for other ops."""
        zero = torch.zeros_like(m)
        pick = lambda name, value: torch.where(ops == ID[name], value, zero)  # noqa: E731
        shear = torch.rad2deg(torch.atan(m))
        corner = (ops == ID["ShearX"]) | (ops == ID["ShearY"])
        return inverse_affine(
            -pick("Rotate", m),
            pick("TranslateX", torch.trunc(m)),
            pick("TranslateY", torch.trunc(m)),
            zero + 1,
            pick("ShearX", shear),
            pick("ShearY", shear),
            torch.where(corner, zero - w / 2, zero),
            torch.where(corner, zero - h / 2, zero),
        )

    def apply(self, y: torch.Tensor, cols: torch.Tensor, ops: torch.Tensor, filled: Filled | None) -> torch.Tensor:
        """The colour ops of every slot on float NCHW 0..255; `ops` (N, slots) on the host, `cols` on y's device."""
        for k in range(self.slots):
            counts = torch.bincount(ops[:, k].long(), minlength=len(OPS)).tolist()
            if not any(counts[op] for op in KERNELS):
                continue
            order = torch.argsort(cols[:, 2 * k], stable=True)  # samples grouped by op id, ascending
            start = 0
            for op, count in enumerate(counts):
                if count and op in KERNELS:
                    idx = order[start : start + count]
                    y = y.index_copy(0, idx, KERNELS[op](y.index_select(0, idx), cols[idx, 2 * k + 1]))
                start += count
        return y if filled is None else filled.again(y, cols[:, -1])


@dataclass
class RandAugment(_Policy):
    """`num_ops` ops per sample, each drawn uniformly (Identity included), at bin `magnitude` of
    `num_magnitude_bins`, signed at random where the op has a direction."""

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: float | Sequence[float] | None = None

    def __post_init__(self):
        self._check(self.num_magnitude_bins)
        checks.integer(self.num_ops, "RandAugment", "num_ops")
        checks.integer(self.magnitude, "RandAugment", "magnitude")
        if self.num_ops < 0 or not 0 <= self.magnitude < self.num_magnitude_bins:
            raise ValueError(
                f"RandAugment needs num_ops >= 0 and 0 <= magnitude < num_magnitude_bins, got "
                f"{self.num_ops}, {self.magnitude}, {self.num_magnitude_bins}"
            )
        self.slots = self.num_ops

    def _choose(self, n, h, w, g):
        ops = torch.randint(ID["Invert"], (n, self.slots), generator=g)  # every op but Invert
        return ops, magnitudes(False, self.num_magnitude_bins, h, w)[ops, self.magnitude]


@dataclass
class TrivialAugmentWide(_Policy):
    """One op per sample, drawn uniformly (Identity included), at a uniformly drawn magnitude bin of
    the wide space."""

    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: float | Sequence[float] | None = None
    slots = 1

    def __post_init__(self):
        self._check(self.num_magnitude_bins)

    def _choose(self, n, h, w, g):
        ops = torch.randint(ID["Invert"], (n, 1), generator=g)
        bins = torch.randint(self.num_magnitude_bins, (n, 1), generator=g)
        return ops, magnitudes(True, self.num_magnitude_bins, h, w)[ops, bins]


# AutoAugment's learned policies (Cubuk et al., 2019): sub-policies separated by ";", each two ops
# "name probability magnitude-bin-of-10" ("-": the op has no magnitude)
_POLICY_TEXT = {
    "imagenet": """
    Posterize 0.4 8, Rotate 0.6 9; Solarize 0.6 5, AutoContrast 0.6 -; Equalize 0.8 -, Equalize 0.6 -;
    Posterize 0.6 7, Posterize 0.6 6; Equalize 0.4 -, Solarize 0.2 4; Equalize 0.4 -, Rotate 0.8 8;
    Solarize 0.6 3, Equalize 0.6 -; Posterize 0.8 5, Equalize 1 -; Rotate 0.2 3, Solarize 0.6 8;
    Equalize 0.6 -, Posterize 0.4 6; Rotate 0.8 8, Color 0.4 0; Rotate 0.4 9, Equalize 0.6 -;
    Equalize 0 -, Equalize 0.8 -; Invert 0.6 -, Equalize 1 -; Color 0.6 4, Contrast 1 8;
    Rotate 0.8 8, Color 1 2; Color 0.8 8, Solarize 0.8 7; Sharpness 0.4 7, Invert 0.6 -;
    ShearX 0.6 5, Equalize 1 -; Color 0.4 0, Equalize 0.6 -; Equalize 0.4 -, Solarize 0.2 4;
    Solarize 0.6 5, AutoContrast 0.6 -; Invert 0.6 -, Equalize 1 -; Color 0.6 4, Contrast 1 8;
    Equalize 0.8 -, Equalize 0.6 -""",
    "cifar10": """
    Invert 0.1 -, Contrast 0.2 6; Rotate 0.7 2, TranslateX 0.3 9; Sharpness 0.8 1, Sharpness 0.9 3;
    ShearY 0.5 8, TranslateY 0.7 9; AutoContrast 0.5 -, Equalize 0.9 -; ShearY 0.2 7, Posterize 0.3 7;
    Color 0.4 3, Brightness 0.6 7; Sharpness 0.3 9, Brightness 0.7 9; Equalize 0.6 -, Equalize 0.5 -;
    Contrast 0.6 7, Sharpness 0.6 5; Color 0.7 7, TranslateX 0.5 8; Equalize 0.3 -, AutoContrast 0.4 -;
    TranslateY 0.4 3, Sharpness 0.2 6; Brightness 0.9 6, Color 0.2 8; Solarize 0.5 2, Invert 0 -;
    Equalize 0.2 -, AutoContrast 0.6 -; Equalize 0.2 -, Equalize 0.6 -; Color 0.9 9, Equalize 0.6 -;
    AutoContrast 0.8 -, Solarize 0.2 8; Brightness 0.1 3, Color 0.7 0; Solarize 0.4 5, AutoContrast 0.9 -;
    TranslateY 0.9 9, TranslateY 0.7 9; AutoContrast 0.9 -, Solarize 0.8 3; Equalize 0.8 -, Invert 0.1 -;
    TranslateY 0.7 9, AutoContrast 0.9 -""",
    "svhn": """
    ShearX 0.9 4, Invert 0.2 -; ShearY 0.9 8, Invert 0.7 -; Equalize 0.6 -, Solarize 0.6 6;
    Invert 0.9 -, Equalize 0.6 -; Equalize 0.6 -, Rotate 0.9 3; ShearX 0.9 4, AutoContrast 0.8 -;
    ShearY 0.9 8, Invert 0.4 -; ShearY 0.9 5, Solarize 0.2 6; Invert 0.9 -, AutoContrast 0.8 -;
    Equalize 0.6 -, Rotate 0.9 3; ShearX 0.9 4, Solarize 0.3 3; ShearY 0.8 8, Invert 0.7 -;
    Equalize 0.9 -, TranslateY 0.6 6; Invert 0.9 -, Equalize 0.6 -; Contrast 0.3 3, Rotate 0.8 4;
    Invert 0.8 -, TranslateY 0 2; ShearY 0.7 6, Solarize 0.4 8; Invert 0.6 -, Rotate 0.8 4;
    ShearY 0.3 7, TranslateX 0.9 3; ShearX 0.1 6, Invert 0.6 -; Solarize 0.7 2, TranslateY 0.6 7;
    ShearY 0.8 4, Invert 0.8 -; ShearX 0.7 9, TranslateY 0.8 3; ShearY 0.8 5, AutoContrast 0.7 -;
    ShearX 0.7 2, Invert 0.1 -""",
}


def _parse(text: str) -> tuple[tuple[tuple[str, float, int | None], ...], ...]:
    def ops(pair: str) -> tuple[tuple[str, float, int | None], ...]:
        return tuple((n, float(p), None if m == "-" else int(m)) for n, p, m in (op.split() for op in pair.split(",")))

    return tuple(ops(pair) for pair in text.split(";"))


AUTO_POLICIES = {name: _parse(text) for name, text in _POLICY_TEXT.items()}
IMAGENET = AUTO_POLICIES["imagenet"]


@dataclass
class AutoAugment(_Policy):
    """One sub-policy of a learned policy ("imagenet", "cifar10" or "svhn", or torchvision's
    AutoAugmentPolicy) per sample, drawn uniformly; each of its two ops applies with its probability,
    at its magnitude bin of 10."""

    policy: str = "imagenet"
    interpolation: str = "nearest"
    fill: float | Sequence[float] | None = None
    slots = 2

    def __post_init__(self):
        name = str(getattr(self.policy, "value", self.policy)).lower()
        if name not in AUTO_POLICIES:
            raise ValueError(f"AutoAugment policy {self.policy!r} is not one of {sorted(AUTO_POLICIES)}")
        self._check()
        table = AUTO_POLICIES[name]
        self._op = torch.tensor([[ID[op] for op, _, _ in pair] for pair in table])
        self._p = torch.tensor([[p for _, p, _ in pair] for pair in table], dtype=torch.float64)
        self._bin = torch.tensor([[b or 0 for _, _, b in pair] for pair in table])

    def _choose(self, n, h, w, g):
        pick = torch.randint(len(self._op), (n,), generator=g)
        on = torch.rand(n, 2, dtype=torch.float64, generator=g) <= self._p[pick]
        ops = torch.where(on, self._op[pick], torch.zeros_like(self._op[pick]))
        return ops, magnitudes(False, 10, h, w)[ops, self._bin[pick]]


POLICIES = (RandAugment, TrivialAugmentWide, AutoAugment)
