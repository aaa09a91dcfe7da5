"""A video store on this disk (`store.reader.Store` of mode "video"): its container files memory-mapped
and decoded clip by clip by decode processes (`loader.video`); nothing is materialized in a tier."""

from __future__ import annotations

import torch

from gpufeed.loader.inputs.base import Input
from gpufeed.loader.tiers import Tier
from gpufeed.store.reader import Store


class VideoInput(Input):
    store: Store

    def tier(self, device: torch.device, cache: str) -> Tier:
        empty = torch.empty((0, 1, 1, 3), dtype=torch.uint8)
        return Tier("video", empty, self.store.labels, "video files memory-mapped, clips decoded by CPU processes")

    def begin(self, plan, epoch: int, start: int, planner) -> None:
        self.store.check_unchanged()
