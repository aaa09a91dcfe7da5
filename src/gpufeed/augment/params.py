"""`Params`: everything random about a batch, drawn by `Augment.sample` for a whole epoch at once and
sliced per batch; what the loader moves to the device and hands over with a batch."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpufeed.augment.affine import Warp
from gpufeed.transfer.upload import upload


@dataclass
class Params:
    """Everything random about one batch; move it with `.to(device)` before `apply`."""

    boxes: torch.Tensor  # (N, 4) source boxes x1, y1, x2, y2
    flip: torch.Tensor  # (N,) uint8, 1 = mirrored
    out_hw: tuple[int, int]
    identity: bool  # no resampling needed
    pixel: torch.Tensor | None  # (N, columns): a policy's, every colour/pixel op's and RandomErasing's draws
    any_flip: bool = True  # known on the host, so apply() never syncs with the device
    vflip: torch.Tensor | None = None  # (N,) uint8, 1 = upside down; None: no op flips vertically
    warp: Warp | None = None  # the warp pass after the box pass (out_hw is then the box pass's size)
    choices: torch.Tensor | None = None  # (N, slots) int8: a policy's ops, kept on the host
    seeds: torch.Tensor | None = None  # (N,) int64 on the host: seeds a batch's random erasing noise
    # batches of one shape each (`Augment.sample(..., batches=)`): each image's (h, w) at the top left of
    # its batch's out_hw, the rest padded; and the out_hw of every batch of the epoch (`EpochPlan.batch`
    # gives each batch its own, out_hw being the first's until then)
    content: torch.Tensor | None = None  # (N, 2) int32
    batch_hw: tuple[tuple[int, int], ...] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors of the parameters (what a stream hand-over must cover); not the host-side choices."""
        warp = None if self.warp is None else self.warp.matrices
        found = [self.boxes, self.flip, self.pixel, self.vflip, warp, self.content]
        return [t for t in found if t is not None]

    @property
    def final_hw(self) -> tuple[int, int]:
        return self.warp.out_hw if self.warp is not None else self.out_hw

    def rows(self, a: int, b: int, any_flip: bool, number: int = 0) -> Params:
        """Samples a..b, batch `number` of an epoch's parameters: views on whatever device they are."""
        out_hw = self.out_hw if self.batch_hw is None else self.batch_hw[number]
        return replace(self.take(slice(a, b)), any_flip=any_flip, out_hw=out_hw, batch_hw=None)

    def take(self, rows: torch.Tensor | slice) -> Params:
        """The parameters of samples `rows` (int64 positions, or a slice), in that order. Positions on the
        host go to each parameter's device without waiting (`upload`): a tensor on a GPU indexed with host
        positions copies them itself and waits for its stream, the training step queued there included
        (a video Loader's consumer took each batch's parameters so: a sync with the GPU every step)."""
        moved: dict[torch.device, torch.Tensor] = {}

        def at(t: torch.Tensor) -> torch.Tensor | slice:
            if isinstance(rows, slice) or rows.device == t.device:
                return rows
            if t.device not in moved:
                moved[t.device] = upload(rows, t.device)
            return moved[t.device]

        pick = lambda t: None if t is None else t[at(t)]  # noqa: E731
        warp = None if self.warp is None else replace(self.warp, matrices=self.warp.matrices[:, at(self.warp.matrices)])
        return replace(
            self,
            boxes=self.boxes[at(self.boxes)],
            flip=self.flip[at(self.flip)],
            pixel=pick(self.pixel),
            vflip=pick(self.vflip),
            warp=warp,
            choices=pick(self.choices),
            seeds=pick(self.seeds),
            content=pick(self.content),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False, boxes: bool = True) -> Params:
        """On `device` (the boxes and horizontal flips stay where they are unless `boxes`)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        keep = lambda t: t.to(device, non_blocking=non_blocking) if boxes else t  # noqa: E731  (boxes, flip: never None)
        return replace(
            self,
            boxes=keep(self.boxes),
            flip=keep(self.flip),
            pixel=move(self.pixel),
            vflip=move(self.vflip),
            warp=None if self.warp is None else self.warp.to(device, non_blocking),
            content=move(self.content),
        )
