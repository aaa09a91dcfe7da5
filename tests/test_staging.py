"""Pinned staging buffers of the jpeg path: reused only once the GPU work reading them ran, smallest fit first."""

from __future__ import annotations

from gpufeed.decode.base import PinnedStaging


class Done:
    """Stands in for the CUDA event recorded after the kernels that read a buffer."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_buffers_reused_after_their_readers_smallest_fit_first():
    staging = PinnedStaging(pin=False)
    big, small, busy = staging.take(1000), staging.take(100), staging.take(500)
    assert big.numel() >= 1000 and small.numel() >= 100 and busy.numel() >= 500
    pending = Done(False)
    staging.give_back(big, Done(True))
    staging.give_back(small, Done(True))
    staging.give_back(busy, pending)
    assert staging.take(90) is small  # the smallest free buffer that fits
    assert staging.take(400) is big  # `busy` fits better, but its readers have not run
    pending.done = True
    assert staging.take(400) is busy
    fresh = staging.take(400)  # nothing free: a new buffer
    assert fresh.numel() >= 400 and all(fresh is not b for b in (big, small, busy))
