"""The Loader's settings that its parts need, as small frozen values passed down (no part holds the
Loader): what each batch becomes (`Output`) and how a jpeg store's batches are decoded (`Decoding`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpufeed.augment.pipeline import Augment
from gpufeed.decode.tuning import Tuning


@dataclass(frozen=True)
class Output:
    """What each batch becomes: on `device`, through `augment` (None: uint8 as stored), as `dtype`,
    NHWC-strided with `channels_last`."""

    device: torch.device
    augment: Augment | None
    dtype: torch.dtype
    channels_last: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class Decoding:
    """How a jpeg store's batches are decoded: the decoders (None: the default), the CPU decode
    worker processes (0: threads of this process instead), what an undecodable sample becomes
    (`on_error`), the batch size the GPU decoders make room for, and the measured settings."""

    decoders: tuple[str, ...] | None
    workers: int
    on_error: str
    batch_size: int
    tuning: Tuning
