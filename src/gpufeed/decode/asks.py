"""What a decoder is asked to decode of each image of a batch: a size to DCT-reduce towards, a
region to decode alone, or the whole image; and the geometry that decides it from the crops the
resize reads. The bottom of `decode/`: numpy only (decode worker processes import it, without torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Region = tuple[int, int, int, int]  # y0, x0, y1, x1 of a stored image
NO_REGION = (-1, -1, -1, -1)  # a row's region (asked or decoded): none, the whole image


def crop_regions(shapes: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(N, 4) y0 x0 y1 x1: the pixels the resize kernel reads for crop `boxes` (x0 y0 x1 y1): the box
    and one pixel around it (bilinear taps of samples half a pixel inside), within the image."""
    lo = np.maximum(np.floor(boxes[:, [1, 0]]) - 1, 0)
    hi = np.minimum(np.ceil(boxes[:, [3, 2]]) + 1, shapes)
    return np.concatenate([lo, hi], 1).astype(np.int64)


def reduce_to(shapes: np.ndarray, boxes: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """(N, 2) int64: per image, the size (w, h) to ask libjpeg for when its crop is >= 2x the output
    both ways (DCT downscaling), else (0, 0)."""
    factor = np.minimum((boxes[:, 2] - boxes[:, 0]) / out_hw[1], (boxes[:, 3] - boxes[:, 1]) / out_hw[0])
    with np.errstate(divide="ignore", invalid="ignore"):  # an empty box: no reduction
        size = np.ceil(shapes[:, [1, 0]] / factor[:, None])
    return np.where((factor >= 2)[:, None], size, 0).astype(np.int64)


@dataclass
class Asks:
    """What the CPU decodes of each image of its share, one row per image (arrays, not a tuple per
    image: the loader's per-batch Python is what costs the training thread): a size to DCT-reduce
    towards, or else a region to decode alone, or else the whole image (`pixels.decode`)."""

    reduce_to: np.ndarray  # (N, 2) int64 (w, h); (0, 0): no reduction
    regions: np.ndarray  # (N, 4) int64 y0 x0 y1 x1; all -1: the whole image

    @classmethod
    def whole(cls, n: int) -> Asks:
        return cls(np.zeros((n, 2), np.int64), np.tile(np.array(NO_REGION, np.int64), (n, 1)))

    def __len__(self) -> int:
        return len(self.reduce_to)

    def take(self, positions) -> Asks:
        return Asks(self.reduce_to[positions], self.regions[positions])

    def nbytes(self, shapes: np.ndarray) -> np.ndarray:
        """Per image of stored `shapes` (N, 2), the bytes of its pixels as asked (HWC uint8): a region's,
        a DCT-reduced image's (`draft_scale`), or else the whole image's. A decoder that cannot
        decode a region alone cuts it from the whole image, so this is the room a worker may fill."""
        h, w = shapes[:, 0].astype(np.int64), shapes[:, 1].astype(np.int64)
        reduced = self.reduce_to[:, 0] > 0
        if reduced.any():
            scale = draft_scale(w[reduced], h[reduced], self.reduce_to[reduced])
            h[reduced], w[reduced] = -(-h[reduced] // scale), -(-w[reduced] // scale)
        alone, r = self.tries_region(), self.regions
        h, w = np.where(alone, r[:, 2] - r[:, 0], h), np.where(alone, r[:, 3] - r[:, 1], w)
        return h * w * 3

    def tries_region(self) -> np.ndarray:
        """Per image, whether its decode tries the region alone (asked, and no DCT reduction, which
        takes precedence): `tries_region` for every row at once."""
        return (self.regions[:, 0] >= 0) & (self.reduce_to[:, 0] == 0)

    def each(self) -> list[tuple[tuple[int, int] | None, Region | None]]:
        """Per image, `pixels.decode`'s (reduce_to, region) arguments (for decoders that take images one by one)."""
        return [asked(r, g) for r, g in zip(self.reduce_to.tolist(), self.regions.tolist())]


def draft_scale(width, height, reduce_to: np.ndarray) -> np.ndarray:
    """Per image of `width` x `height`, the scale (1, 2, 4 or 8) that decoding towards `reduce_to`
    ((..., 2) w, h) divides it by: the largest that leaves it at least that size both ways, as
    Pillow's `draft` picks libjpeg's DCT scale. The loader reserves room for the pixels by it."""
    scale = np.minimum(
        np.asarray(width) // np.maximum(reduce_to[..., 0], 1), np.asarray(height) // np.maximum(reduce_to[..., 1], 1)
    )
    return _SCALES[np.clip(scale, 0, 8)]


_SCALES = np.array(
    [1, 1, 2, 2, 4, 4, 4, 4, 8]
)  # by min(w // rw, h // rh), up to 8: the largest of 1, 2, 4, 8 not above it


def tries_region(reduce_to: tuple[int, int] | None, box: Region | None) -> bool:
    """Whether a decode tries `box` alone: one is asked for and no DCT reduction, which takes precedence."""
    return box is not None and reduce_to is None


def asked(reduce_to, region) -> tuple[tuple[int, int] | None, tuple[int, int, int, int] | None]:
    """A row's request (`reduce_to` (w, h), `region`, as lists of ints, as the board holds them) as
    `pixels.decode` takes it: None for no DCT reduction, None for the whole image."""
    w, h = reduce_to
    return ((w, h) if w else None), (tuple(region) if region[0] >= 0 else None)
