"""`gpufeed.pack`: turn an image collection into a store, on all cores, atomically."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpufeed._version import __version__
from gpufeed.logs import logger
from gpufeed.packing import engines, worker
from gpufeed.packing.datasets import dataset_source, is_dataset
from gpufeed.packing.fields import FieldsSink, Geometry
from gpufeed.packing.imaging import DEFAULT_MAX_PIXELS
from gpufeed.packing.report import PackReport as PackReport  # (its home before report.py: re-exported)
from gpufeed.packing.sigterm import sigterm_stops
from gpufeed.packing.sinks import JpegSink, RawSink, VideoSink
from gpufeed.packing.upload import pack_to_url
from gpufeed.processes import stop_now
from gpufeed.sources import Item, Skip, open_source
from gpufeed.sources.images import JPEG_QUALITY
from gpufeed.store import format as fmt
from gpufeed.store.locations import is_url, parse_size
from gpufeed.store.writer import atomic_store_dir

log = logger(__name__)
CHUNK = 32  # items a worker task packs at most
# what the items of one task, and of all tasks in flight, may carry (tar members and dataset samples are
# read here and sent to the workers; files listed by path carry nothing): memory stays bounded however
# large the samples (each at most MAX_FILE_BYTES), with tasks enough to keep 64 workers busy on 1 MB images
CHUNK_BYTES = 4 << 20
IN_FLIGHT_BYTES = 256 << 20


class PackError(Exception):
    """Packing failed; nothing was written at the destination. `skipped` lists what was left out."""

    def __init__(self, message: str, skipped: list[dict[str, str]] | None = None):
        super().__init__(message)
        self.skipped = skipped or []


def _check_args(mode: str, size: int, fit: str, quality: int, max_side: int, on_error: str, engine: str) -> None:
    if engine not in engines.ENGINES:
        raise ValueError(f"engine must be one of {engines.ENGINES}, got {engine!r}")
    if mode not in fmt.MODES:
        raise ValueError(f"mode must be one of {fmt.MODES}, got {mode!r}")
    if fit not in fmt.FITS:
        raise ValueError(f"fit must be one of {fmt.FITS}, got {fit!r}")
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality}")
    if size < 1 or max_side < 1:
        raise ValueError(f"size and max_side must be positive, got {size} and {max_side}")


def _check_video_args(mode: str, short_side: int | None, gop: int | None, fps: float | None) -> None:
    if mode != "video":
        if (short_side, gop, fps) != (None, None, None):
            raise ValueError(f"short_side, gop and fps re-encode videos (mode='video'), not a {mode} store")
        return
    if short_side is not None and (not isinstance(short_side, int) or short_side < 16):
        raise ValueError(f"short_side must be an int of at least 16 pixels, got {short_side!r}")
    if gop is not None and (not isinstance(gop, int) or gop < 1):
        raise ValueError(f"gop must be a positive int (frames), got {gop!r}")
    if fps is not None and not (isinstance(fps, (int, float)) and 0 < fps <= 1000):
        raise ValueError(f"fps must be a frame rate in (0, 1000], got {fps!r}")


def clip_bounds(index, fields: dict | None) -> tuple[str | None, tuple[int, int], dict | None]:
    """(why not, the frames [first, end) a video's clips come from, its other fields): a list's "start"
    and "end" columns, in seconds from its first frame (Kinetics' clip bounds), taken out of its fields;
    without them, every frame."""
    rest = dict(fields or {})
    start, end = rest.pop("start", None), rest.pop("end", None)
    seconds = index.seconds
    try:
        a = 0 if _blank(start) else int(np.searchsorted(seconds, float(start) - 1e-6))
        b = len(seconds) if _blank(end) else int(np.searchsorted(seconds, float(end) - 1e-6))
    except (TypeError, ValueError):
        return f"start and end must be seconds, got {start!r} and {end!r}", (0, 0), None
    if not 0 <= a < b <= len(seconds):
        return (
            f"no frame within start {start} s and end {end} s (the video's frames span {seconds[-1]:.3f} s)",
            (0, 0),
            None,
        )
    return None, (a, b), rest or None


def _blank(value: object) -> bool:
    """A list's cell left empty (a CSV's empty cell is read as NaN, a JSONL key may be null)."""
    return value is None or value == "" or (isinstance(value, float) and value != value)


def _check_places(source, dest: str | os.PathLike) -> None:
    """Refuse a destination inside a source folder (packing again would read the old store, or the
    scratch folder of this pack, as images and a class) and a source inside the destination
    (replacing the destination would delete it). Links are followed."""
    if is_dataset(source) or is_url(source):  # a source in a bucket: never inside a folder of this disk
        return
    text = os.fspath(source)
    out = os.path.realpath(dest)
    for path in sorted(glob.glob(text)) if glob.has_magic(text) else [text]:
        real = os.path.realpath(path)
        if os.path.isdir(real) and os.path.commonpath([out, real]) == real:
            raise ValueError(
                f"{dest}: the destination is inside the source folder {path}; packing would "
                "read a store there as images (choose a destination outside the source)"
            )
        if os.path.commonpath([out, real]) == out:
            raise ValueError(
                f"{path}: the source is inside the destination {dest}, which packing replaces "
                "(choose a destination outside the source)"
            )


def _chunks(entries: Iterator, sink, raw_path: str | None, on_skip, most: int = CHUNK) -> Iterator[worker.Chunk]:
    """Group source items into chunks of at most `most` items and CHUNK_BYTES of carried data (one
    item larger than that goes alone), passing source-level skips to `on_skip`."""
    batch: list[Item] = []
    held = 0
    for entry in entries:
        if not isinstance(entry, Item):
            on_skip(entry)
            continue
        size = _data_bytes([entry])
        if batch and held + size > CHUNK_BYTES:
            yield worker.Chunk(sink.reserve(len(batch)), batch, raw_path)
            batch, held = [], 0
        batch.append(entry)
        held += size
        if len(batch) == most or held >= CHUNK_BYTES:  # full: sent before the next item is read
            yield worker.Chunk(sink.reserve(len(batch)), batch, raw_path)
            batch, held = [], 0
    if batch:
        yield worker.Chunk(sink.reserve(len(batch)), batch, raw_path)


def _data_bytes(items: list[Item]) -> int:
    """Bytes the items carry with them (tar members, dataset samples); a file read by a worker carries none."""
    return sum(len(item.data) for item in items if item.data is not None)


def _result(chunk: worker.Chunk, future):
    """The chunk's results; a task that failed for good fails the pack naming its files."""
    try:
        return future.result()
    except Exception as e:
        names = [item.name for item in chunk.items]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise PackError(f"packing failed on {len(names)} file(s): {shown}: {reason}") from e


def _declared_size(declared: tuple[int, int], found: tuple[int, int] | None) -> str:
    """Why an image whose source declares another size than its file's is skipped (its boxes, points
    and masks are in the declared frame; drawn at a declared 60000x60000, one mask takes 3.6 GB)."""
    (h, w), (fh, fw) = declared, found or (0, 0)
    return f"its source declares {w}x{h} pixels (width x height), the file is {fw}x{fh} (upright)"


def _abandoned_on_error(sink):
    """An exit callback for an `ExitStack`: a pack that fails closes the sink's open files (before its
    folder is removed, so that the disk space is freed at once, also in a process that goes on)."""

    def on_exit(kind, error, trace) -> None:
        if kind is not None:
            sink.abandon()

    return on_exit


@contextmanager
def _full_disk_said(dest: str | os.PathLike) -> Iterator[None]:
    """A full disk (ENOSPC, wherever the store's files were being written) as a PackError that names the
    destination and says so, rather than an OSError without a file name, or the images in flight
    blamed. The store's folder is removed by then (`atomic_store_dir`)."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        try:
            free = f"; {shutil.disk_usage(Path(dest).absolute().parent).free / 1e6:.0f} MB free without it"
        except OSError:
            free = ""
        raise PackError(
            f"{dest}: no space left on the device to write the store (nothing was left there{free}); free "
            "some space or pack to another disk"
        ) from e


def _bounded(executor: Executor, fn, chunks: Iterator[worker.Chunk], window: int):
    """Map in order with at most `window` chunks and IN_FLIGHT_BYTES of their carried data in flight
    (one chunk may exceed it alone), so memory stays bounded however large the samples."""
    pending: deque = deque()
    held = 0
    for chunk in chunks:
        size = _data_bytes(chunk.items)
        while pending and (len(pending) >= window or held + size > IN_FLIGHT_BYTES):
            c, f = pending.popleft()
            held -= _data_bytes(c.items)
            yield c, _result(c, f)
        pending.append((chunk, executor.submit(fn, chunk)))
        held += size
    while pending:
        c, f = pending.popleft()
        yield c, _result(c, f)


def pack(
    source: str | os.PathLike | Sequence,
    dest: str | os.PathLike,
    *,
    mode: str = "raw",
    size: int = 256,
    fit: str = "crop",
    quality: int = JPEG_QUALITY,
    max_side: int = 512,
    reencode: bool = True,
    workers: int | None = None,
    on_error: str = "skip",
    overwrite: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: bool = True,
    engine: str = "local",
    ray_address: str | None = None,
    shard_size: int | str | None = None,
    storage_options: dict | None = None,
    images: str | os.PathLike | None = None,
    exist_ok: bool = False,
    short_side: int | None = None,
    gop: int | None = None,
    fps: float | None = None,
) -> PackReport:
    """Pack `source` into a store at `dest`, on all cores; the store appears only once complete.

    Args:
        source: an ImageFolder tree, a flat folder, a .csv (path,label) or .jsonl list, a tar shard
            or a glob of shards, a COCO annotation file (.json, with `images`: its boxes, category
            ids, iscrowd, keypoints and image id become fields; see `sources.coco`), or a dataset:
            any object with len() and [i] giving (image, label), a dict with "image" and "label", or
            an image (see `packing.datasets`). A CSV's further header columns, a JSONL row's further
            keys, a tar sample's .json/.txt/.npy members and a dataset dict's further keys become
            per-sample fields (see `packing.fields`).
        dest: the store directory to create. One pack at a time may write it.
        mode: "raw" (size x size uint8 pixels), "jpeg" (encoded bytes) or "video" (video files, each
            kept as it is with its frame index, or re-encoded: `short_side`, `gop`, `fps`; the source a
            folder of videos, a .csv/.jsonl list with optional start and end columns in seconds, or
            tar shards; each file decoded once, a broken one skipped with the reason).
        size, fit: raw: the side, and "crop", "stretch" or "pad" to make an image square.
        quality, max_side, reencode: jpeg: re-encode quality, longest side kept, and whether
            upright RGB baseline JPEGs within max_side are re-encoded (False keeps their bytes).
        workers: local processes (default: every core).
        on_error: "skip" lists a bad file with its reason and goes on; "raise" stops at the first.
        overwrite: replace an existing `dest`.
        max_pixels: images whose header declares more pixels are skipped before decoding.
        progress: show a progress bar.
        engine, ray_address: "ray" packs on the Ray cluster at `ray_address` (the store is the
            same as a local pack's).
        shard_size: write a sharded store (format version 4): shards of about this many bytes (an
            int or "256MB"), each a self-contained unit a Loader downloads, verifies and caches. A
            URL `dest` (`s3://...`, any fsspec URL; `storage_options` are fsspec's) is always
            sharded (default "256MB"): the store is packed in a local scratch folder (TMPDIR), each
            shard uploaded as it is finished and the manifest last, so a reader never sees a half
            store. A store there is replaced (`overwrite`) only once the new one is packed whole.
        images: a COCO annotation file's folder of images (their "file_name"s are in it).
        exist_ok: keep a store already at `dest` that was packed from the same source with the same
            settings, and return its report (seconds 0, workers 0) without packing: a script that
            packs, then trains, runs again as it is. A store there packed otherwise is an error, or
            with `overwrite=True` replaced. (A local `dest` only.)
        short_side, gop, fps: video: re-encode each video as H.264 in MP4 with this short side, a
            keyframe every `gop` frames (a clip then never decodes more than one GOP it drops) and
            this frame rate; any one given re-encodes (None each: the files are stored as they are).

    Returns:
        A `PackReport`: count, skipped files with reasons, seconds, workers, bytes.

    Raises:
        PackError: nothing could be packed, or the first bad file with `on_error="raise"`.
        SourceError: the source can't be listed. StoreError: `dest` exists (with `exist_ok`: and is not
            a store of this source and these settings) or is being packed.
        Terminated (a SystemExit, status 143): SIGTERM arrived; as on Ctrl-C (KeyboardInterrupt),
            nothing is left at or beside `dest`.
        ValueError: a bad argument; `dest` inside a source folder, or a source inside `dest`.
    """
    # what the pack makes of each image, the same for a folder here and a bucket
    settings = dict(
        mode=mode,
        size=size,
        fit=fit,
        quality=quality,
        max_side=max_side,
        reencode=reencode,
        workers=workers,
        on_error=on_error,
        max_pixels=max_pixels,
        progress=progress,
        engine=engine,
        ray_address=ray_address,
        images=images,
        short_side=short_side,
        gop=gop,
        fps=fps,
    )
    if mode == "video" and (is_url(dest) or shard_size is not None):
        raise ValueError(f"{dest}: a video store is one folder on this machine (not sharded, not in a bucket) for now")
    if is_url(dest):
        if exist_ok:
            raise ValueError(f"{dest}: exist_ok is for a destination on this machine, not a URL")
        return pack_to_url(
            _pack_local,
            source,
            str(dest),
            overwrite=overwrite,
            shard_size=shard_size,
            storage_options=storage_options,
            **settings,
        )
    if storage_options is not None and not is_url(source):
        raise ValueError(f"{dest}: storage_options are for a source or destination in a bucket (a URL)")
    return _pack_local(
        source,
        dest,
        overwrite=overwrite,
        shard_size=shard_size,
        storage_options=storage_options,
        exist_ok=exist_ok,
        **settings,  # type: ignore[arg-type]
    )


def _pack_local(
    source: str | os.PathLike | Sequence,
    dest: str | os.PathLike,
    *,
    mode: str,
    size: int,
    fit: str,
    quality: int,
    max_side: int,
    reencode: bool,
    workers: int | None,
    on_error: str,
    overwrite: bool,
    max_pixels: int,
    progress: bool,
    engine: str,
    ray_address: str | None,
    shard_size: int | str | None,
    storage_options: dict | None,
    images: str | os.PathLike | None,
    exist_ok: bool = False,
    on_shard: Callable[[str, Path], None] | None = None,
    short_side: int | None = None,
    gop: int | None = None,
    fps: float | None = None,
) -> PackReport:
    """`pack` into a folder on this machine (its arguments); `on_shard(name, folder)`: called as each
    shard of a sharded store is finished (`upload` sends it to the bucket then)."""
    shard_bytes = parse_size(shard_size, "shard_size")
    _check_args(mode, size, fit, quality, max_side, on_error, engine)
    _check_video_args(mode, short_side, gop, fps)
    _check_places(source, dest)
    if images is not None:
        _check_places(images, dest)  # a COCO file's images: never inside the destination it replaces
    settings = worker.Settings(mode, size, fit, quality, max_side, reencode, max_pixels, short_side, gop, fps)
    dataset = dataset_source(source, max_pixels) if is_dataset(source) else None  # (lists nothing yet)
    recorded = {
        "source": dataset.description if dataset is not None else os.fspath(source),  # type: ignore[arg-type]
        "size": size,
        "fit": fit,
        "quality": quality,
        "max_side": max_side,
        "reencode": reencode,
        "max_pixels": max_pixels,
        "engine": engine,
        **({"short_side": short_side, "gop": gop, "fps": fps} if mode == "video" else {}),
    }
    if exist_ok and os.path.lexists(dest):
        kept = _existing(Path(dest), mode, recorded, shard_bytes is not None, overwrite, dataset is None)
        if kept is not None:
            log.debug("%s", kept.summary())
            return kept
    if mode == "video" and dataset is not None:
        raise ValueError("videos are packed from files (a folder, a .csv/.jsonl list or tar shards), not a dataset")
    src = (
        dataset if dataset is not None else open_source(source, storage_options, images, videos=mode == "video")  # type: ignore[arg-type]
    )
    skipped: list[dict[str, str]] = []

    def on_skip(s: Skip) -> bool:
        if on_error == "raise" and s.fatal:
            raise PackError(f"{s.name}: {s.reason}", skipped)
        skipped.append({"path": s.name, "reason": s.reason})
        return False

    t0 = time.perf_counter()
    with (
        _full_disk_said(dest),
        sigterm_stops(_pack_local.__code__) as stop,
        atomic_store_dir(dest, overwrite) as work,
        ExitStack() as opened,
    ):
        sink = RawSink(work, size) if mode == "raw" else VideoSink(work) if mode == "video" else JpegSink(work)
        opened.push(_abandoned_on_error(sink))
        fields = FieldsSink(work)
        opened.push(_abandoned_on_error(fields))
        run = engines.start(engine, workers or os.cpu_count() or 1, ray_address)
        executor, workers = run.executor, run.workers
        raw_path = str(sink.path) if mode == "raw" and run.local_disk else None  # type: ignore[union-attr]  # RawSink
        bar = tqdm(
            total=src.total,
            unit="img",
            desc="pack",
            disable=None if progress else True,  # None: on a tty only
            smoothing=0.1,
        )
        try:
            # a video a task: a worker's results come back whole (up to MAX_VIDEO_BYTES each), and a
            # video takes as long to index as a few hundred images
            chunks = _chunks(src.entries, sink, raw_path, on_skip, 1 if mode == "video" else CHUNK)
            for chunk, results in _bounded(executor, partial(worker.process, s=settings), chunks, 4 * workers):
                stop.check()
                _add(chunk, results, sink, fields, settings, on_skip)
                bar.update(len(chunk.items))
                bar.set_postfix(skipped=len(skipped), refresh=False)
        except BaseException:
            stop_now(executor)
            raise
        finally:
            bar.close()
            executor.shutdown(cancel_futures=True)
        if sink.count == 0:
            raise PackError(f"{src.description}: nothing could be packed ({len(skipped)} skipped)", skipped)
        stop.check()
        files = sink.finish()
        field_files, field_specs = fields.finish()
        files |= field_files
        stop.check()
        _manifest(work, settings, sink.count, src, files, skipped, field_specs, recorded)
        if shard_bytes is not None:  # the same samples, in shards (the report's bytes: the data's, as before)
            shard_in_place(work, shard_bytes, on_shard)
    stop.check()  # SIGTERM came as the store was being committed: it is complete, and the process ends
    seconds = time.perf_counter() - t0
    stored = sum(f["bytes"] for f in files.values())  # type: ignore[misc]  # a file entry's "bytes": an int
    report = PackReport(Path(dest), mode, sink.count, skipped, seconds, workers, stored)
    log.debug("%s", report.summary())
    return report


def _add(chunk, results, sink, fields: FieldsSink, s: worker.Settings, on_skip) -> None:
    """A chunk's images as the workers made them (`results`) into the store (`sink`) with their fields,
    each in its place; one whose decoded size is not the size its source declared, whose fields don't
    fit it, or that failed, is skipped with why (`on_skip`)."""
    for k, (item, done) in enumerate(zip(chunk.items, results)):
        error = done.error
        if error is None and item.hw is not None and tuple(done.source_hw or ()) != item.hw:
            error = _declared_size(item.hw, done.source_hw)
        given = item.fields
        clip = (0, 0)
        if error is None and done.video is not None:
            error, clip, given = clip_bounds(done.video, given)
        if error is None:
            stored = (s.size, s.size) if s.mode == "raw" else done.hw
            error, values = fields.check(given, Geometry(done.source_hw, stored, s.fit, s.mode))
        if error is None:
            if done.video is not None:
                sink.add_video(item.label, done.payload, done.video, clip, item.name)
            else:
                sink.add(chunk.start + k, item.label, done.payload, done.hw, item.name)
            fields.add(values)
        else:
            on_skip(Skip(item.name, error))


def _manifest(work: Path, s: worker.Settings, count: int, src, files, skipped, field_specs, recorded: dict) -> None:
    """The store's manifest, written last into `work`: what it holds, what was skipped and why, and the
    settings it was packed with (COCO's (id, name) pairs too, besides those `exist_ok` compares)."""
    fmt.Manifest(
        mode=s.mode,
        count=count,
        image_shape=[s.size, s.size, 3] if s.mode == "raw" else None,
        classes=src.classes,
        files=files,
        skipped=skipped,
        fields=field_specs,
        settings={**recorded, **({"categories": sorted(src.categories.items())} if src.categories else {})},
        gpufeed_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    ).write(work)


# the settings that make a store's samples what they are, by mode (the engine that packed them does not)
_DECISIVE = {
    "raw": ("source", "size", "fit", "max_pixels"),
    "jpeg": ("source", "quality", "max_side", "reencode", "max_pixels"),
    "video": ("source", "short_side", "gop", "fps"),
}


def _existing(
    dest: Path, mode: str, recorded: dict, sharded: bool, overwrite: bool, from_path: bool
) -> PackReport | None:
    """`pack(exist_ok=True)` with something at `dest`: the report of the complete store there if it was
    packed from this source with these settings; None (pack over it) if it was not and `overwrite`;
    else StoreError saying what differs. `from_path`: the source is a path (not a dataset), so
    "data/train" and "./data/train/" are one."""
    fix = "pass overwrite=True / --overwrite to replace it"
    try:
        manifest = fmt.Manifest.read(dest)
    except fmt.StoreError as e:
        if overwrite:
            return None
        raise fmt.StoreError(f"{dest}: destination exists and is not a complete gpufeed store ({e}); {fix}") from None
    asked = {**recorded, "mode": mode}
    had = {**manifest.settings, "mode": manifest.mode}
    if from_path and _same_path(had.get("source"), asked["source"]):
        had["source"] = asked["source"]
    differ = [
        f"{key} {had.get(key)!r} (asked: {asked[key]!r})"
        for key in ("mode", *_DECISIVE[mode])
        if had.get(key) != asked[key]
    ]
    if sharded != (manifest.version >= fmt.SHARDED_SINCE):
        differ.append("no shards (asked: a shard_size)" if sharded else "shards (asked: no shard_size)")
    damaged = [
        f"{name} is missing or not {entry['bytes']} bytes"
        for name, entry in manifest.files.items()
        if not (dest / name).is_file() or (dest / name).stat().st_size != entry["bytes"]
    ]
    if (differ or damaged) and overwrite:
        return None
    if differ:
        raise fmt.StoreError(f"{dest}: destination exists, a store packed with " + "; ".join(differ) + f"; {fix}")
    if damaged:
        raise fmt.StoreError(f"{dest}: destination exists, a damaged store: " + "; ".join(damaged) + f"; {fix}")
    stored = (
        sum(s["bytes"] for s in manifest.shards)
        if manifest.shards
        else sum(f["bytes"] for f in manifest.files.values())
    )
    return PackReport(dest, manifest.mode, manifest.count, list(manifest.skipped), 0.0, 0, stored, kept=True)


def _same_path(had: object, asked: str) -> bool:
    """True if the source path recorded in a store and the one asked for are the same, as written or
    resolved from here."""
    return isinstance(had, str) and (had == asked or os.path.realpath(had) == os.path.realpath(asked))


def shard_in_place(work: Path, shard_size: int, on_shard: Callable[[str, Path], None] | None = None) -> fmt.Manifest:
    """Turn the packed (version 3) store in `work` into a sharded one (version 4) in the same folder:
    the shards are written beside it, then its data files replaced by the shards and the top files,
    the manifest last."""
    from gpufeed.store.reader import Store  # the readers import torch: packing's workers must not
    from gpufeed.store.sharded import write_sharded

    staging = work / ".sharding"
    staging.mkdir()
    source = Store(work)
    top = write_sharded(source, staging, shard_size, on_shard)
    del source  # its memory maps: the files they map are removed next
    for entry in os.scandir(work):
        if entry.name != staging.name:
            os.remove(entry.path)
    for entry in os.scandir(staging):
        if entry.name != fmt.MANIFEST:
            os.replace(entry.path, work / entry.name)
    os.replace(staging / fmt.MANIFEST, work / fmt.MANIFEST)
    staging.rmdir()
    return top
