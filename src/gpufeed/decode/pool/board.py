"""The decode workers' job board, as the loader sees it: shared rows (`protocol.BOARD`) in a memfd,
which shares take and give back, filled with a share's requests and read for its results."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpufeed.decode.asks import Asks, asked
from gpufeed.decode.base import Decoded
from gpufeed.decode.codecs import pixels
from gpufeed.decode.pool import protocol
from gpufeed.decode.pool.segment import Segment

ROWS = 1 << 16  # images on the board at once (a few batches' CPU shares); the memfd's pages cost only once used


@dataclass
class Results:
    """A share's answers: the images decoded (positions in the share, their sizes, regions, where
    their pixels start in the segment), the failed ones with why, and when the last one finished."""

    kept: np.ndarray
    sizes: np.ndarray  # int64 (K, 2)
    regions: np.ndarray  # int64 (K, 4), as `Decoded.regions`
    offsets: np.ndarray
    failed: dict[int, str]
    last_done: float
    cut: int  # images decoded whole and cut to their region (`protocol.Status.CUT`)


def source(described: bytes) -> Segment:
    """A loader's `protocol.Source` (what its rows read), in a memfd the workers open through /proc."""
    made = Segment(len(described), torch.device("cpu"))
    made.tensor.numpy()[:] = np.frombuffer(described, np.uint8)
    return made


class Board:
    """`ROWS` shared rows; workers open them through the memfd they inherit (`fd`)."""

    def __init__(self, rows: int = ROWS):
        self.size = rows
        self._segment = Segment(rows * protocol.BOARD.itemsize, torch.device("cpu"))
        self.fd = self._segment.fd
        self.rows = protocol.board(self._segment.tensor.numpy(), rows)

    def room(self, n: int, taken: list[tuple[int, int]]) -> int | None:
        """The first row of `n` rows free of the `taken` ranges [start, stop), or None."""
        start = 0
        for a, b in sorted(taken):
            if start + n <= a:
                break
            start = max(start, b)
        return start if start + n <= self.size else None

    def post(
        self, start: int, source: Segment, begins, ends, files, at, capacity, segment: Segment, asks: Asks
    ) -> None:
        """Requests into rows [start, start + len(at)): byte ranges of `source` (a `protocol.Source`; of its
        file `files`, or -1 for its store), where the pixels go in `segment` and how much they may
        take, what to decode."""
        rows = self.rows[start : start + len(at)]
        rows["source_fd"], rows["source_id"], rows["source_size"] = source.fd, source.id, source.nbytes
        rows["begin"], rows["end"], rows["file"], rows["at"], rows["capacity"] = begins, ends, files, at, capacity
        rows["segment_fd"], rows["segment_id"], rows["segment_size"] = segment.fd, segment.id, segment.nbytes
        rows["reduce_to"], rows["region"] = asks.reduce_to, asks.regions
        rows["worker"], rows["status"] = -1, protocol.Status.PENDING

    def results(self, start: int, n: int) -> Results:
        """Rows [start, start + n) as answered (a row never answered counts as failed)."""
        rows = self.rows[start : start + n].copy()
        cut = rows["status"] == protocol.Status.CUT
        ok = (rows["status"] == protocol.Status.DECODED) | cut
        kept = np.flatnonzero(ok)
        failed = {int(k): rows["error"][k].decode(errors="replace") or "not decoded" for k in np.flatnonzero(~ok)}
        sizes = np.stack([rows["height"][kept], rows["width"][kept]], 1).astype(np.int64)
        regions = rows["decoded_region"][kept].astype(np.int64)
        last = float(rows["done"][kept].max()) if len(kept) else 0.0
        return Results(
            kept=kept,
            sizes=sizes,
            regions=regions,
            offsets=rows["at"][kept],
            failed=failed,
            last_done=last,
            cut=int(cut.sum()),
        )

    def answer(
        self, start: int, positions: list[int], part: Decoded, asks: Asks, segment: Segment, done: float
    ) -> None:
        """Complete rows `start + positions` with `part`, their images as a thread decoder made them
        (on the CPU, in order, finished at `done`), as a worker would: pixels into `segment`, a region
        asked for and decoded whole cut to it."""
        # a thread decoder's parts carry their regions (codecs.cpu)
        images = iter(zip(part.offsets.tolist(), part.sizes.tolist(), part.regions.tolist()))  # type: ignore[union-attr]
        for k, p in enumerate(positions):
            row = self.rows[start + p : start + p + 1]
            if k in part.failed:
                protocol.failed(row, part.failed[k])
                continue
            offset, (h, w), region = next(images)
            image = part.base[offset : offset + h * w * 3].numpy().reshape(h, w, 3)
            request = asked(asks.reduce_to[p].tolist(), asks.regions[p].tolist())
            image, region, cut = pixels.as_asked(image, tuple(region) if region[0] >= 0 else None, *request)
            protocol.answer(row, segment.tensor.numpy(), image, region, done, cut)

    def owner(self, row: int) -> int:
        """The worker that took `row`'s ticket, or -1."""
        return int(self.rows["worker"][row])

    def close(self) -> None:
        self._segment.close()
