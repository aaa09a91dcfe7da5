"""A clip's frames from a stored video, decoded on the CPU with PyAV (FFmpeg): seek to the keyframe at
or before the clip's first frame (the store's index says where), decode forward, keep the frames the
clip asks for and stop after its last. Torch-free, so a decode thread or process needs nothing else.

FFmpeg decodes with the GIL released (PyAV's decode and its colour conversion run outside it), so a
pool of threads in the loader's process decodes clips in parallel.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from gpufeed.sources.videos import VideoError, pyav


@dataclass(frozen=True)
class ClipRequest:
    """What one clip's decode needs: the video's bytes, its frames' pts and keyframe flags (presentation
    order, from the store), the video stream's index, and the frames wanted (indices into those, in
    the clip's order; repeats allowed: a short video's last frame stands for those past its end)."""

    data: memoryview | bytes
    pts: np.ndarray
    keyframe: np.ndarray
    stream: int
    frames: np.ndarray


def decode_clip(request: ClipRequest, out: np.ndarray | None = None) -> np.ndarray:
    """The clip's frames as (T, H, W, 3) uint8 RGB (into `out` where given, at its top left). Raises
    VideoError where the video decodes to fewer of the wanted frames than its index holds."""
    av = pyav()
    wanted = request.frames
    first, last = int(wanted.min()), int(wanted.max())
    keys = np.flatnonzero(request.keyframe[: first + 1])
    start = int(keys[-1]) if len(keys) else 0
    need = {int(request.pts[i]): i for i in np.unique(wanted)}
    stop = int(request.pts[last])
    got: dict[int, np.ndarray] = {}
    with av.open(io.BytesIO(request.data), mode="r", metadata_errors="ignore") as container:
        stream = container.streams[request.stream]
        stream.thread_type = "SLICE"  # frame threads would hold frames back; clips run in parallel instead
        if start > 0:
            container.seek(int(request.pts[start]), stream=stream, backward=True, any_frame=False)
        try:
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                i = need.get(frame.pts)
                if i is not None:
                    got[i] = frame.to_ndarray(format="rgb24")
                if frame.pts >= stop:
                    break
        except av.FFmpegError as e:
            raise VideoError(f"damaged: {e}") from None
    missing = [int(i) for i in np.unique(wanted) if int(i) not in got]
    if missing:
        raise VideoError(f"frames {missing[:4]} of the index not decoded (the file changed or is damaged)")
    h, w = got[first].shape[:2]
    if out is None:
        out = np.empty((len(wanted), h, w, 3), np.uint8)
    for t, i in enumerate(wanted):
        out[t, :h, :w] = got[int(i)]
    return out
