"""Pinned staging buffers of the jpeg path: reused only once their copy has run, smallest fit first."""

from __future__ import annotations

from gpufeed.decode.base import PinnedStaging


class Copied:
    """Stands in for the CUDA event recorded after a buffer's copy."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_buffers_reused_after_their_copy_smallest_fit_first():
    staging = PinnedStaging(pin=False)
    big, small, busy = staging.take(1000), staging.take(100), staging.take(500)
    assert big.numel() >= 1000 and small.numel() >= 100 and busy.numel() >= 500
    pending = Copied(False)
    staging.give_back(big, Copied(True))
    staging.give_back(small, Copied(True))
    staging.give_back(busy, pending)
    assert staging.take(90) is small  # the smallest free buffer that fits
    assert staging.take(400) is big  # `busy` fits better, but its copy has not run
    pending.done = True
    assert staging.take(400) is busy
    fresh = staging.take(400)  # nothing free: a new buffer
    assert fresh.numel() >= 400 and all(fresh is not b for b in (big, small, busy))
