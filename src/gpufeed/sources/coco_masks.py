"""COCO's instance masks ("segmentation": polygons, or run-length coded for crowds) as 0/1 arrays.

Run-length masks (uncompressed counts, or COCO's compressed string) are decoded here, exactly as
pycocotools decodes them. Polygons are drawn by pycocotools where it is installed (`pip install
gpufeed[coco]`), so the masks are COCO's own; without it, here, a pixel being inside where its centre
is inside the polygons (even-odd). The two differ on edge pixels (about 2 % of a mask's pixels on
random polygons, tests/test_coco.py); packing says once which one drew them. A polygon that would
take more memory to draw than its mask (a vertex far outside the image, edges millions of pixels
long) is refused before either drawer sees it: its image is skipped with the reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.logs import logger

log = logger(__name__)

# pycocotools draws a polygon by walking its edges at 5x resolution: about 52 bytes per pixel of edge
# (measured), however few of those pixels are in the image. A polygon's edges may be this many pixels
# long in all (real ones: a few thousand; 4 Mi pixels take about 220 MB to draw) ...
MAX_POLYGON_EDGE_PIXELS = 4 << 20
# ... and its vertices may lie this many image sides outside the image (annotators' vertices lie within
# a pixel or so of it; one at 1e9 would take gigabytes to draw, one at 1e308 crashes pycocotools).
POLYGON_MARGIN_SIDES = 1


def rle_counts(counts: str | list) -> np.ndarray:
    """A run-length mask's counts (runs of 0, then 1, then 0 ... down the columns) from COCO's list or
    its compressed string: each count in 6-bit characters (offset 48) of 5 bits each, low bits first,
    0x20 saying another follows and the last one's 0x10 its sign; from the third count on, a count
    is stored as its difference to the count two before. ValueError for a malformed string."""
    if isinstance(counts, list):
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError("run-length counts that are not non-negative integers")
        return np.asarray(counts, np.int64)
    out: list[int] = []
    value = shift = 0
    for ch in counts.encode("ascii", "replace"):
        c = ch - 48
        if not 0 <= c < 64:
            raise ValueError("a compressed run-length string with a character outside '0'..'o'")
        value |= (c & 0x1F) << shift
        shift += 5
        if c & 0x20:
            continue
        if c & 0x10:
            value -= 1 << shift  # the sign bit of the last character: negative
        if len(out) > 2:
            value += out[-2]
        out.append(value)
        value = shift = 0
    if shift:
        raise ValueError("a compressed run-length string cut short")
    if any(c < 0 for c in out):
        raise ValueError("a compressed run-length string with a negative count")
    return np.asarray(out, np.int64)


def rle_mask(counts: np.ndarray, h: int, w: int) -> np.ndarray:
    """(h, w) uint8 from run lengths down the columns (COCO's column-major order)."""
    if int(counts.sum()) != h * w:
        raise ValueError(f"run-length counts that cover {int(counts.sum())} pixels of a {h}x{w} image")
    values = np.arange(len(counts)) % 2
    return np.repeat(values.astype(np.uint8), counts).reshape(w, h).T.copy()


def polygon_mask(polygons: list[list[float]], h: int, w: int) -> np.ndarray:
    """(h, w) uint8: 1 where a pixel's centre is inside the polygons (even-odd over all their edges),
    row by row over the rows they span."""
    x0 = np.concatenate([np.asarray(p[0::2], np.float64) for p in polygons])
    y0 = np.concatenate([np.asarray(p[1::2], np.float64) for p in polygons])
    starts = np.cumsum([0] + [len(p) // 2 for p in polygons])
    nxt = np.concatenate([np.roll(np.arange(a, b), -1) for a, b in zip(starts[:-1], starts[1:])])
    x1, y1 = x0[nxt], y0[nxt]
    out = np.zeros((h, w), np.uint8)
    top, bottom = max(0, int(np.floor(y0.min() - 0.5))), min(h, int(np.ceil(y0.max() + 0.5)))
    centres = np.arange(w) + 0.5
    for row in range(top, bottom):
        cy = row + 0.5
        crosses = (np.minimum(y0, y1) <= cy) & (cy < np.maximum(y0, y1))
        if crosses.any():
            e = np.flatnonzero(crosses)
            at = np.sort(x0[e] + (cy - y0[e]) / (y1[e] - y0[e]) * (x1[e] - x0[e]))
            out[row] = np.searchsorted(at, centres, side="right") % 2  # crossings at or left of the centre
    return out


def _pycocotools():
    try:
        from pycocotools import mask  # optional: `pip install gpufeed[coco]`
    except ImportError:
        return None
    return mask


@functools.cache
def _say_once(what: str) -> None:
    log.warning("gpufeed: %s", what)


def check_polygons(polygons: list[list[float]], h: int, w: int) -> None:
    """ValueError where drawing `polygons` on an (h, w) image would take more memory than the image's
    mask: a vertex more than POLYGON_MARGIN_SIDES image sides outside the image, or edges longer than
    MAX_POLYGON_EDGE_PIXELS in all. Checked before either drawer sees them, so that whether an image
    is kept does not depend on pycocotools being installed."""
    size = np.array([w, h], np.float64)
    edges = 0.0
    for p in polygons:
        xy = np.asarray(p, np.float64).reshape(-1, 2)
        outside = ((xy < -POLYGON_MARGIN_SIDES * size) | (xy > (1 + POLYGON_MARGIN_SIDES) * size)).any(axis=1)
        if outside.any():
            x, y = xy[np.argmax(outside)]
            raise ValueError(f"a polygon with a vertex at ({x:g}, {y:g}), far outside the {w}x{h} image")
        edges += float(np.abs(np.diff(xy, axis=0, append=xy[:1])).max(axis=1).sum())  # the last edge closes it
    if edges > MAX_POLYGON_EDGE_PIXELS:
        raise ValueError(
            f"polygons whose edges are {edges:.0f} pixels long in all, more than packing draws "
            f"({MAX_POLYGON_EDGE_PIXELS}; they would take about {edges * 52 / 2**30:.1f} GiB to draw)"
        )


@dataclass(frozen=True)
class CocoMasks:
    """One image's instance masks, drawn when packing takes the sample (`__call__`, so that a whole
    file's masks are never in memory at once): one per kept annotation, in their order. ValueError
    naming the annotation whose segmentation is missing or malformed: packing skips the image with it.
    `shape` is what drawing them takes, known before they are drawn: packing checks it first against
    the image's real size and the memory it gives one sample's masks (`packing.fields`)."""

    segmentations: tuple[Any, ...]
    h: int
    w: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(instances, h, w) of the masks `__call__` draws."""
        return len(self.segmentations), self.h, self.w

    def __call__(self) -> np.ndarray:
        out = np.zeros((len(self.segmentations), self.h, self.w), np.uint8)
        for k, seg in enumerate(self.segmentations):
            out[k] = self._one(seg, k)
        return out

    def _one(self, seg: Any, k: int) -> np.ndarray:
        h, w = self.h, self.w
        if isinstance(seg, dict):
            size, counts = seg.get("size"), seg.get("counts")
            if size != [h, w] or not isinstance(counts, (str, list)):
                raise ValueError(f"annotation {k}: a run-length mask of size {size}, not [{h}, {w}]")
            try:
                return rle_mask(rle_counts(counts), h, w)
            except ValueError as e:
                raise ValueError(f"annotation {k}: {e}") from None
        if (
            isinstance(seg, list)
            and seg
            and all(
                isinstance(p, list)
                and len(p) >= 6
                and len(p) % 2 == 0
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in p)
                for p in seg
            )
        ):
            try:
                check_polygons(seg, h, w)
            except ValueError as e:
                raise ValueError(f"annotation {k}: {e}") from None
            coco = _pycocotools()
            if coco is not None:
                _say_once("COCO polygons drawn by pycocotools")
                return coco.decode(coco.merge(coco.frPyObjects(seg, h, w)))
            _say_once(
                "COCO polygons drawn by gpufeed (pixel centres inside): pycocotools is not installed "
                "(pip install gpufeed[coco] draws them as COCO does; about 2 % of a mask's pixels, its edges, "
                "differ)"
            )
            return polygon_mask(seg, h, w)
        raise ValueError(f"annotation {k}: a segmentation that is neither polygons nor a run-length mask")
