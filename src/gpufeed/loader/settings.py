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
    (`on_error`), the batch size the GPU decoders make room for, the measured settings, and whether
    the pass is an evaluation (`exact`): each sample at most once, an undecodable one left out of its
    batch and reported rather than replaced by another.

    The one user number `num_workers` sizes three things, each named here once: `workers` (the
    processes), `cpu_threads` (each pipeline's CPU decode threads where there are no processes, or for
    what they can't take: the same cores, split among the pipelines) and `host_threads` (nvImageCodec's
    host threads for its GPU decoders' parsing, at least two)."""

    decoders: tuple[str, ...] | None
    workers: int
    on_error: str
    batch_size: int
    tuning: Tuning
    exact: bool = False
    fields: bool = False  # the batches carry per-sample fields, read from the shards their images came from

    @property
    def cpu_threads(self) -> int:
        return max(1, self.workers // self.tuning.pipelines)

    @property
    def host_threads(self) -> int:
        return max(2, self.cpu_threads)


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, with the current CUDA device's index; ValueError where it can't be used."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} asked for, but CUDA is not available here (a CPU-only torch or "
                'no NVIDIA driver; `gpufeed doctor` says which): pass device="cpu" to run on the CPU'
            )
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: gpufeed runs on 'cuda' or 'cpu'")
    return dev
