"""Videos as a source: what a video store keeps of each file (its `store.format.VideoIndex`: every
frame's presentation time, keyframes and packet sizes, found by decoding the file once, so a broken one
is caught at pack time, not in training; and where each packet and the codec's parameters lie in the
file, so a clip decodes without opening its container), and the optional re-encoding that bounds what a clip costs
to decode.

PyAV (FFmpeg) reads and writes them: an optional dependency (`pip install gpufeed[video]`), imported
where a video is first touched. Nothing here imports torch: the decode workers use the same reader.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction

import numpy as np

from gpufeed.sources.tars import Wanted
from gpufeed.store.format import VIDEO_DECODERS, VideoIndex

# what a folder or tar of videos is read for (case-insensitive)
VIDEO_EXTS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi"})
MAX_VIDEO_BYTES = 4 << 30  # the largest video file pack reads (a worker holds one whole)
TAR_VIDEOS = Wanted(("mp4", "m4v", "mov", "mkv", "webm", "avi"), MAX_VIDEO_BYTES, "video")  # a tar sample's
MAX_VIDEO_FRAMES = 1 << 20  # a bound on what one file can make the index hold (about 10 h at 30 fps)


class VideoError(ValueError):
    """A video can't be read as a store needs it; the message is the reason (the caller names the file)."""


def pyav():
    """The `av` module, or ImportError naming the extra that installs it."""
    try:
        import av
    except ImportError as e:
        raise ImportError(
            "video needs PyAV (FFmpeg's libraries for Python): pip install 'gpufeed[video]' (or: pip install av)"
        ) from e
    av.logging.set_level(av.logging.PANIC)  # FFmpeg's own prints: each error becomes a VideoError instead
    return av


_METADATA_ERRORS = {"metadata_errors": "ignore"}  # (emptied where this PyAV has no such argument)


def open_video(av, data: bytes | memoryview):
    """`data` opened as a container for reading, its metadata's text decoded without failing: PyAV
    up to 18 raises on metadata that is not UTF-8 unless told to ignore it (`metadata_errors`);
    PyAV 19 (Python 3.12 and later) took that argument away and never raises."""
    try:
        return av.open(io.BytesIO(data), mode="r", **_METADATA_ERRORS)
    except TypeError as e:
        if "metadata_errors" not in str(e) or not _METADATA_ERRORS:
            raise
        _METADATA_ERRORS.clear()
        return av.open(io.BytesIO(data), mode="r")


@contextmanager
def _first_video(av, data: bytes | memoryview) -> Iterator[tuple]:
    """(container, its first video stream) of `data`; VideoError where PyAV can't open it as a
    container or it has no video stream."""
    try:
        container = open_video(av, data)
    except (av.FFmpegError, ValueError, UnicodeDecodeError) as e:
        raise VideoError(f"not a video container PyAV can open ({_reason(e)})") from None
    with container:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise VideoError("no video stream")
        yield container, stream


def index_video(data: bytes | memoryview, max_frames: int = MAX_VIDEO_FRAMES) -> VideoIndex:
    """Decode the first video stream of `data` (a container file's bytes) once, frame by frame, and
    index it. Raises VideoError with the reason where it is not a container PyAV opens, has no video
    stream or frames, or decodes to fewer frames than its packets (truncated or damaged): such a file
    would fail, or silently repeat frames, in training."""
    av = pyav()
    with _first_video(av, data) as (container, stream):
        if stream.codec_context is None or not stream.codec_context.name:
            raise VideoError("a video stream of a codec this FFmpeg can't decode")
        codec = stream.codec_context.name
        extra = stream.codec_context.extradata
        stream.codec_context.thread_count = 1  # pack runs a process per core already
        number = stream.index  # (read while the container is open: PyAV's stream dies with it)
        time_base = Fraction(stream.time_base) if stream.time_base else Fraction(1, 90000)
        sizes: dict[int, int] = {}
        at: dict[int, int] | None = {} if codec in VIDEO_DECODERS else None  # (None: not decodable without it)
        last = -1  # (the last packet's offset)
        first: tuple[int, int, int] | None = None  # the first packet's offset, bytes and pts
        reference: tuple | None = None  # the container's frame of it (`_picture`), which it must give alone
        digests: dict[int, int] | None = {} if codec == "h264" else None  # each frame's (`_skips_exactly`)
        pts: list[int] = []
        keys: list[bool] = []
        height = width = 0
        try:
            for packet in container.demux(stream):
                if packet.size and packet.pts is not None:
                    sizes[packet.pts] = packet.size
                    if at is not None:  # (decode order must be file order, each packet's own pts)
                        where = _lying(data, packet)
                        if where <= last or packet.pts in at:
                            at = None
                        else:
                            at[packet.pts] = last = where
                            first = first or (where, packet.size, packet.pts)
                for frame in packet.decode():
                    if frame.pts is None:
                        raise VideoError("a frame without a presentation time (a raw stream; remux it into MP4/MKV)")
                    if len(pts) >= max_frames:
                        raise VideoError(f"more than {max_frames} frames")
                    if not height:
                        height, width = frame.height, frame.width
                    elif (frame.height, frame.width) != (height, width):
                        raise VideoError(
                            f"its frame size changes ({height}x{width} to {frame.height}x{frame.width}); "
                            "re-encode it (pack's short_side)"
                        )
                    pts.append(frame.pts)
                    keys.append(bool(frame.key_frame))
                    wanted = reference is None and first is not None and frame.pts == first[2]
                    picture = _picture(frame) if digests is not None or wanted else None
                    if digests is not None:
                        digests[frame.pts] = _digest(picture)
                    if wanted:
                        reference = picture
        except av.FFmpegError as e:
            raise VideoError(f"damaged after {len(pts)} frames ({_reason(e)})") from None
    if not pts:
        raise VideoError("no frames")
    if len(sizes) > len(pts):
        raise VideoError(f"{len(sizes)} packets decode to {len(pts)} frames (truncated or damaged)")
    order = np.argsort(np.asarray(pts, np.int64), kind="stable")
    ordered = np.asarray(pts, np.int64)[order]
    if (np.diff(ordered) <= 0).any():
        raise VideoError("two frames with one presentation time")
    keyframe = np.asarray(keys, bool)[order]
    if not keyframe[0]:
        raise VideoError("its first frame is not a keyframe (a cut stream)")
    every = at is not None and len(at) == len(pts) and all(p in at for p in pts)  # (a packet a frame)
    extradata = _extradata_at(data, extra) if every else None
    if extradata is not None and not _decodes_alone(av, codec, data, extradata, first, reference):
        extradata = None
    exact = digests is not None and _skips_exactly(av, data, digests)  # (pts all differ: checked above)
    return VideoIndex(
        pts=ordered,
        keyframe=keyframe,
        packet_bytes=np.asarray([sizes.get(int(p), 0) for p in ordered], np.int64),
        time_base=time_base,
        height=height,
        width=width,
        codec=codec,
        stream=number,
        packet_at=None if extradata is None else np.asarray([at[int(p)] for p in ordered], np.int64),  # type: ignore[index]
        extradata=extradata or (0, 0),
        nonref_exact=exact,
    )


def _digest(picture: tuple | None) -> int:
    """A checksum of a decoded frame's pixels as `_picture` gives them (each plane's, without its rows'
    padding, which holds whatever the decoder's buffer held before); -1 where they can't be read so."""
    if picture is None:
        return -1
    crc = zlib.crc32(f"{picture[0]} {picture[1]}".encode())
    for plane in picture[2]:
        crc = zlib.crc32(plane, crc)
    return crc


def _skips_exactly(av, data: bytes | memoryview, digests: dict[int, int]) -> bool:
    """Whether decoding the H.264 video `data` with every frame it marks unreferenced skipped (FFmpeg's
    `skip_frame` NONREF, nal_ref_idc 0) gives each frame it still decodes as the whole decode gave it
    (`digests`, by pts): then a clip's decode may skip any of them it does not hold
    (`decode.codecs.video`, `Tuning.skip_nonref`), its frames the same. A conforming stream refers to
    no such frame, and FFmpeg keeps none as a reference; this checks the stream and the decoder
    rather than trusting its marks. One more decode at pack time, of the referenced frames only."""
    try:
        with _first_video(av, data) as (container, stream):
            stream.codec_context.thread_count = 1
            stream.codec_context.skip_frame = "NONREF"
            seen = 0
            for packet in container.demux(stream):
                for frame in packet.decode():
                    digest = _digest(_picture(frame))
                    if frame.pts is None or digest == -1 or digests.get(frame.pts) != digest:
                        return False
                    seen += 1
    except (av.FFmpegError, VideoError, ValueError):
        return False
    return seen > 0


def _picture(frame) -> tuple | None:
    """What a decoded frame gives a clip: its pixel format, colour range and each plane's pixels (None
    where they can't be read so: such a video decodes through its container)."""
    try:
        size = 2 if frame.format.components[0].bits > 8 else 1  # bytes a sample
        planes = tuple(
            np.frombuffer(p, np.uint8).reshape(p.height, p.line_size)[:, : p.width * size].copy() for p in frame.planes
        )
    except Exception:  # noqa: BLE001  a format PyAV describes otherwise: not decoded alone
        return None
    return frame.format.name, int(frame.color_range), planes


def own_decoder(av, codec: str, data, extradata: tuple[int, int]):
    """A decoder of `codec` of its own, on the calling thread alone, given the codec's extradata that
    lies at (offset, length) in `data` (the video's file; (0, 0): none): what a clip's packets, read
    where they lie, are fed to (`decode.codecs.video`), and what pack checks they decode with.
    UnknownCodecError (a ValueError) where this FFmpeg has no such decoder."""
    decoder = av.CodecContext.create(codec, "r")
    if extradata[1]:
        decoder.extradata = bytes(memoryview(data)[extradata[0] : extradata[0] + extradata[1]])
    decoder.thread_type = "NONE"
    decoder.thread_count = 1
    return decoder


def stored_packet(av, data, at: int, size: int, pts: int):
    """The packet of `size` bytes at `at` in `data` (the video's file), with its presentation time."""
    packet = av.Packet(memoryview(data)[at : at + size])
    packet.pts = pts
    return packet


def _decodes_alone(av, codec: str, data, extradata: tuple[int, int], first, reference) -> bool:
    """Whether the video's first packet, fed to a decoder of its own with the codec's extradata alone,
    gives the frame its container's decode gave: the same pixel format, colour range and pixels. A
    range the container declares and the bitstream does not (Matroska's Colour, MP4's colr box) never
    reaches such a decoder: it gave limited-range pixels where the container's gave full-range ones."""
    if first is None or reference is None:
        return False
    at, size, pts = first
    try:
        decoder = own_decoder(av, codec, data, extradata)
        frames = list(decoder.decode(stored_packet(av, data, at, size, pts))) + list(decoder.decode(None))
    except (av.FFmpegError, ValueError):
        return False
    got = next((_picture(f) for f in frames if f.pts == pts), None)
    return (
        got is not None
        and got[:2] == reference[:2]
        and len(got[2]) == len(reference[2])
        and all(np.array_equal(a, b) for a, b in zip(got[2], reference[2]))
    )


def _lying(data: bytes | memoryview, packet) -> int:
    """The byte offset of `packet`'s bytes in `data`, its container file, or -1 where they do not lie
    there as they are (a clip can then be decoded only through its container): at the demuxer's
    position in MP4, a few bytes after it in Matroska (its block's header)."""
    payload = bytes(packet)
    pos = packet.pos
    if pos is None or pos < 0:
        return -1
    window = bytes(memoryview(data)[pos : pos + len(payload) + _BLOCK_HEADER])
    k = window.find(payload[:64])
    while 0 <= k <= _BLOCK_HEADER and window[k : k + len(payload)] != payload:
        k = window.find(payload[:64], k + 1)
    return pos + k if 0 <= k <= _BLOCK_HEADER else -1


_BLOCK_HEADER = 64  # the most bytes looked past a packet's demuxer position for its own


def _extradata_at(data: bytes | memoryview, extradata: bytes | None) -> tuple[int, int] | None:
    """Where the codec's `extradata` (its parameter sets: MP4's avcC or hvcC box, Matroska's
    CodecPrivate) lies in `data` as (offset, length): (0, 0) where there is none; None where it is not
    in the file as it is."""
    if not extradata:
        return 0, 0
    k = (data if isinstance(data, bytes) else bytes(data)).find(extradata)
    return (k, len(extradata)) if k >= 0 else None


def reencode_video(
    data: bytes | memoryview,
    short_side: int | None = None,
    gop: int | None = None,
    fps: float | None = None,
    crf: int = 23,
    codec: str = "libx264",
) -> bytes:
    """`data`'s first video stream as a new MP4 (H.264 by default): the short side scaled to
    `short_side` (even sides), a keyframe every `gop` frames and no others (so a clip never decodes
    more than one GOP it drops), frames taken at `fps` (the nearest earlier frame for each tick; without
    it each frame keeps its time); audio dropped. Raises VideoError where `data` can't be decoded."""
    av = pyav()
    out = io.BytesIO()
    with _first_video(av, data) as (source, stream):
        rate = Fraction(fps).limit_denominator(1001) if fps else Fraction(stream.average_rate or 25)
        with av.open(out, mode="w", format="mp4") as sink:
            target = None
            written = 0
            try:
                for frame in source.decode(stream):
                    if frame.pts is None:
                        continue
                    if target is None:
                        h, w = _scaled(frame.height, frame.width, short_side)
                        target = sink.add_stream(codec, rate=rate)
                        target.width, target.height, target.pix_fmt = w, h, "yuv420p"
                        options = {"crf": str(crf), "preset": "veryfast"}
                        if gop:
                            options |= {"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"}
                            target.codec_context.gop_size = gop
                        target.options = options
                        if not fps:  # each frame keeps its own time (a variable frame rate stays one)
                            target.time_base = target.codec_context.time_base = stream.time_base
                        pts0, t0 = frame.pts, frame.pts * frame.time_base
                    picture = frame.reformat(width=target.width, height=target.height, format="yuv420p")
                    if not fps:
                        picture.pts, picture.time_base = frame.pts - pts0, stream.time_base
                        for packet in target.encode(picture):
                            sink.mux(packet)
                        continue
                    # the frame stands for every tick since the last one (none where it is early)
                    due = math.floor((frame.pts * frame.time_base - t0) * rate) + 1
                    while written < due:
                        picture.pts, picture.time_base = written, 1 / rate
                        for packet in target.encode(picture):
                            sink.mux(packet)
                        written += 1
                if target is None:
                    raise VideoError("no frames")
                for packet in target.encode(None):
                    sink.mux(packet)
            except av.FFmpegError as e:
                raise VideoError(f"can't be re-encoded ({_reason(e)})") from None
    return out.getvalue()


def _scaled(height: int, width: int, short_side: int | None) -> tuple[int, int]:
    """(h, w) with the short side `short_side` (None: as it is), both even (4:2:0 needs it)."""
    if short_side is None:
        h, w = height, width
    elif height <= width:
        h, w = short_side, round(width * short_side / height)
    else:
        h, w = round(height * short_side / width), short_side
    return max(2, h - h % 2), max(2, w - w % 2)


def _reason(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e)
    return text.strip() or type(e).__name__
