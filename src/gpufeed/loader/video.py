"""A video store's batches: each batch's clips decoded on the CPU (PyAV) by decode processes, each
writing its share's frames as 4:2:0 planes into the batch's shared page-locked slot; the slot copied
to the device on the side stream and turned to RGB there (`i420_to_rgb`), then augmented by the
Loader as one batch of N x T frames whose parameters repeat per clip, so every frame of a clip gets
the same crop, flip and colour draw and each clip its own.

What runs where: the producer thread (`producer.threaded`, `prefetch` batches ahead) hands a batch's
clips to the decode processes (`VideoClips`; `num_workers=0`: threads of this process) as named
`ClipTask`s, waits for them, queues the copy and the conversion, and hands the batch over with the
copy's event. The consumer's `Loader._augment` runs the augment chain on the frames and shapes them
(N, T, C, H, W) or (N, C, T, H, W).

With `decoders=("nvdec", "cpu")` on a GPU, part of each batch's clips goes to the GPU's video engines
instead (`decode.codecs.nvdec`: TorchCodec's CUDA decoding on `Tuning.nvdec_threads` threads of this
process, RGB on the device), at the same time as the processes decode the rest; the part follows the
two sides' measured rates (`NvdecSide`). Their frames are written over their clips' places after the
slot's conversion, on the copy stream.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from gpufeed.decode.codecs.nvdec import NvdecClip, NvdecUnavailable, decode_on_gpu, open_torchcodec
from gpufeed.decode.codecs.video import (
    I420,
    ClipJob,
    ClipTask,
    Packets,
    decode_jobs,
    keyframe_before,
    run_clip_task,
)
from gpufeed.decode.pool.segment import Segment
from gpufeed.decode.tuning import Tuning
from gpufeed.loader.batch import Batch
from gpufeed.loader.clips import Clip, Timeline, clip_frames, positions
from gpufeed.loader.cores import rank_cores
from gpufeed.loader.plan import EpochPlan
from gpufeed.loader.producer import Carried, Made, Make, NextEpoch, Production, threaded
from gpufeed.loader.stats import stage_range
from gpufeed.logs import logger
from gpufeed.processes import process_pool
from gpufeed.sources.videos import VideoError
from gpufeed.store.format import JPEG_DATA, VIDEO_DECODERS, VideoIndex
from gpufeed.transfer.ring import Turns, hand_over
from gpufeed.transfer.upload import upload

SLOTS_WARN = 8 << 30  # page-locked bytes of decode slots above which a Loader says so when it is made

log = logger(__name__)


class VideoDecodeError(RuntimeError):
    """A stored video did not decode to the frames its index holds (the store changed or is damaged)."""


@dataclass(frozen=True)
class ClipBatch:
    """Which clips a batch holds: each sample's video (store index) and frames (N, T) in the video."""

    videos: np.ndarray
    frames: np.ndarray
    indexes: tuple[VideoIndex, ...]  # each clip's video's frame index, read once for the batch


@dataclass(frozen=True)
class GpuFrames:
    """A clip the GPU's video engines decoded: its place in the batch and its (T, H, W, 3) frames."""

    position: int
    frames: torch.Tensor


class NvdecSide:
    """The GPU's video engines beside the decode processes: `threads` threads of this process, each
    decoding a clip at a time (`decode.codecs.nvdec`), and the part of each batch they take: the two
    sides' rates in clips/s (exponential averages of each batch's, both sides decoding at once) set
    it, so that both finish together; one clip a batch at least while the processes decode too, so
    their rate stays measured. The first failure (or TorchCodec falling back to its CPU decoder) is
    said once and turns the engines off for the Loader; its clips decode on the processes."""

    SMOOTHING = 0.25

    def __init__(self, threads: int, device: torch.device, cpu_too: bool):
        self.threads, self.device, self.cpu_too = threads, device, cpu_too
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gpufeed-nvdec")
        self._lock = threading.Lock()
        self.rates = {"gpu": 300.0, "cpu": 300.0}  # clips/s until measured (an H100 host's order of each)
        self.clips = {"gpu": 0, "cpu": 0}
        self.off: str | None = None  # why the engines stopped, once they did

    def part(self, n: int) -> int:
        """Clips of a batch of `n` for the engines."""
        if self.off is not None or n == 0:
            return 0
        if not self.cpu_too:
            return n
        with self._lock:
            share = self.rates["gpu"] / (self.rates["gpu"] + self.rates["cpu"])
        return min(n - 1, max(1, round(n * share))) if n > 1 else 0

    def measured(self, side: str, clips: int, seconds: float) -> None:
        if clips == 0 or seconds <= 0:
            return
        with self._lock:
            old = self.rates[side]
            self.rates[side] = old + self.SMOOTHING * (clips / seconds - old)
            self.clips[side] += clips

    def submit(self, clip: NvdecClip):
        """A future of (frames, whether TorchCodec fell back to the CPU, when it finished)."""
        return self._pool.submit(_timed, clip, self.device)

    def stop(self, why: str) -> bool:
        """Turn the engines off (True the first time: the caller says why)."""
        with self._lock:
            first, self.off = self.off is None, self.off or why
        return first

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _timed(clip: NvdecClip, device: torch.device) -> tuple[torch.Tensor, bool, float]:
    return (*decode_on_gpu(clip, device), time.perf_counter())


def clip_packets(index: VideoIndex, first: int, last: int) -> Packets | None:
    """The packets decoding frames [`first`, `last`] (presentation order) of video `index` needs,
    `first` a keyframe: every packet from `first`'s to the last in file order of a frame among
    them (a B-frame's later reference comes before it); None where the video decodes through its
    container (`index.packet_at` None)."""
    at = index.packet_at
    if at is None:
        return None
    low, high = at[first], at[first : last + 1].max()
    pick = np.flatnonzero((at >= low) & (at <= high))
    pick = pick[np.argsort(at[pick], kind="stable")]
    rows = np.stack([at[pick], index.packet_bytes[pick], index.pts[pick]], axis=1).astype(np.int64)
    return Packets(index.codec, index.extradata, rows)


def _through_container(store) -> int:
    """How many of `store`'s videos decode through their containers rather than from their packets
    alone (`decode.codecs.video`), said when a Loader is made where there are any: it is slower."""
    count = store.through_container()
    if store.decoding is None:
        why = "the store was packed before gpufeed kept where each packet lies; pack it again"
    else:
        why = (
            f"their codecs are not among {', '.join(VIDEO_DECODERS)} or their packets do not lie in their files "
            "as they are; pack with gop= (or short_side=) re-encodes them as H.264 in MP4"
        )
    if count:
        log.warning(
            "gpufeed: %s: %d of %d videos decode through their containers, about a tenth slower a clip on "
            "the CPU than from their packets alone: %s",
            store.path,
            count,
            len(store),
            why,
        )
    return count


def check_video_decoders(decoders: tuple[str, ...] | None) -> tuple[str, ...]:
    """The names of a video Loader's `decoders` (None: the CPU's), or ValueError."""
    names = tuple(decoders) if decoders is not None else ("cpu",)
    wrong = [d for d in names if d not in ("nvdec", "cpu")] or ([] if names else ["(none)"])
    if wrong:
        raise ValueError(f"a video store's decoders are among 'nvdec' and 'cpu', got {wrong}")
    return names


def nvdec_side(
    decoders: tuple[str, ...] | None, device: torch.device, threads: int
) -> tuple[NvdecSide | None, str | None]:
    """The engines' side a video Loader of `decoders` decodes with on `device`, or None, with a note
    where "nvdec" was asked for and can't be used (a CPU device, TorchCodec missing). ValueError
    where nothing would decode."""
    names = check_video_decoders(decoders)
    if "nvdec" not in names:
        return None, None
    if device.type != "cuda":
        why = "nvdec ignored on a CPU device: clips decode on the CPU"
    else:
        try:
            open_torchcodec()
            return NvdecSide(threads, device, cpu_too="cpu" in names), None
        except NvdecUnavailable as e:
            why = f"nvdec unavailable: {e}; clips decode on the CPU"
    return None, why


class VideoClips:
    """A Loader's clips of a video store: which frames each sample holds (`Clip`, the epoch's
    positions), and the decode processes (or threads) and shared page-locked slots that decode them.

    `workers` > 0: that many decode processes (`processes.process_pool`: spawned where this process
    has threads, ended with it), a task a clip, each writing its frames' planes straight into the
    batch's slot (a memfd `Segment`, page-locked on a GPU); 0: threads of this process (FFmpeg decodes
    outside the GIL, but the frame loop holds it: on the 2-core development box 4 threads gave 134
    clips/s, 4 processes 159; 16 threads 94)."""

    def __init__(
        self,
        store,
        clip: Clip,
        seed: int,
        device: torch.device,
        workers: int | None,
        batch_size: int,
        tuning: Tuning,
        nvdec: NvdecSide | None = None,
    ):
        self.store, self.clip, self.seed, self.device = store, clip, seed, device
        self.skip_nonref = tuning.skip_nonref
        # batches decoded at once, a producer thread each (`Tuning.clip_batches`): the processes start the
        # next ones' clips while a batch's last clips decode and while its producer copies it out
        batches = tuning.clip_batches
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
            raise ValueError(f"Tuning.clip_batches must be an int, 1 or more, got {batches!r}")
        self.batches = batches
        self.nvdec = nvdec  # the GPU's video engines beside the processes, or None
        self.niceness = tuning.decode_nice  # the decode processes'
        cores = rank_cores().usable  # (this rank's share of the machine, within a cgroup quota)
        self.workers = cores if workers is None else workers
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            raise ValueError(f"num_workers must be an int, 0 or more, got {workers!r}")
        self.threads = self.workers or cores  # the clips a batch decodes at once
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-video") if self.workers == 0 else None
        self._processes: ProcessPoolExecutor | None = None  # started at the first pass
        shapes = np.asarray(store.shapes)
        self.max_hw = (int(shapes[:, 0].max()), int(shapes[:, 1].max())) if len(shapes) else (2, 2)
        self.layout = I420.fitting(*self.max_hw)  # what the decoders write: the frames' 4:2:0 planes
        self.batch_size = batch_size
        self._slots: list[Segment] = []
        self._turns: Turns | None = None  # the slots' order and their copies' events
        self._taking = threading.Lock()  # (the producer threads make the slots and count in turn)
        # the data file, held open: decode processes map it through /proc, so they read the file this
        # loader reads even where a store was packed over it since (as the loader's own map does)
        self._data_path = os.fspath(store.path / JPEG_DATA)
        self._data_fd = os.open(self._data_path, os.O_RDONLY | os.O_CLOEXEC)
        self._close_data = weakref.finalize(self, os.close, self._data_fd)
        self._data_inode = os.fstat(self._data_fd).st_ino
        self._positions: dict[int, np.ndarray] = {}  # the clips' positions of the epochs being made
        self.through_container = _through_container(store)
        self.decoded = self.delivered = 0  # frames decoded, and frames the clips hold (`stats`)

    @property
    def clip_bytes(self) -> int:
        """A clip's bytes in a slot: its T frames' 4:2:0 slabs (`self.layout`)."""
        return self.clip.frames * self.layout.shape[0] * self.layout.shape[1]

    @property
    def items(self) -> int:
        """Samples an epoch: videos x clips per video."""
        return len(self.store) * self.clip.per_video

    def item_videos(self, items: np.ndarray) -> np.ndarray:
        return np.asarray(items, np.int64) // self.clip.per_video

    def timeline(self, video: int, index: VideoIndex) -> Timeline:
        first, end = self.store.clip_range(video)
        return Timeline(index.seconds, first, end)

    def clips(self, epoch: int, items: np.ndarray) -> ClipBatch:
        """The clips of samples `items` (sampler indices) in `epoch`."""
        where = self._positions.get(epoch)
        if where is None:  # (two epochs at most: an epoch's end, and the next one's first batches)
            where = positions(self.clip, self.seed, epoch, len(self.store))
            with self._taking:
                self._positions = {e: p for e, p in self._positions.items() if e in (epoch - 1, epoch + 1)}
                self._positions[epoch] = where
        videos = self.item_videos(items)
        spot = where[videos] if self.clip.clips_per_video is None else where[np.asarray(items, np.int64)]
        indexes = tuple(self.store.video(int(v)) for v in videos)
        frames = np.stack(
            [clip_frames(self.clip, self.timeline(int(v), x), float(p)) for v, x, p in zip(videos, indexes, spot)]
        )
        return ClipBatch(videos, frames.reshape(len(videos), self.clip.frames), indexes)

    def _job(self, k: int, video: int, index: VideoIndex, frames: np.ndarray) -> ClipJob:
        store = self.store
        a, b = int(store.offsets[video]), int(store.offsets[video + 1])
        at = k * self.clip_bytes
        # the index from the keyframe the decode starts at to the clip's last frame: what a task carries
        # (a long video's whole index would be pickled with each of its clips)
        k0 = keyframe_before(index.keyframe, int(frames.min()))
        part = slice(k0, int(frames.max()) + 1)
        pts, keyframe = index.pts[part], index.keyframe[part]
        return ClipJob(
            video,
            a,
            b - a,
            pts,
            keyframe,
            index.stream,
            frames - k0,
            at,
            whole=k0 == 0,
            skip_nonref=index.nonref_exact if self.skip_nonref is None else self.skip_nonref,
            packets=clip_packets(index, k0, int(frames.max())),
        )

    def _jobs(self, batch: ClipBatch, which: list[int]) -> list[ClipJob]:
        """The decode jobs of clips `which` of `batch`. Clips of one video next to each other in the
        batch (an evaluation's, in order) are decoded in one pass where the next one's keyframe lies
        from the pass's first keyframe to the last frame it decodes already: each frame is then
        decoded once, not again from each clip's keyframe (4 clips of a 120-frame video at GOP 32: 120
        frames against 206). At most `len(which) // (decoders / self.batches)` clips a job, so that every
        decode process (or thread) still has one."""
        decoders = self.workers or self.threads
        cap = max(1, len(which) * self.batches // decoders)

        def start(j: int) -> int:  # the keyframe clip j's decode starts at
            return keyframe_before(batch.indexes[j].keyframe, int(batch.frames[j].min()))

        groups: list[list[int]] = []
        for j in which:
            group = groups[-1] if groups else None
            if (
                group is not None
                and len(group) < cap
                and group[-1] == j - 1
                and batch.videos[j] == batch.videos[group[0]]
                and start(group[0]) <= start(j) <= max(int(batch.frames[i].max()) for i in group)
            ):
                group.append(j)
            else:
                groups.append([j])
        return [
            self._job(g[0], int(batch.videos[g[0]]), batch.indexes[g[0]], np.concatenate([batch.frames[i] for i in g]))
            for g in groups
        ]

    def slot_count(self, prefetch: int) -> int:
        """Slots a Loader of this `prefetch` holds: its batches ahead, those the producers decode, one more."""
        return prefetch + self.batches + 1

    def check_memory(self, prefetch: int) -> None:
        """Say once, when the Loader is made, where the slots would take more than `SLOTS_WARN` bytes of
        page-locked memory: they are sized for the store's largest frame (one 1080p video among 256p
        ones sizes every slot for 1080p), and the fix is re-encoding with a short side."""
        nbytes = self.batch_size * self.clip_bytes
        total = nbytes * self.slot_count(prefetch)
        if total > SLOTS_WARN:
            log.warning(
                "gpufeed: %s: the decode slots take %.1f GB of page-locked memory (%d of %.2f GB: batches of "
                "%d clips of %d frames, sized for the largest frame, %dx%d); pack with short_side= (e.g. 320) "
                "or use a smaller batch_size or prefetch",
                self.store.path,
                total / 1e9,
                self.slot_count(prefetch),
                nbytes / 1e9,
                self.batch_size,
                self.clip.frames,
                *self.max_hw,
            )

    def slot(self, prefetch: int) -> tuple[int, torch.Tensor]:
        """The next shared slot (its number, its bytes as a tensor), once the last copy out of it ended;
        the slots are made at the first pass (page-locking is slow)."""
        with self._taking:
            if self._turns is None:
                nbytes = self.batch_size * self.clip_bytes
                self._slots = [Segment(nbytes, self.device) for _ in range(self.slot_count(prefetch))]
                self._turns = Turns(len(self._slots))
                if self.workers:  # (once: the producer threads take their first slots here in turn)
                    self._processes = process_pool(self.workers, self.niceness)
            turns = self._turns
        k = turns.acquire()
        return k, self._slots[k].tensor

    def stats(self) -> dict:
        """How clips are decoded and what that holds: `processes` (0: `threads` of this process) and
        their `niceness`, and the shared page-locked slots (`slots`, `slot_bytes` each, made at the
        first pass; sized for the store's largest frame, `max_hw`), and the frames decoded against
        those the clips hold (`frames_decoded`, `frames_delivered`: from each clip's keyframe, so a
        long GOP costs more; the processes' and threads' clips); the videos decoded through their
        containers rather than from their packets alone (`through_container`); `nvdec`, with the GPU's engines:
        their threads, each side's clips and rates (clips/s), and why the engines stopped, if they did."""
        return {
            "processes": self.workers,
            "niceness": self.niceness,
            "threads": 0 if self.workers else self.threads,
            "slots": len(self._slots),
            "slot_bytes": self.batch_size * self.clip_bytes,
            "max_hw": self.max_hw,
            "through_container": self.through_container,
            "frames_decoded": self.decoded,
            "frames_delivered": self.delivered,
            "nvdec": None
            if self.nvdec is None
            else {
                "threads": self.nvdec.threads,
                "clips": dict(self.nvdec.clips),
                "clips_per_s": dict(self.nvdec.rates),
                "off": self.nvdec.off,
            },
        }

    def release(self, k: int, event: torch.cuda.Event | None) -> None:
        """Slot `k` may be written again once `event` (recorded after its copy) has fired."""
        self._turns.release(k, event)  # type: ignore[union-attr]  # (a slot was taken: the turns exist)

    def decode(self, batch: ClipBatch, k: int) -> list[GpuFrames]:
        """Each clip's frames into its T slabs of slot `k` (`self.layout`), on the processes or threads;
        with the GPU's engines, the last of the batch's clips (`NvdecSide.part`) decoded there at the
        same time instead: their frames, for the caller to put in their places."""
        n = len(batch.videos)
        gpu = self.nvdec.part(n) if self.nvdec is not None else 0
        t0 = time.perf_counter()
        futures = [self._gpu_clip(j, batch) for j in range(n - gpu, n)]
        cpu = list(range(n - gpu))
        self._decode_cpu(batch, k, cpu)
        self._measured("cpu", len(cpu), time.perf_counter() - t0)
        out: list[GpuFrames] = []
        failed: list[int] = []
        finished = t0
        for j, future in zip(range(n - gpu, n), futures):
            try:
                frames, fallback, at = future.result()
            except CancelledError:  # the loader is closing
                raise
            except Exception as e:  # noqa: BLE001  (said once; the clip decodes on the processes instead)
                self._stop_nvdec(f"{type(e).__name__}: {e}")
                failed.append(j)
                continue
            if fallback:  # (its frames are good: the engines stop for the clips after it)
                self._stop_nvdec("TorchCodec fell back to its CPU decoder (a codec NVDEC does not take)")
            out.append(GpuFrames(j, frames))
            finished = max(finished, at)
        self._measured("gpu", len(out), finished - t0)
        if failed:
            self._decode_cpu(batch, k, failed)
        return out

    def _gpu_clip(self, j: int, batch: ClipBatch):
        video = int(batch.videos[j])
        h, w = (int(x) for x in self.store.shapes[video][:2])
        data = self.store.encoded(video).numpy()
        return self.nvdec.submit(NvdecClip(data, batch.frames[j], h, w))  # type: ignore[union-attr]

    def _measured(self, side: str, clips: int, seconds: float) -> None:
        if self.nvdec is not None:
            self.nvdec.measured(side, clips, seconds)

    def _stop_nvdec(self, why: str) -> None:
        if self.nvdec is not None and self.nvdec.stop(why):
            log.warning("gpufeed: %s: NVDEC decoding stopped (%s); clips decode on the CPU", self.store.path, why)

    def _decode_cpu(self, batch: ClipBatch, k: int, which: list[int]) -> None:
        if not which:
            return
        jobs = self._jobs(batch, which)
        try:
            if self._pool is not None:  # threads: this process's own maps of the store and the slot
                slot = self._slots[k].tensor.numpy()
                one = lambda job: decode_jobs(self.store.data, slot, self.layout, (job,))  # noqa: E731
                self._count(self._pool.map(one, jobs), jobs)
                return
            assert self._processes is not None  # (made with the slots)
            # a task a clip: a batch's clips differ in the frames they decode (from their keyframe on), and
            # the next batches' are queued behind them (`self.batches`), so no process waits for the slowest
            tasks = [self._task(self._slots[k], (job,)) for job in jobs]
            self._count(self._processes.map(run_clip_task, tasks), jobs)
        except VideoError as e:
            raise VideoDecodeError(f"{self.store.path}: {e} (the store changed or is damaged)") from None

    def _count(self, decoded, jobs: list[ClipJob]) -> None:
        total = sum(decoded)
        with self._taking:
            self.decoded += total
            self.delivered += sum(len(job.frames) for job in jobs)

    def _task(self, segment: Segment, jobs: tuple[ClipJob, ...]) -> ClipTask:
        return ClipTask(
            self._data_path,
            self._data_fd,
            self._data_inode,
            os.getpid(),
            segment.fd,
            segment.id,
            segment.nbytes,
            self.layout,
            jobs,
        )

    def close(self) -> None:
        """Stop the threads or processes, then let go of the slots once the copies out of them ended."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.nvdec is not None:
            self.nvdec.close()
        with self._taking:
            processes, self._processes = self._processes, None
        if processes is not None:
            processes.shutdown(wait=True, cancel_futures=True)
        if self._turns is not None:
            self._turns.drain()
        for segment in self._slots:
            segment.close()
        self._close_data()


class PlanUpload:
    """An epoch's plan on the device: uploaded once on the copy stream by the first thread that asks
    (the consumer as the epoch starts, or a producer making the epoch's first batches while the one
    before ends: `producer.Carried`), with the event the consumer's stream waits for before its
    augment reads the parameters (`hand_over`, on the consumer's thread)."""

    def __init__(self, plan: Callable[[], EpochPlan], device: torch.device, stream: torch.cuda.Stream | None):
        self._plan, self._device, self._stream = plan, device, stream
        self._lock = threading.Lock()
        self._made: tuple[EpochPlan, EpochPlan, torch.cuda.Event | None] | None = None

    def get(self) -> tuple[EpochPlan, EpochPlan]:
        """The plan, and the plan on the device (the same one on a CPU)."""
        with self._lock:
            if self._made is None:
                plan = self._plan()
                if self._stream is None:
                    self._made = (plan, plan, None)
                else:
                    with torch.cuda.stream(self._stream):
                        on_device = plan.to(self._device)
                        self._made = (plan, on_device, self._stream.record_event())
            return self._made[0], self._made[1]

    def hand_over(self) -> None:
        """Make the consumer's stream wait for the upload and own the parameters."""
        _, on_device = self.get()
        event = self._made[2]  # type: ignore[index]  # (made by get)
        hand_over(event, *(on_device.params.tensors() if on_device.params else ()))


def video_feed(
    plan: EpochPlan,
    start: int,
    epoch: int,
    clips: VideoClips,
    labels: torch.Tensor,
    production: Production,
    stream: torch.cuda.Stream | None,
    next_plan: Callable[[], EpochPlan] | None = None,
    carried: Carried | None = None,
) -> Iterator[Batch]:
    """The epoch's batches of clips from batch `start`, made `prefetch` ahead on the producer threads.
    `next_plan` (the plan of epoch `epoch` + 1, when called): the producers go on to the next epoch's
    first batches as this one ends (`producer.Carried`; None: not carried); `carried`: such batches,
    made for this epoch (a small store's epochs are a few batches: without them each epoch began
    with the decode of a whole batch while the GPU waited)."""
    device = clips.device
    upload = carried.context if carried is not None and isinstance(carried.context, PlanUpload) else None
    if upload is None:
        upload = PlanUpload(lambda: plan, device, stream)
    upload.hand_over()  # once per epoch: the consumer waits for the upload and owns the epoch's parameters
    carry = None
    if next_plan is not None:
        following = PlanUpload(next_plan, device, stream)
        carry = NextEpoch(epoch + 1, _maker(following, epoch + 1, clips, labels, production, stream), following)
    make = _maker(upload, epoch, clips, labels, production, stream)
    return threaded(
        production, make, range(start, len(plan)), len(plan), workers=clips.batches, carry=carry, carried=carried
    )


def _maker(
    upload: PlanUpload,
    epoch: int,
    clips: VideoClips,
    labels: torch.Tensor,
    production: Production,
    stream: torch.cuda.Stream | None,
) -> Make:
    """What makes batch `number` of `epoch` (its plan: `upload`) on a producer thread: its clips
    decoded into a slot, the slot copied to the device and turned to RGB on `stream`."""
    device = clips.device
    t = clips.clip.frames

    def make(number: int, worker: int) -> Made:
        plan, on_device = upload.get()
        items, _ = plan.batch(number)
        params = on_device.batch(number)[1]
        batch = clips.clips(epoch, items.numpy())
        n = len(items)
        t0 = time.perf_counter()
        k, slot = clips.slot(production.prefetch)
        event = None  # (the slot goes back as it is where anything fails: nothing reads it then)
        try:
            host = slot[: n * clips.clip_bytes].view(n * t, *clips.layout.shape)
            with stage_range("gpufeed.decode", stream is not None):
                clips.store.check_unchanged()  # a file cut short under its map: an error, not SIGBUS
                on_gpu = clips.decode(batch, k)
            production.counters.add("decode", time.perf_counter() - t0, n * t)
            mine = labels.index_select(0, torch.as_tensor(batch.videos))
            if stream is None:  # (converted here, into a tensor of its own: the slot is free again)
                images = _place(i420_to_rgb(host, clips.layout, clips.max_hw), on_gpu, t)
                return Made(Batch(images, mine, params, samples=items, clips=batch), None)
            with torch.cuda.stream(stream):
                rgb = i420_to_rgb(host.to(device, non_blocking=True), clips.layout, clips.max_hw)
                images = _place(rgb, on_gpu, t)
                mine = mine.to(device, non_blocking=True)
                event = stream.record_event()
            return Made(Batch(images, mine, params, samples=items, clips=batch), event)
        finally:
            clips.release(k, event)

    return make


def _place(images: torch.Tensor, on_gpu: list[GpuFrames], t: int) -> torch.Tensor:
    """The engines' clips written over their places in the batch's (N * T, H, W, 3) frames (at the
    top left, as a smaller frame's planes are), on the current stream; their frames were finished on
    the decoding thread's stream, and are kept for the allocator until this stream is done with them."""
    for clip in on_gpu:
        h, w = clip.frames.shape[1:3]
        images[clip.position * t : (clip.position + 1) * t, :h, :w].copy_(clip.frames, non_blocking=True)
        if clip.frames.is_cuda:
            clip.frames.record_stream(torch.cuda.current_stream(clip.frames.device))
    return images


VIDEO_FIELDS = ("label", "video", "frames", "source")
GEOMETRIC = ("boxes", "keypoints", "masks")  # kinds drawn on an image: not what a video's field holds

# BT.601 limited range to RGB (FFmpeg's default for its RGB conversion): rows R, G, B over (Y - 16,
# U - 128, V - 128); Y's factor is the same for all three
_BT601 = ((1.164, 0.0, 1.596), (1.164, -0.392, -0.813), (1.164, 2.017, 0.0))


def i420_to_rgb(slabs: torch.Tensor, layout: I420, hw: tuple[int, int]) -> torch.Tensor:
    """(N, *hw) x 3 uint8 RGB from (N, *layout.shape) `I420` slabs, on their device (`hw`: the largest
    frame's size, the layout's rounded down again to odd sides): chroma taken at each 2x2 block
    (nearest), then BT.601; on a GPU on the copy stream. Each pixel's 2x2 block is a dimension of its
    own, so the chroma planes broadcast over their blocks instead of being upsampled first: besides
    the output, a float copy of the luma and one channel at a time are held (64 frames of 320x568 on
    the development box's CPU: 0.13 s against 0.38 s with the chroma repeated and the channels
    stacked, the same pixels within one level)."""
    n, (h, w) = len(slabs), (layout.height, layout.width)
    y = slabs[:, :h].reshape(n, h // 2, 2, w // 2, 2).float().sub_(16.0).mul_(_BT601[0][0])
    chroma = slabs[:, h:].float().sub_(128.0)
    u = chroma[:, :, : w // 2].reshape(n, h // 2, 1, w // 2, 1)
    v = chroma[:, :, w // 2 :].reshape(n, h // 2, 1, w // 2, 1)
    out = torch.empty((n, h // 2, 2, w // 2, 2, 3), dtype=torch.uint8, device=slabs.device)
    for c, (_, from_u, from_v) in enumerate(_BT601):
        out[..., c] = (y + (from_u * u + from_v * v)).round_().clamp_(0, 255)
    rgb = out.view(n, h, w, 3)
    return rgb if (h, w) == hw else rgb[:, : hw[0], : hw[1]].contiguous()


def check_video(
    store, clip: Clip | None, fields: tuple[str, ...] | None, augment, group_by_aspect, decoders=None, cache="auto"
) -> Clip | None:
    """The clips a Loader of `store` yields (`Clip()` for a video store not given one; None for an image
    store, which refuses `clip`), and ValueError for what a video Loader does not do."""
    if store.mode != "video":
        if clip is not None:
            raise ValueError(f"{store.path}: clip= is for a video store (pack mode='video'), this one is {store.mode}")
        return None
    clip = Clip() if clip is None else clip
    if not isinstance(clip, Clip):
        raise ValueError(f"{store.path}: clip must be a gpufeed.Clip, got {clip!r}")
    known = (*VIDEO_FIELDS, *(name for name, spec in store.fields.items() if spec["kind"] not in GEOMETRIC))
    unknown = [f for f in fields or () if f not in known]
    if unknown:
        raise ValueError(f"{store.path}: a video store's batches have the fields {known}, not {unknown}")
    try:
        check_video_decoders(decoders)
    except ValueError as e:
        raise ValueError(f"{store.path}: {e}") from None
    if cache != "auto":
        raise ValueError(f"{store.path}: cache= places a store's images; a video store stays memory-mapped")
    if group_by_aspect is not False:
        raise ValueError(f"{store.path}: group_by_aspect is for images; a video store's clips take ops to one size")
    from gpufeed.augment.mix import CutMix, MixUp, MixUpOrCutMix

    if any(isinstance(op, (MixUp, CutMix, MixUpOrCutMix)) for op in augment or ()):
        raise ValueError(f"{store.path}: MixUp and CutMix mix images; they are not applied to clips")
    return clip


def video_batch_dict(
    store, fields: tuple[str, ...], clips: torch.Tensor, labels: torch.Tensor, which: ClipBatch
) -> dict:
    """A video batch as a dict: "image" (the clips) and each of `fields`: "label", "video" and "frames"
    (tensors on the batch's device), "source" (a list), and each clip's video's value of a store field
    (numbers and arrays as tensors on the device, text, bytes and JSON as lists)."""
    out: dict = {"image": clips}
    device = clips.device
    for name in fields:
        if name == "label":
            out["label"] = labels
        elif name == "video":
            out["video"] = upload(torch.from_numpy(which.videos), device)
        elif name == "frames":
            out["frames"] = upload(torch.from_numpy(which.frames), device)
        elif name == "source":
            out["source"] = [store.source(int(v)) for v in which.videos]
        else:
            column = store.column(name)
            rows = column.rows(which.videos)
            out[name] = upload(torch.from_numpy(np.ascontiguousarray(rows)), device) if column.fixed else rows
    return out
