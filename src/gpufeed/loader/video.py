"""A video store's batches: each batch's clips decoded on CPU threads (PyAV, which lets go of the GIL
while FFmpeg decodes) into a page-locked slot, copied to the device on the side stream, and augmented
by the Loader as one batch of N x T frames whose parameters repeat per clip, so every frame of a clip
gets the same crop, flip and colour draw and each clip its own.

What runs where: the producer thread (`producer.threaded`, `prefetch` batches ahead) asks the decode
threads (`gpufeed-video`, one pool per Loader) for a batch's clips, each clip written into its rows of
the slot; then it queues the copy and hands the batch over with the copy's event. The consumer's
`Loader._augment` runs the augment chain on the frames and shapes them (N, T, C, H, W) or
(N, C, T, H, W).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from gpufeed.decode.codecs.video import I420, ClipRequest, decode_clip_planes
from gpufeed.loader.batch import Batch
from gpufeed.loader.clips import Clip, Timeline, clip_frames, positions
from gpufeed.loader.plan import EpochPlan
from gpufeed.loader.producer import Made, Production, threaded
from gpufeed.loader.stats import stage_range
from gpufeed.sources.videos import VideoError
from gpufeed.transfer.ring import PinnedRing


class VideoDecodeError(RuntimeError):
    """A stored video did not decode to the frames its index holds (the store changed or is damaged)."""


@dataclass(frozen=True)
class ClipBatch:
    """Which clips a batch holds: each sample's video (store index) and frames (N, T) in the video."""

    videos: np.ndarray
    frames: np.ndarray


class VideoClips:
    """A Loader's clips of a video store: which frames each sample holds (`Clip`, the epoch's
    positions), and the threads and page-locked slots that decode them."""

    def __init__(self, store, clip: Clip, seed: int, device: torch.device, threads: int | None, batch_size: int):
        self.store, self.clip, self.seed, self.device = store, clip, seed, device
        self.threads = threads or len(os.sched_getaffinity(0))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-video")
        shapes = np.asarray(store.shapes)
        self.max_hw = (int(shapes[:, 0].max()), int(shapes[:, 1].max())) if len(shapes) else (2, 2)
        self.layout = I420.fitting(*self.max_hw)  # what the threads write: the frames' 4:2:0 planes
        self.batch_size = batch_size
        self._ring: PinnedRing | None = None
        self._positions: tuple[int, np.ndarray] | None = None

    @property
    def items(self) -> int:
        """Samples an epoch: videos x clips per video."""
        return len(self.store) * self.clip.per_video

    def item_videos(self, items: np.ndarray) -> np.ndarray:
        return np.asarray(items, np.int64) // self.clip.per_video

    def timeline(self, video: int) -> Timeline:
        index = self.store.video(video)
        first, end = self.store.clip_range(video)
        return Timeline(index.seconds, first, end)

    def clips(self, epoch: int, items: np.ndarray) -> ClipBatch:
        """The clips of samples `items` (sampler indices) in `epoch`."""
        if self._positions is None or self._positions[0] != epoch:
            self._positions = (epoch, positions(self.clip, self.seed, epoch, len(self.store)))
        where = self._positions[1]
        videos = self.item_videos(items)
        spot = where[videos] if self.clip.clips_per_video is None else where[np.asarray(items, np.int64)]
        frames = np.stack([clip_frames(self.clip, self.timeline(int(v)), float(p)) for v, p in zip(videos, spot)])
        return ClipBatch(videos, frames.reshape(len(videos), self.clip.frames))

    def _request(self, video: int, frames: np.ndarray) -> ClipRequest:
        store = self.store
        a, b = int(store.offsets[video]), int(store.offsets[video + 1])
        index = store.video(video)
        return ClipRequest(memoryview(store.data[a:b]), index.pts, index.keyframe, index.stream, frames)

    def decode(self, batch: ClipBatch, out: torch.Tensor) -> None:
        """Each clip's frames into its T slabs of `out` ((N * T, *self.layout.shape) uint8 on the host), on
        the threads."""
        t = self.clip.frames
        view = out.numpy()

        def one(k: int) -> None:
            video = int(batch.videos[k])
            try:
                decode_clip_planes(self._request(video, batch.frames[k]), self.layout, view[k * t : (k + 1) * t])
            except VideoError as e:
                raise VideoDecodeError(f"{self.store.path}: video {video} ({self.store.source(video)}): {e}") from None

        for _ in self._pool.map(one, range(len(batch.videos))):
            pass

    def ring(self, prefetch: int) -> PinnedRing:
        """The page-locked slots batches are decoded into (made at the first pass: pinning is slow)."""
        if self._ring is None:
            frames = self.batch_size * self.clip.frames
            self._ring = PinnedRing(prefetch + 2, self.layout.shape, frames, pin=self.device.type == "cuda")
        return self._ring

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def video_feed(
    plan: EpochPlan,
    start: int,
    epoch: int,
    clips: VideoClips,
    labels: torch.Tensor,
    production: Production,
    stream: torch.cuda.Stream | None,
) -> Iterator[Batch]:
    """The epoch's batches of clips from batch `start`, made `prefetch` ahead on the producer thread."""
    device = clips.device
    on_device = plan
    if stream is not None:
        with torch.cuda.stream(stream):
            on_device = plan.to(device)
            uploaded = stream.record_event()
        torch.cuda.current_stream(device).wait_event(uploaded)
    ring = clips.ring(production.prefetch)
    t = clips.clip.frames

    def make(number: int, worker: int) -> Made:
        items, _ = plan.batch(number)
        params = on_device.batch(number)[1]
        batch = clips.clips(epoch, items.numpy())
        n = len(items)
        t0 = time.perf_counter()
        k = ring.acquire()
        host = ring.images[k][: n * t]
        with stage_range("gpufeed.decode", stream is not None):
            clips.store.check_unchanged()  # a file cut short under its map: an error, not SIGBUS
            clips.decode(batch, host)
        production.counters.add("decode", time.perf_counter() - t0, n * t)
        if params is not None:  # one draw per clip, the same for each of its frames
            params = params.take(torch.arange(n).repeat_interleave(t))
        mine = labels.index_select(0, torch.as_tensor(batch.videos))
        if stream is None:
            return Made(Batch(i420_to_rgb(host, clips.layout), mine, params, samples=items), None)
        with torch.cuda.stream(stream):
            images = i420_to_rgb(host.to(device, non_blocking=True), clips.layout)
            mine = mine.to(device, non_blocking=True)
            event = stream.record_event()
        ring.release(k, event)
        return Made(Batch(images, mine, params, samples=items), event)

    return threaded(production, make, range(start, len(plan)), len(plan))


VIDEO_FIELDS = ("label", "video", "frames")

# BT.601 limited range to RGB (FFmpeg's default for its RGB conversion): rows R, G, B over (Y - 16,
# U - 128, V - 128)
_BT601 = ((1.164, 0.0, 1.596), (1.164, -0.392, -0.813), (1.164, 2.017, 0.0))


def i420_to_rgb(slabs: torch.Tensor, layout: I420) -> torch.Tensor:
    """(N, H, W, 3) uint8 RGB from (N, *layout.shape) `I420` slabs, on their device: chroma taken at
    each 2x2 block (nearest), then BT.601: a few torch ops, on a GPU on the copy stream."""
    h, w = layout.height, layout.width
    y = slabs[:, :h].float() - 16.0
    chroma = slabs[:, h:].float() - 128.0
    u = chroma[:, :, : w // 2].repeat_interleave(2, 1).repeat_interleave(2, 2)
    v = chroma[:, :, w // 2 :].repeat_interleave(2, 1).repeat_interleave(2, 2)
    m = _BT601
    rgb = torch.stack([m[c][0] * y + m[c][1] * u + m[c][2] * v for c in range(3)], dim=-1)
    return rgb.round_().clamp_(0, 255).to(torch.uint8)


def check_video(store, clip: Clip | None, fields: tuple[str, ...] | None, augment, group_by_aspect) -> Clip | None:
    """The clips a Loader of `store` yields (`Clip()` for a video store not given one; None for an image
    store, which refuses `clip`), and ValueError for what a video Loader does not do."""
    if store.mode != "video":
        if clip is not None:
            raise ValueError(f"{store.path}: clip= is for a video store (pack mode='video'), this one is {store.mode}")
        return None
    clip = Clip() if clip is None else clip
    if not isinstance(clip, Clip):
        raise ValueError(f"{store.path}: clip must be a gpufeed.Clip, got {clip!r}")
    unknown = [f for f in fields or () if f not in VIDEO_FIELDS]
    if unknown:
        raise ValueError(f"{store.path}: a video store's batches have the fields {VIDEO_FIELDS}, not {unknown}")
    if group_by_aspect is not False:
        raise ValueError(f"{store.path}: group_by_aspect is for images; a video store's clips take ops to one size")
    from gpufeed.augment.mix import CutMix, MixUp, MixUpOrCutMix

    if any(isinstance(op, (MixUp, CutMix, MixUpOrCutMix)) for op in augment or ()):
        raise ValueError(f"{store.path}: MixUp and CutMix mix images; they are not applied to clips")
    return clip


def video_batch_dict(fields: tuple[str, ...], clips: torch.Tensor, labels: torch.Tensor, which: ClipBatch) -> dict:
    """A video batch as a dict: "image" (the clips) and each of `fields` ("video", "frames" on the
    batch's device)."""
    out: dict = {"image": clips}
    for name in fields:
        if name == "label":
            out["label"] = labels
        elif name == "video":
            out["video"] = torch.from_numpy(which.videos).to(clips.device, non_blocking=True)
        else:
            out["frames"] = torch.from_numpy(which.frames).to(clips.device, non_blocking=True)
    return out
