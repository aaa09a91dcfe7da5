"""`Clip`: what a Loader of a video store yields per sample, and which frames each clip holds.

A sample of a video Loader is a clip: `frames` frames of one video, `stride` frames apart (or at
`fps`, by the frames' presentation times). For training (`clips_per_video=None`) each video gives
one clip per epoch, at a start drawn from (seed, epoch, video); for evaluation each video gives
`clips_per_video` clips spread evenly over it, every one exactly once (the sampler's items are
(video, clip) pairs). A video shorter than a clip repeats its last frame. A pure function of
(seed, epoch): resumed and resharded jobs get the same clips.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUTS = ("NTCHW", "NCTHW")


@dataclass(frozen=True)
class Clip:
    """Clips of `frames` frames, `stride` frames apart, or at `fps` frames a second of the video's own
    time (then `stride` is unused; a variable frame rate is followed); `clips_per_video`: None for
    one clip a video at a random start each epoch (training), k for k evenly spread clips a video,
    each a sample (evaluation: 3 or 10 for Kinetics' multi-clip testing); `layout`: the batch's axes,
    "NTCHW" (torchvision's video models take NCTHW: pass that)."""

    frames: int = 16
    stride: int = 1
    fps: float | None = None
    clips_per_video: int | None = None
    layout: str = "NTCHW"

    def __post_init__(self) -> None:
        if not _count(self.frames):
            raise ValueError(f"Clip.frames must be a positive int, got {self.frames!r}")
        if not _count(self.stride):
            raise ValueError(f"Clip.stride must be a positive int, got {self.stride!r}")
        fps = self.fps
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000):
            raise ValueError(f"Clip.fps must be in (0, 1000] frames a second, got {self.fps!r}")
        k = self.clips_per_video
        if k is not None and not _count(k):
            raise ValueError(f"Clip.clips_per_video must be None (training) or a positive int, got {k!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Clip.layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def per_video(self) -> int:
        """Samples each video gives an epoch."""
        return self.clips_per_video or 1


def _count(value: object) -> bool:
    """A positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Timeline:
    """What picking a video's frames needs: each frame's time in seconds (presentation order) and the
    frames [first, end) its clips come from."""

    seconds: np.ndarray
    first: int
    end: int


def clip_frames(clip: Clip, video: Timeline, position: float) -> np.ndarray:
    """The frame indices (into the video's frames, int64, `clip.frames` of them) of the clip at
    `position` in [0, 1]: 0 starts at the range's first frame, 1 ends at its last (or starts there
    where the clip is longer than the range, its last frame repeated)."""
    first, end = video.first, video.end
    if clip.fps is None:
        span = (clip.frames - 1) * clip.stride + 1
        room = max(0, end - first - span)
        start = first + int(round(position * room))
        picked = start + np.arange(clip.frames, dtype=np.int64) * clip.stride
    else:
        t = video.seconds
        length = (clip.frames - 1) / clip.fps
        spare = max(0.0, float(t[end - 1] - t[first]) - length)
        ticks = t[first] + position * spare + np.arange(clip.frames) / clip.fps
        # the frame on screen at each tick: the last one shown at or before it
        picked = np.searchsorted(t[first:end], ticks + 1e-9, side="right").astype(np.int64) - 1 + first
    return np.clip(picked, first, end - 1)


def positions(clip: Clip, seed: int, epoch: int, videos: int) -> np.ndarray:
    """Each sample's clip position in [0, 1] for an epoch: item i is video i // per_video's clip
    i % per_video. Training: drawn from (seed, epoch), one per video; evaluation: evenly spread."""
    k = clip.clips_per_video
    if k is None:
        return np.random.default_rng([seed, epoch, 0x5EED_C11F]).random(videos)
    spread = np.full(k, 0.5) if k == 1 else np.linspace(0.0, 1.0, k)
    return np.tile(spread, videos)
