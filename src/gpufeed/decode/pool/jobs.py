"""A CPU share on its way through the decode workers (`workers.DecodeWorkers`): its rows of the job
board, its tickets and which of them are answered, and the rule for the tickets that no living
worker will answer (decoded on threads instead)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gpufeed.decode.asks import Asks
from gpufeed.decode.base import Encoded
from gpufeed.decode.pool.board import Board
from gpufeed.decode.pool.segment import Segment

UNCLAIMED_GRACE = 0.05  # seconds a ticket may be read yet untaken before its reader counts as dead


@dataclass
class Tally:
    """One loader's count of what the workers (and threads, for them) decoded: seconds by kind (the
    workers' wall and CPU seconds, the threads' wall seconds, shared segments made) and images."""

    busy: Counter = field(default_factory=Counter)
    decoded: int = 0
    left: bool = False  # its loader gave the workers back: no share of it is taken on since


@dataclass
class Job:
    """One batch's CPU share: board rows [start, start + n), of the loader counting into `tally`."""

    start: int
    share: int  # its number (mod 2**32), in its tickets and their answers
    segment: Segment
    batch: Encoded  # kept to decode on threads if a worker dies
    asks: Asks
    sequence: dict[int, int]  # each ticket's first row -> its place in the ticket pipe (all tickets ever written)
    pending: dict[int, int] = field(default_factory=dict)  # first row -> rows, of the tickets not answered
    unclaimed: dict[int, float] = field(default_factory=dict)  # read but not taken, when first seen so
    stopped: bool = False  # tickets left unanswered because the pool, or its loader, was stopped
    busy: float = 0.0  # seconds the workers (and threads, for lost tickets) spent decoding its images
    tally: Tally = field(default_factory=Tally)
    source: Segment | None = None  # what its rows read from: kept open while its tickets may be read
    orphan: bool = False  # its loader is gone: its rows are given back once its tickets are answered

    @property
    def n(self) -> int:
        return len(self.asks)

    def lost(self, board: Board, dead: list[bool], read_upto: int, now: float) -> dict[int, int]:
        """The pending tickets (first row -> rows) no living worker will answer: taken by a dead one,
        read but never taken for `UNCLAIMED_GRACE` (its reader died at once), or, with no worker left
        (`dead`, per worker), any still in the pipe, of which the tickets before `read_upto` were read."""
        if all(dead):
            return dict(self.pending)
        lost = {}
        for first, count in self.pending.items():
            owner = board.owner(first)
            if self.sequence[first] >= read_upto:
                continue  # still in the pipe: a living worker takes it
            if owner >= 0 and not dead[owner]:
                continue  # being decoded
            if owner < 0 and now - self.unclaimed.setdefault(first, now) < UNCLAIMED_GRACE:
                continue
            lost[first] = count
        return lost
