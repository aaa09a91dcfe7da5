"""A clip's frames from a stored video, decoded on the CPU with PyAV (FFmpeg): from the keyframe at or
before the clip's first frame (the store's index says where), decode forward, keep the frames the
clip asks for and stop after its last. The packets are read where the store's index says they lie and
fed to a decoder of the clip's own (`Packets`); a video whose packets can't be (a store packed before
they were indexed, a codec not among `store.format.VIDEO_DECODERS`) is opened as a container and
seeked in. Torch-free, so a decode thread or process needs nothing else.

FFmpeg decodes with the GIL released (PyAV's decode and its colour conversion run outside it), so a
pool of threads in the loader's process decodes clips in parallel.

`decode_clip` gives RGB (FFmpeg's conversion); `decode_clip_planes` gives each frame's 4:2:0 planes as
they came out of the decoder (`I420` below), half the bytes, for the GPU to convert: FFmpeg's RGB
conversion took about as long as the decode itself (1,400 against 2,900 frames/s of 568x320 H.264 on
one core of the development box).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.logs import logger
from gpufeed.sources.videos import VideoError, open_video, own_decoder, pyav, stored_packet

log = logger(__name__)


def one_thread(stream) -> None:
    """Decode `stream` on the calling thread alone. FFmpeg's default starts a thread per core for each
    decoder opened, and a clip opens one: 16 decode threads on 16 cores each started 16 more per clip
    (an H100 host: 69 clips/s with 16 threads against 52 with one)."""
    stream.thread_type = "NONE"
    stream.codec_context.thread_count = 1


@contextmanager
def _opened(av, request: ClipRequest) -> Iterator[tuple]:
    """(container, video stream) of `request`'s bytes, decoding on one thread; VideoError where the
    stored stream index is not a video stream of the file (the store changed or is damaged)."""
    with open_video(av, request.data) as container:
        streams = container.streams
        if not 0 <= request.stream < len(streams) or streams[request.stream].type != "video":
            raise VideoError(f"stream {request.stream} is not a video stream of this file")
        stream = streams[request.stream]
        one_thread(stream)
        yield container, stream


@dataclass(frozen=True)
class Packets:
    """A clip's packets, to decode it without opening its container: its decoder (one of
    `store.format.VIDEO_DECODERS`), the codec's extradata as (offset, length) in the video's file
    ((0, 0): none), and `rows` (m, 3) int64 in decode order, which is file order: each packet's offset
    in the video's file, its bytes and its pts; from the packet of the keyframe the clip's decode
    starts at to the last one a frame of the clip needs (`loader.video.clip_packets`)."""

    decoder: str
    extradata: tuple[int, int]
    rows: np.ndarray


@dataclass(frozen=True)
class ClipRequest:
    """What one clip's decode needs: the video's bytes, its frames' pts and keyframe flags (presentation
    order, from the store), the video stream's index, and the frames wanted (indices into those, in
    the clip's order; repeats allowed: a short video's last frame stands for those past its end).
    `whole`: the index starts at the video's first frame (else at a keyframe within it, which the
    decode always seeks to)."""

    data: memoryview | bytes
    pts: np.ndarray
    keyframe: np.ndarray
    stream: int
    frames: np.ndarray
    whole: bool = True
    skip_nonref: bool = False  # frames outside the clip that no frame refers to are not decoded (`_decode`)
    packets: Packets | None = None  # the clip's packets where they lie (None: decoded through the container)


def keyframe_before(keyframe: np.ndarray, frame: int) -> int:
    """The last keyframe at or before `frame` (0 where none is flagged)."""
    keys = np.flatnonzero(keyframe[: frame + 1])
    return int(keys[-1]) if len(keys) else 0


def _decode(request: ClipRequest, take: Callable[[Any, list[int]], None]) -> int:
    """Decode `request`'s video from the keyframe at or before its clip's first frame to its last,
    `take(frame, positions)` for each frame the clip holds (its positions in the clip, several where
    a short clip repeats it); how many frames were decoded. VideoError where the file is damaged or
    decodes to fewer of the wanted frames than its index holds.

    With `request.packets`, the clip's packets are read where they lie and fed to a decoder of their
    own (`_own_packets`), without opening the container: 568x320 H.264 in MP4, opening, seeking and
    the first demux took 1.2-1.5 ms of a clip's ~17 ms on one core of the development box, making the
    decoder 0.02 ms. Where that fails (said once a process and decoder), the clip is decoded again
    through its container.

    With `request.skip_nonref` and H.264, a packet of a frame the clip does not hold is decoded with
    FFmpeg's `skip_frame` at NONREF: a frame no other frame refers to (most B-frames) is then
    dropped undecoded, and nothing needs it. 568x320 H.264 at GOP 32 (x264 veryfast, B-frames), 16-frame
    clips at stride 2, one core of the development box: 30.7 frames decoded a clip against 44.3,
    48-53 clips/s against 43-46 (to RGB: 36.3-36.5 against 31.4-33.1). The Loader asks for it where
    pack checked that the stream's marks hold (`Tuning.skip_nonref`, `VideoIndex.nonref_exact`)."""
    av = pyav()
    if request.packets is not None:
        try:
            return _decode_from(av, request, take, _own_packets(av, request))
        except (av.FFmpegError, ValueError) as e:  # (VideoError; a decoder this FFmpeg lacks: UnknownCodecError)
            _say_once(
                request.packets.decoder,
                f"a clip's packets ({request.packets.decoder}) did not decode without their container ({e}); "
                "such a clip is decoded again through its container, twice the work: pack the store again",
            )
    return _decode_from(av, request, take, _container_packets(av, request))


def _decode_from(
    av, request: ClipRequest, take: Callable[[Any, list[int]], None], packets: Generator[tuple, None, None]
) -> int:
    """`_decode`'s loop over `packets` ((decoder, packet) pairs, a None packet flushing the decoder)."""
    wanted = request.frames
    slots: dict[int, list[int]] = {}
    for t, i in enumerate(wanted):
        slots.setdefault(int(request.pts[int(i)]), []).append(t)
    held = set(slots)  # (the clip's pts: slots empties as its frames come)
    stop = int(request.pts[int(wanted.max())])
    decoded = 0

    def took(frames) -> bool:
        """Take the clip's frames among `frames`; whether its last has come."""
        nonlocal decoded
        for frame in frames:
            decoded += 1
            if frame.pts is None:
                continue
            positions = slots.pop(frame.pts, None)
            if positions:
                take(frame, positions)
            if frame.pts >= stop:
                return True
        return False

    try:
        for codec, packet in packets:
            # H.264's alone: a frame it calls non-reference (nal_ref_idc 0) is one no frame refers to;
            # HEVC's "sub-layer non-reference" frames may be referred to by a higher sub-layer's
            if request.skip_nonref and codec.name == "h264":
                skip = packet is not None and packet.pts is not None and packet.pts not in held
                codec.skip_frame = "NONREF" if skip else "DEFAULT"
            if took(codec.decode(packet)):
                break
    except av.FFmpegError as e:
        raise VideoError(f"damaged: {e}") from None
    finally:
        packets.close()  # (the container, where it was opened)
    if slots:
        missing = sorted(int(np.searchsorted(request.pts, p)) for p in slots)
        raise VideoError(f"frames {missing[:4]} of the index not decoded (the file changed or is damaged)")
    return decoded


def _container_packets(av, request: ClipRequest) -> Generator[tuple, None, None]:
    """(decoder, packet) pairs of the clip through its container: opened, seeked to the keyframe at or
    before the clip's first frame, demuxed from there (the demuxer's last, empty packet flushes)."""
    start = keyframe_before(request.keyframe, int(request.frames.min()))
    with _opened(av, request) as (container, stream):
        if start > 0 or not request.whole:
            container.seek(int(request.pts[start]), stream=stream, backward=True, any_frame=False)
        for packet in container.demux(stream):
            yield stream.codec_context, packet


def _own_packets(av, request: ClipRequest) -> Generator[tuple, None, None]:
    """(decoder, packet) pairs of the clip's packets read where they lie (`Packets`), its decoder one of
    its own on the calling thread, then None to flush it."""
    packets = request.packets
    assert packets is not None
    codec = own_decoder(av, packets.decoder, request.data, packets.extradata)
    for at, size, pts in packets.rows.tolist():
        yield codec, stored_packet(av, request.data, at, size, pts)
    yield codec, None


_said: set[str] = set()
_saying = threading.Lock()  # (the loader's decode threads may fail at once)


def _say_once(what: str, message: str) -> None:
    """Say `message` the first time this process meets `what` (a decode process says it on its own
    standard error)."""
    with _saying:
        first = what not in _said
        _said.add(what)
    if first:
        log.warning("gpufeed: %s", message)


def decode_clip(request: ClipRequest, out: np.ndarray | None = None) -> np.ndarray:
    """The clip's frames as (T, H, W, 3) uint8 RGB (into `out` where given, at its top left). Raises
    VideoError where the video decodes to fewer of the wanted frames than its index holds."""
    got: list[tuple[np.ndarray, list[int]]] = []
    _decode(request, lambda frame, positions: got.append((frame.to_ndarray(format="rgb24"), positions)))
    h, w = got[0][0].shape[:2]
    if out is None:
        out = np.empty((len(request.frames), h, w, 3), np.uint8)
    for rgb, positions in got:
        for t in positions:
            out[t, :h, :w] = rgb
    return out


@dataclass(frozen=True)
class I420:
    """Where a frame's 4:2:0 planes lie in a slab of (height * 3 // 2, width) uint8 (height and width
    even: the largest frame's, rounded up): Y in rows [0, height), then U in the left and V in the
    right half of the rows below, each plane at the top left of its part (a smaller frame leaves the
    rest as it was). BT.601 limited range, FFmpeg's default for RGB."""

    height: int
    width: int

    @staticmethod
    def fitting(height: int, width: int) -> I420:
        return I420(height + height % 2, width + width % 2)

    @property
    def shape(self) -> tuple[int, int]:
        return self.height * 3 // 2, self.width

    def put(self, frame, slab: np.ndarray) -> None:
        """`frame` (a PyAV VideoFrame) into `slab` (this shape): its planes copied, converted first to
        yuv420p where it is another format (10 bits, 4:4:4, yuvj420p's full range, ...)."""
        if frame.format.name != "yuv420p":
            frame = frame.reformat(format="yuv420p")  # (yuvj420p, full range, becomes limited here)
        h, w = frame.height, frame.width
        parts = (
            (slab[:h, :w], frame.planes[0]),
            (slab[self.height : self.height + (h + 1) // 2, : (w + 1) // 2], frame.planes[1]),
            (
                slab[self.height : self.height + (h + 1) // 2, self.width // 2 : self.width // 2 + (w + 1) // 2],
                frame.planes[2],
            ),
        )
        full = frame.color_range == 2  # yuv420p flagged full range (VP9 and AV1 may be): to limited
        for k, (into, plane) in enumerate(parts):
            rows = np.frombuffer(plane, np.uint8).reshape(plane.height, plane.line_size)[
                : into.shape[0], : into.shape[1]
            ]
            if full:
                scale, zero = (219 / 255, 16.0) if k == 0 else (224 / 255, 128.0 - 128 * 224 / 255)
                into[...] = np.rint(rows * scale + zero).astype(np.uint8)
            else:
                into[...] = rows


def decode_clip_planes(request: ClipRequest, layout: I420, out: np.ndarray) -> int:
    """The clip's frames as `layout` slabs into `out` ((T, *layout.shape) uint8), and how many frames
    were decoded for them (from the keyframe before the clip). Raises VideoError as `decode_clip` does."""

    def take(frame, positions: list[int]) -> None:
        layout.put(frame, out[positions[0]])
        for t in positions[1:]:
            out[t] = out[positions[0]]

    return _decode(request, take)


@dataclass(frozen=True)
class ClipJob:
    """One clip for a decode process: where its video lies in the store's data file (byte offset and
    length), its index (pts, keyframes, stream), the frames wanted, and the byte offset in the shared
    slot its T slabs go to."""

    video: int
    begin: int
    size: int
    pts: np.ndarray
    keyframe: np.ndarray
    stream: int
    frames: np.ndarray
    at: int
    whole: bool = True  # (`ClipRequest.whole`)
    skip_nonref: bool = False  # (`ClipRequest.skip_nonref`)
    packets: Packets | None = None  # (`ClipRequest.packets`)


@dataclass(frozen=True)
class ClipTask:
    """A decode process's share of a batch: the store's data file, the shared slot (a memfd of process
    `pid` at descriptor `fd`, inode `inode`, of `nbytes`), the slab layout, and its clips."""

    data_path: str  # (for messages)
    data_fd: int  # the loader's descriptor of it: workers read the file the loader opened, not its name's
    data_inode: int
    pid: int
    fd: int
    inode: int
    nbytes: int
    layout: I420
    jobs: tuple[ClipJob, ...]


class _Opened:
    """What a decode process keeps between tasks: the data file's map and the slots' maps, by inode."""

    data: dict[int, np.ndarray] = {}
    slots: dict[int, np.ndarray] = {}


def _mapped(pid: int, fd: int, inode: int, nbytes: int | None, gone: str) -> np.ndarray:
    """Process `pid`'s descriptor `fd` mapped here as uint8 (`nbytes` of it writable; None: the whole
    file, read-only), by its /proc path; VideoError `gone` where that is no longer file `inode` (the
    loader closed and the number was reused)."""
    import mmap
    import os

    mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY if nbytes is None else os.O_RDWR)
    try:
        if os.fstat(mine).st_ino != inode:
            raise VideoError(gone)
        if nbytes is not None:
            return np.frombuffer(mmap.mmap(mine, nbytes), np.uint8)
        size = os.fstat(mine).st_size
        return np.frombuffer(mmap.mmap(mine, size, prot=mmap.PROT_READ), np.uint8) if size else np.empty(0, np.uint8)
    finally:
        os.close(mine)


def run_clip_task(task: ClipTask) -> int:
    """In a decode process: decode `task`'s clips into its slot, and the frames decoded for them
    (VideoError naming the video where one fails)."""
    data = _Opened.data.get(task.data_inode)
    if data is None:
        gone = f"{task.data_path}: the loader's file is gone (its loader closed)"
        data = _mapped(task.pid, task.data_fd, task.data_inode, None, gone)
        _Opened.data.clear()  # (another store's before: its map goes)
        _Opened.data[task.data_inode] = data
    slot = _Opened.slots.get(task.inode)
    if slot is None:
        gone = "the loader's shared slot is gone (its loader closed)"
        slot = _mapped(task.pid, task.fd, task.inode, task.nbytes, gone)
        if len(_Opened.slots) > 64:  # slots of loaders gone: let go of the oldest
            _Opened.slots.pop(next(iter(_Opened.slots)))
        _Opened.slots[task.inode] = slot
    return decode_jobs(data, slot, task.layout, task.jobs)


def decode_jobs(data: np.ndarray, slot: np.ndarray, layout: I420, jobs: tuple[ClipJob, ...]) -> int:
    """`jobs`' clips from `data` (the store's data file) into `slot` (a batch's bytes), and the frames
    decoded for them; VideoError naming the video where one fails."""
    one = layout.shape[0] * layout.shape[1]
    decoded = 0
    for job in jobs:
        out = slot[job.at : job.at + len(job.frames) * one].reshape(len(job.frames), *layout.shape)
        request = ClipRequest(
            data[job.begin : job.begin + job.size].data,
            job.pts,
            job.keyframe,
            job.stream,
            job.frames,
            job.whole,
            job.skip_nonref,
            job.packets,
        )
        try:
            decoded += decode_clip_planes(request, layout, out)
        except VideoError as e:
            raise VideoError(f"video {job.video}: {e}") from None
    return decoded
