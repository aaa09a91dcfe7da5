"""A clip's frames decoded by the GPU's video engines (NVDEC), through TorchCodec's CUDA decoding (its
"beta" backend: NVCUVID driven directly, FFmpeg only demuxing), to RGB on the device.

Chosen by measurement (issue 67; an H100 host, 568x320 H.264 at GOP 32, 16-frame clips at stride 2):
TorchCodec's beta backend on threads of one process decoded 47 clips/s on one thread, 184 on 4, 305-313
on 8 and 305-372 on 16, from the store's bytes as from the file, with 140 MB of GPU memory; its
frames are within 3 levels of the CPU decode (1.1 on average: NVDEC's own colour conversion).
PyNvVideoCodec 2.2.4 gave 46 clips/s (a decoder a process, reconfigured per file, 8 processes), 14
(a decoder a clip from bytes) and 84 with its demuxer and decoder driven from Python; TorchCodec's
FFmpeg backend 14; DALI's video reader 83.

Each clip opens its whole video (TorchCodec's exact seek mode scans the file's packets first): cheap
for clips of seconds-long videos, a cost that grows with a video's length.

TorchCodec is an optional install (`pip install torchcodec`, with FFmpeg's shared libraries and NPP
where it runs: torchcodec's own requirements); imported only when a Loader asks for NVDEC.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch


class NvdecUnavailable(RuntimeError):
    """NVDEC can't decode here: why (no CUDA device, TorchCodec missing or failing to load)."""


@dataclass(frozen=True)
class NvdecClip:
    """One clip for the GPU's video engines: its video's bytes (the whole file, as the store holds it),
    the frames wanted (indices into its frames in presentation order, repeats allowed) and the size its
    frames have in the store (checked against what the decoder gives)."""

    data: memoryview | bytes | np.ndarray
    frames: np.ndarray
    height: int
    width: int


def open_torchcodec():
    """TorchCodec's VideoDecoder and set_cuda_backend, or NvdecUnavailable saying why not."""
    try:
        from torchcodec.decoders import VideoDecoder, set_cuda_backend
    except Exception as e:  # noqa: BLE001  (not installed, or its FFmpeg/NPP libraries don't load)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise NvdecUnavailable(
            f"TorchCodec does not import ({type(e).__name__}: {first}); pip install torchcodec, with "
            "FFmpeg's shared libraries and NVIDIA NPP for this CUDA"
        ) from None
    if _version().endswith("+cpu"):  # PyPI's wheels; the CUDA builds say "+cu130" and the like
        raise NvdecUnavailable(_cpu_build())
    return VideoDecoder, set_cuda_backend


def _version() -> str:
    import torchcodec

    return str(getattr(torchcodec, "__version__", "?"))


def _cpu_build() -> str:
    return (
        f"TorchCodec {_version()} is built without CUDA: install a CUDA build for this CUDA (pip install "
        "torchcodec --index-url https://download.pytorch.org/whl/cu130, or your CUDA's index)"
    )


_streams = threading.local()  # each decoding thread's own CUDA stream


def _own_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream on `device`: TorchCodec maps the engines' frames and converts them on the
    current stream, and a thread's current stream is otherwise the default one, where a training loop
    queues its steps (a clip would wait behind them, and its synchronize for all of them)."""
    stream = getattr(_streams, "stream", None)
    if stream is None or stream.device != device:
        stream = _streams.stream = torch.cuda.Stream(device)
    return stream


def decode_on_gpu(clip: NvdecClip, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The clip's frames as (T, H, W, 3) uint8 RGB on `device` (decoded there when it is a CUDA device,
    on this thread's own stream, finished before this returns; a CPU device decodes with TorchCodec's
    CPU path, for tests); and whether TorchCodec fell back to its CPU decoder (a codec NVDEC does not
    take)."""
    VideoDecoder, set_cuda_backend = open_torchcodec()
    data = torch.from_numpy(np.frombuffer(clip.data, np.uint8).copy())  # (a writable copy: TorchCodec keeps it)
    cuda = device.type == "cuda"
    stream = _own_stream(device) if cuda else None
    with set_cuda_backend("beta") if cuda else contextlib.nullcontext(), torch.cuda.stream(stream):
        try:
            decoder = VideoDecoder(data, device=str(device), dimension_order="NHWC", seek_mode="exact")
        except RuntimeError as e:  # a build without CUDA whose version does not say so
            if cuda and "Unsupported device" in str(e):
                raise NvdecUnavailable(_cpu_build()) from None
            raise
        frames = decoder.get_frames_at(indices=[int(i) for i in clip.frames]).data
    if tuple(frames.shape[1:3]) != (clip.height, clip.width):
        raise ValueError(f"frames of {tuple(frames.shape[1:3])}, the store says {(clip.height, clip.width)}")
    if stream is not None:
        stream.synchronize()
    fallback = getattr(decoder, "cpu_fallback", False)
    return frames, bool(fallback)
