"""Moving batches: threaded gathers, the pinned ring and side-stream host-to-device copies."""

from gpufeed.transfer.gather import Gatherer
from gpufeed.transfer.ring import PinnedRing, hand_over, pinned_empty

__all__ = ["Gatherer", "PinnedRing", "hand_over", "pinned_empty"]
