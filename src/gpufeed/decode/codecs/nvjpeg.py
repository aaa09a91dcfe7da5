"""Batched GPU JPEG decoding with nvJPEG, through `torchvision.io.decode_jpeg(list, device=...)`.

The GPU decoder where nvImageCodec is missing. torchvision deprecated its image codecs in 0.29 (for
TorchCodec) and may remove them; nothing else that gpufeed depends on calls nvJPEG in batches, so this
stays on torchvision while torchvision has it. Where it doesn't, `problem` says so (`gpufeed doctor`
prints it) and making the decoder raises ImportError with the same words.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import numpy as np
import torch

from gpufeed.decode.base import CUT_SHORT, Decoded, Encoded, in_place, nvimgcodec_install


def _torchvision_decode_jpeg():
    """(torchvision.io.decode_jpeg, its RGB mode), imported here: torchvision's import brings
    torch._dynamo's, seconds that a loader with other decoders never needs. ImportError saying why
    and what to install where this torchvision has no such function."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        try:
            which = f"torchvision {version('torchvision')} has no torchvision.io.decode_jpeg ({e})"
        except PackageNotFoundError:
            which = "torchvision is not installed"
        raise ImportError(
            f"nvJPEG through torchvision is unavailable: {which}; nvImageCodec's GPU decoders "
            f"replace it ({nvimgcodec_install()})"
        ) from e
    return decode_jpeg, ImageReadMode.RGB


def problem() -> str | None:
    """Why the `nvjpeg` decoder can't be made here, or None if torchvision has its decoder."""
    try:
        _torchvision_decode_jpeg()
    except ImportError as e:
        return str(e)
    return None


class NvJpegDecoder:
    """Decodes a list of JPEGs on the GPU in one batched call; images it rejects are reported."""

    name = "nvjpeg"

    def __init__(self, device: torch.device):
        self.device = device
        self._decode_jpeg, self._rgb = _torchvision_decode_jpeg()

    def decode(self, batch: Encoded, shapes: np.ndarray | None = None) -> Decoded:
        """Decode to CHW images on the device, addressed in place (`shapes`: the sizes the store
        records, see `in_place`)."""
        batch = batch.readable()
        cut = batch.cut_short()  # nvJPEG fills a cut file with gray: the CPU decides instead
        failed = {k: CUT_SHORT for k in np.flatnonzero(cut).tolist()}
        datas = [d for d, c in zip(batch.tensors(), cut.tolist()) if not c]
        try:
            images = self._decode_jpeg(datas, mode=self._rgb, device=self.device) if datas else []
        except RuntimeError:  # one bad image fails the batch call: find it, keep the rest
            images = []
            for k, d in zip(np.flatnonzero(~cut).tolist(), datas):
                try:
                    images.append(self._decode_jpeg(d, mode=self._rgb, device=self.device))
                except RuntimeError as e:
                    failed[k] = f"nvJPEG: {e}".splitlines()[0]
        return in_place(images, failed, shapes)
