"""Moving batches: threaded gathers, the pinned ring and side-stream host-to-device copies."""

from gpufeed.transfer.gather import Gatherer
from gpufeed.transfer.ring import PinnedRing, hand_over, pinned_empty
from gpufeed.transfer.upload import upload

__all__ = ["Gatherer", "PinnedRing", "hand_over", "pinned_empty", "upload"]
