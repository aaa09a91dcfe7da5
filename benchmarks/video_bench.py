"""Video clips on one GPU (issue 67): decode alone and in training, on generated footage (a camera
panning over a natural image, objects moving, sensor noise: `synth.natural_video`) encoded with
libx264 at `--height` x `--width`, `--gop`, `--seconds` long, made here.

Rows, interleaved over `--rounds` (each row's median and range):
- decode alone: `Loader(store, clip=Clip(--frames, stride=2))` to `--size`² bf16 on the device
  (RandomResizedCrop, flip, Normalize) with `--threads` decode processes (again with
  `Tuning.skip_nonref` the other way, with `--containers` each clip through its container rather than
  from its packets alone, and with `--eval-clips` over an evaluation's clips in order; each row's frames
  decoded a clip in its JSON), as many threads (`num_workers=0`) and one process; PyAV decoding the same
  clips to RGB in one thread (what one DataLoader worker does); gpufeed's own decode to 4:2:0 planes in
  one thread, from each clip's packets and through its container (a decode process's rate for one core);
  `--compare`: other decoders on the same clips (`video_others.DECODERS`, to RGB, no augmentation, in
  `--threads` processes, `--gpu-processes` for those on the GPU) and DALI's GPU video reader with its
  crop, flip and normalize to fp16: clips/s and frames/s;
- training (`--model`, a torchvision video model, bf16, channels_last_3d, `--train-size`², NCTHW):
  the synthetic ceiling (one batch given again) and the model fed by gpufeed with each of
  `--train-workers` decode processes, once through containers with `--containers`, once with the
  next epoch's first batches not carried (what a small store's epochs cost without), once with
  `Tuning.skip_nonref` the other way, with
  `--nice` and `--nvdec`, and fed by `--train-others` (a torch DataLoader of PyAV clips with
  `--threads` workers, DALI), each with % of the ceiling, and in its JSON row the loop's wait in
  `next()` at every timed step, gpufeed's split between its epochs' first steps and the others (a
  small store's epochs start often: `--videos` / `--batch` batches an epoch); `--memory-epochs`:
  host memory over epochs. The JSON's `rows` hold every run with its details, `runs` the rates.

    python benchmarks/video_bench.py --videos 96 --rounds 2 --out video.json
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import replace
from concurrent.futures.process import BrokenProcessPool

import common
import numpy as np
import torch

SMOKE = dict(
    videos=4,
    seconds=1.0,
    height=48,
    width=64,
    frames=4,
    size=32,
    train_size=16,
    batch=2,
    batches=2,
    steps=2,
    warmup=0,
    rounds=1,
    threads=2,
    device="cpu",
    model="r3d_18",  # the training rows' path too (a few steps of the smallest torchvision video model)
    root=None,
    compare="decord",  # (not installed here: the row says so, the others are still written)
    gops="4",
    containers=True,
    eval_clips=2,
)


def _epochs(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def _clips_per_s(loader, batches: int, sync) -> tuple[float, int]:
    it = _epochs(loader)
    next(it)  # the first batch: the pass's start, not its rate
    sync()
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(it)
        n += x.shape[0]
    sync()
    it.close()
    return n / (time.perf_counter() - t0), n


def _clip_list(store, clips: int, frames: int, stride: int) -> list[tuple[int, list[int]]]:
    """`clips` clips (video, frame indices) at seeded random starts, the same for every library's row."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(clips):
        i = k % len(store)
        n = int(store.frame_offsets[i + 1] - store.frame_offsets[i])
        start = int(rng.integers(0, max(1, n - (frames - 1) * stride)))
        out.append((i, np.minimum(start + np.arange(frames) * stride, n - 1).tolist()))
    return out


def _other_clips(library: str, files: list[str], clips, processes: int) -> dict:
    """Clips/s of `library` decoding `clips` in `processes` processes (what a DataLoader with that many
    workers could decode at most: no augmentation, no copy to the GPU)."""
    from video_others import decode_share  # (a module: the pool's spawned processes import it by name)

    from gpufeed.processes import process_pool

    shares = [(library, files, clips[k::processes]) for k in range(processes)]
    try:
        with process_pool(processes) as pool:
            errors = [e for e in pool.map(decode_share, [(library, files, clips[:1])] * processes) if e]
            if errors:
                return {"error": errors[0]}
            t0 = time.perf_counter()
            errors = [e for e in pool.map(decode_share, shares) if e]
            seconds = time.perf_counter() - t0
    except BrokenProcessPool:  # the library crashed its process (a missing FFmpeg it loads, say)
        return {"error": f"{library} ended its process abruptly"}
    return {"error": errors[0]} if errors else {"clips_per_s": len(clips) / seconds}


def _without_packets(store_path):
    """A copy of the store at `store_path` (hard links) without its packets' index (`store.format`): its
    clips decode through their containers, as a store's packed before the index did."""
    import json

    from gpufeed.store import format as fmt

    copy = store_path.with_suffix(".containers")
    if not copy.exists():
        work = store_path.with_suffix(".containers-part")
        work.mkdir()
        manifest = json.loads((store_path / fmt.MANIFEST).read_text())
        for name in (fmt.VIDEO_PACKETS, fmt.VIDEO_DECODING):
            manifest["files"].pop(name, None)
        for name in manifest["files"]:
            os.link(store_path / name, work / name)
        (work / fmt.MANIFEST).write_text(json.dumps(manifest))
        work.rename(copy)
    return copy


def _skip_other_way(default):
    """`default` with `skip_nonref` the other way: every frame decoded where the default skips those it
    may (None: where pack checked them), else every H.264 video's skipped."""
    return replace(default, skip_nonref=default.skip_nonref is False)


def _tuned(tuning, default) -> str:
    """What a row's name says of its `skip_nonref` and `clip_batches` where they are not the default's."""
    name = ""
    if tuning.skip_nonref != default.skip_nonref:
        name += ", skipping unreferenced frames" if tuning.skip_nonref else ", decoding unreferenced frames"
    if tuning.clip_batches != default.clip_batches:
        name += f", {tuning.clip_batches} batches at once"
    return name


def _ints(text: str, but: int) -> list[int]:
    """The comma-separated ints of `text`, `but` (the default's, a row of its own already) left out."""
    return [int(v) for v in text.split(",") if v.strip() and int(v) != but]


def _pyav_clips(store, clips: int, frames: int, stride: int) -> float:
    """Clips/s of plain PyAV in this thread: open, seek to the keyframe before, decode, keep the frames."""
    from gpufeed.decode.codecs.video import ClipRequest, decode_clip

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for k in range(clips):
        i = k % len(store)
        index = store.video(i)
        span = (frames - 1) * stride + 1
        start = int(rng.integers(0, max(1, len(index) - span)))
        wanted = np.minimum(start + np.arange(frames) * stride, len(index) - 1)
        a, b = int(store.offsets[i]), int(store.offsets[i + 1])
        decode_clip(ClipRequest(store.data[a:b].data, index.pts, index.keyframe, index.stream, wanted))
    return clips / (time.perf_counter() - t0)


def _planes_clips(store, clips: int, frames: int, stride: int, packets: bool) -> tuple[float, float]:
    """(clips/s, frames decoded a clip) of gpufeed's decode in this thread, to 4:2:0 planes (a decode
    process's work for one clip), from each clip's packets alone or, without `packets`, through its
    container (opened and seeked)."""
    from gpufeed.decode.codecs.video import I420, ClipRequest, decode_clip_planes, keyframe_before
    from gpufeed.loader.video import clip_packets

    layout = I420.fitting(*(int(v) for v in np.asarray(store.shapes).max(axis=0)))
    out = np.empty((frames, *layout.shape), np.uint8)
    decoded = 0
    t0 = time.perf_counter()
    for i, wanted in _clip_list(store, clips, frames, stride):
        index = store.video(i)
        wanted = np.asarray(wanted)
        first = keyframe_before(index.keyframe, int(wanted.min()))
        own = clip_packets(index, first, int(wanted.max())) if packets else None
        a, b = int(store.offsets[i]), int(store.offsets[i + 1])
        request = ClipRequest(store.data[a:b].data, index.pts, index.keyframe, index.stream, wanted, packets=own)
        decoded += decode_clip_planes(request, layout, out)
    return clips / (time.perf_counter() - t0), decoded / clips


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--videos", type=int, default=96)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--height", type=int, default=320)
    p.add_argument("--width", type=int, default=568)
    p.add_argument("--gop", type=int, default=32)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--size", type=int, default=224, help="decode-alone rows' crop side")
    p.add_argument("--batch", type=int, default=16, help="clips per batch")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="decode processes (default: every core)")
    p.add_argument("--gpu-processes", type=int, default=8, help="processes of the --compare decoders on the GPU")
    p.add_argument(
        "--train-workers", default="", help="gpufeed's decode processes in the training rows (comma-separated; "
        "default: --threads)"
    )
    p.add_argument("--train-others", default="", help="other loaders' training rows: pyav, dali (comma-separated)")
    p.add_argument(
        "--decode-rows", default=None, help="num_workers of gpufeed's decode-alone rows (comma-separated; default: "
        "--threads, 0 and 1)"
    )
    p.add_argument(
        "--memory-epochs", type=int, default=0, help="also a Loader's memory (PSS: this process and its decode "
        "processes) after each of this many epochs, decoding alone"
    )
    p.add_argument(
        "--nvdec", action="store_true", help="also gpufeed's rows with the GPU's video engines beside the processes "
        '(decoders=("nvdec", "cpu"): TorchCodec installed), and decoding alone on them (("nvdec",))'
    )
    p.add_argument(
        "--nice", default="", help="also the first --train-workers row with its decode processes this much nicer "
        "(comma-separated; Tuning.decode_nice)"
    )
    p.add_argument(
        "--clip-batches", default="", help="also the first --decode-rows and --train-workers rows with this many "
        "batches of clips decoded at once (comma-separated; Tuning.clip_batches)"
    )
    p.add_argument(
        "--eval-clips", type=int, default=0, help="also the first --decode-rows row over an evaluation's clips: this "
        "many a video, in order (a video's clips next to each other decode in one pass)"
    )
    p.add_argument(
        "--containers", action="store_true", help="also the first --decode-rows row with each clip decoded through "
        "its container (a copy of the store without its packets' index, as stores packed before it)"
    )
    p.add_argument("--model", default="r2plus1d_18", help="torchvision video model, or none")
    p.add_argument("--train-size", type=int, default=112)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--root", default=None, help="work folder, kept, its videos and store reused")
    p.add_argument(
        "--gops",
        default="",
        help="also re-encode the videos at these GOPs (comma-separated) and give each store's bytes, frames "
        "decoded a clip and clips/s (uint8, no augment)",
    )
    p.add_argument(
        "--compare",
        default="torchcodec,decord",
        help="other decoders' rows (comma-separated; a row says why where one is not installed)",
    )
    a = common.parse(p, argv, SMOKE)
    from gpufeed import Clip, Loader, Store, pack, synth
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
    from gpufeed.decode.tuning import Tuning

    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = common.Rows(a.out, __file__)
    runs: dict[str, list[float]] = {}
    with common.workdir(a.root, "gpufeed-video-bench-") as root:
        frames = max(2, int(a.seconds * 30))
        folder = root / f"videos-{a.videos}-{a.height}x{a.width}-{frames}-g{a.gop}"
        if not folder.exists():
            synth.make_video_folder(
                folder,
                per_class=a.videos // 4 or 1,
                classes=min(4, a.videos),
                frames=(frames, frames),
                height=a.height,
                width=a.width,
                gop=a.gop,
            )
        store_path = folder.with_suffix(".store")
        if not store_path.exists():
            t0 = time.perf_counter()
            report = pack(folder, store_path, mode="video", progress=False)
            rows["packed"] = {"videos": report.count, "seconds": time.perf_counter() - t0, "bytes": report.bytes}
        store = Store(store_path)
        if a.gops:
            _gop_rows(a, folder, store_path, rows, runs)
        if a.memory_epochs:
            _memory_rows(a, store, device, rows)
        ops = [RandomResizedCrop(a.size), RandomHorizontalFlip(), Normalize()]
        clip = Clip(frames=a.frames, stride=2)
        counts = [int(w) for w in a.decode_rows.split(",")] if a.decode_rows else [a.threads, 0, 1]
        default = Tuning()
        decode_rows = [(w, None, default, store, clip) for w in dict.fromkeys(counts)]
        # the first count with `skip_nonref` the other way: frames decoded a clip and clips/s
        decode_rows.insert(1, (counts[0], None, _skip_other_way(default), store, clip))
        for n in _ints(a.clip_batches, default.clip_batches):  # the first count with more (or fewer) batches of clips at once
            decode_rows.insert(1, (counts[0], None, replace(default, clip_batches=n), store, clip))
        containers = Store(_without_packets(store_path)) if a.containers else None
        if containers is not None:  # the first count, each clip through its container (as packed before the index)
            decode_rows.insert(1, (counts[0], None, default, containers, clip))
        if a.eval_clips:  # the first count, an evaluation's clips in order (a video's decoded in one pass)
            decode_rows.insert(1, (counts[0], None, default, store, Clip(a.frames, 2, clips_per_video=a.eval_clips)))
        if a.nvdec:  # beside the processes, and alone (gpufeed's rate on the engines, against their limit)
            decode_rows[1:1] = [
                (counts[0], ("nvdec", "cpu"), default, store, clip),
                (counts[0], ("nvdec",), default, store, clip),
            ]
        for r in range(a.rounds):
            for workers, decoders, tuning, source, asked in decode_rows:
                try:
                    loader = Loader(
                        source,
                        batch_size=a.batch,
                        device=device,
                        augment=ops,
                        dtype=torch.bfloat16,
                        clip=asked,
                        shuffle=asked.clips_per_video is None,
                        num_workers=workers,
                        seed=r,
                        decoders=decoders,
                        tuning=tuning,
                    )
                except ValueError as e:  # the engines alone, where they can't be used (a CPU device, no TorchCodec)
                    if decoders != ("nvdec",):
                        raise
                    rows[f"NVDEC alone, round {r}"] = {"error": str(e)[:300]}
                    continue
                rate, n = _clips_per_s(loader, a.batches, sync)
                video = loader.video
                assert video is not None
                kind = "processes" if video.workers else "threads"
                name = f"gpufeed, {video.workers or video.threads} decode {kind}"
                if decoders == ("nvdec",):
                    name = f"gpufeed, NVDEC alone, {tuning.nvdec_threads} threads ({_nvdec_said(loader, rows, r)})"
                elif decoders is not None:
                    name += f" + NVDEC ({_nvdec_said(loader, rows, r)})"
                if source is not store:
                    name += ", through containers"
                if asked.clips_per_video:
                    name += f", evaluation ({asked.clips_per_video} clips a video, in order)"
                name += _tuned(tuning, default)
                stats = loader.stats()["video"]
                per_clip = stats["frames_decoded"] / max(1, stats["frames_delivered"]) * a.frames
                runs.setdefault(name, []).append(rate)
                rows[f"{name}, round {r}"] = {
                    "clips_per_s": rate,
                    "frames_per_s": rate * a.frames,
                    "clips": n,
                    "frames_decoded_per_clip": per_clip,  # (by the processes or threads)
                }
                loader.close()
            for packets in (True, False):  # (one core's decode: what each decode process does for a clip)
                rate, per_clip = _planes_clips(store, max(4, a.batch * 4), a.frames, 2, packets)
                name = f"gpufeed's decode to 4:2:0, one thread, {'from packets' if packets else 'through containers'}"
                runs.setdefault(name, []).append(rate)
                rows[f"{name}, round {r}"] = {
                    "clips_per_s": rate,
                    "frames_per_s": rate * a.frames,
                    "frames_decoded_per_clip": per_clip,
                }
            rate = _pyav_clips(store, max(4, a.batch * 2), a.frames, 2)
            runs.setdefault("PyAV, one thread", []).append(rate)
            rows[f"PyAV, one thread, round {r}"] = {"clips_per_s": rate, "frames_per_s": rate * a.frames}
            files = [store.source(i) for i in range(len(store))]
            cores = a.threads or len(os.sched_getaffinity(0))
            for library in a.compare.split(",") if a.compare else ():
                if library == "dali":
                    got = _dali_clips(a, store, files, sync)
                    name = "DALI video reader (GPU), crop, flip, normalize to fp16"
                else:
                    processes = min(a.gpu_processes, cores) if "cuda" in library or "nv" in library else cores
                    clips = _clip_list(store, a.batch * a.batches, a.frames, 2)
                    got = _other_clips(library, files, clips, processes)
                    where = "GPU" if "cuda" in library or "nv" in library else "CPU"
                    name = f"{library} {where}, {processes} processes (decode to RGB only)"
                rows[f"{name}, round {r}"] = got
                if "clips_per_s" in got:
                    runs.setdefault(name, []).append(got["clips_per_s"])
            if a.model != "none":
                _train(a, store, containers, device, sync, runs, rows, r)
    lines = [[name, common.cell(v, "{:,.1f}"), common.cell([x * a.frames for x in v])] for name, v in runs.items()]
    markdown = (
        f"{len(store)} videos {a.height}x{a.width}, GOP {a.gop}, clips of {a.frames} frames stride 2 "
        f"to {a.size}² bf16 (training: {a.model} at {a.train_size}²), batch {a.batch}\n\n"
        + common.table(["row", "clips/s", "frames/s"], lines)
    )
    return common.write(a, __file__, runs, markdown, a.device, rows=dict(rows))  # rows: each run with its details


def _gop_rows(a, folder, store_path, rows, runs) -> None:
    """The GOP's trade-off: the store re-encoded at each of `--gops` (a keyframe every that many
    frames, the other settings as packed), its bytes against the frames a clip decodes (from its
    keyframe on) and the clips/s decoded alone, beside the store as packed."""
    from gpufeed import Clip, Loader, pack

    stores = [("as packed", store_path)]
    for gop in (int(g) for g in a.gops.split(",")):
        out = store_path.with_name(f"{store_path.stem}-gop{gop}.store")
        if not out.exists():
            pack(folder, out, mode="video", progress=False, gop=gop, short_side=min(a.height, a.width))
        stores.append((f"re-encoded, GOP {gop}", out))
    for name, path in stores:
        loader = Loader(
            path,
            batch_size=a.batch,
            device=a.device,
            clip=Clip(frames=a.frames, stride=2),
            num_workers=a.threads,
            seed=0,
        )
        rate, _ = _clips_per_s(loader, a.batches, lambda: None)
        video = loader.stats()["video"]
        loader.close()
        nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        per_clip = video["frames_decoded"] / max(1, video["frames_delivered"]) * a.frames
        rows[f"GOP: {name}"] = {"bytes": nbytes, "frames_decoded_per_clip": per_clip, "clips_per_s": rate}
        label = f"GOP: {name} ({nbytes / 1e6:.1f} MB, {per_clip:.1f} frames decoded a clip), uint8"
        runs.setdefault(label, []).append(rate)


def _pss_mb(pid: int) -> float:
    """A process's proportional set size in MB (its share of the pages it shares: the decode slots and
    the store's map counted once over the processes that map them)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _memory_rows(a, store, device, rows) -> None:
    """Does host memory grow over epochs? A Loader decoding alone (augmented, as the decode rows)
    for `--memory-epochs` epochs: the PSS of this process and of its decode processes after each."""
    from gpufeed import Clip, Loader
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop

    ops = [RandomResizedCrop(a.size), RandomHorizontalFlip(), Normalize()]
    loader = Loader(store, batch_size=a.batch, device=device, augment=ops, dtype=torch.bfloat16,
                    clip=Clip(frames=a.frames, stride=2), num_workers=a.threads, seed=0)
    main, workers = [], []
    for _ in range(a.memory_epochs):
        for _ in loader:
            pass
        pool = loader.video._processes  # type: ignore[union-attr]  # (the decode processes, once started)
        main.append(_pss_mb(os.getpid()))
        workers.append(sum(_pss_mb(pid) for pid in (pool._processes if pool is not None else ())))
    loader.close()
    rows["memory"] = {
        "epochs": a.memory_epochs,
        "clips_per_epoch": len(loader) * a.batch,
        "main_pss_mb": [round(x, 1) for x in main],
        "workers_pss_mb": [round(x, 1) for x in workers],
    }


def _nvdec_said(loader, rows, r: int) -> str:
    """The engines' share of the clips in a row's name (and why they were off, in the rows)."""
    side = loader.stats()["video"]["nvdec"]
    if side is None:
        rows[f"NVDEC, round {r}"] = {"error": "; ".join(loader.stats()["notes"])[:300]}
        return "unavailable"
    if side["off"]:
        rows[f"NVDEC, round {r}"] = {"error": side["off"][:300]}
    clips = side["clips"]
    return f"{clips['gpu'] / max(1, clips['gpu'] + clips['cpu']):.0%} of the clips"


def _dali_clips(a, store, files, sync) -> dict:
    """Clips/s of DALI's GPU video reader to `--size`² fp16 (crop, flip, normalize), or why none."""
    try:
        from video_others import dali_video

        labels = [int(x) for x in store.labels]
        it = dali_video(files, labels, a.frames, 2, a.batch, a.size, threads=4)
        rate, _ = _clips_per_s(it, a.batches, sync)
    except Exception as e:  # noqa: BLE001  (not installed, or DALI refused: the row says why)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"clips_per_s": rate}


def _train(a, store, containers, device, sync, runs, rows, r: int) -> None:
    """The model's synthetic ceiling, then the model fed by gpufeed (and from `containers`, the store
    without its packets' index, where given) and by `--train-others`, in clips/s."""
    import torchvision

    from gpufeed import Clip, Loader
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
    from gpufeed.decode.tuning import Tuning

    model = getattr(torchvision.models.video, a.model)(num_classes=400).to(device, memory_format=torch.channels_last_3d)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    shape = (a.batch, 3, a.frames, a.train_size, a.train_size)
    x = torch.randn(shape, device=device).to(memory_format=torch.channels_last_3d)
    y = torch.randint(0, 400, (a.batch,), device=device)
    for _ in range(a.warmup):
        step(x, y)
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step(x, y)
    sync()
    ceiling = a.steps * a.batch / (time.perf_counter() - t0)
    runs.setdefault(f"{a.model}, synthetic ceiling", []).append(ceiling)
    rows[f"{a.model}, synthetic ceiling, round {r}"] = {"clips_per_s": ceiling}
    def fed(batches, name: str, per_epoch: int | None = None) -> None:
        """The loop fed by `batches` ((N, C, T, H, W) clips, labels on the device): a row, with the
        loop's wait in `next()` per timed step, and with `per_epoch` (batches an epoch) that wait at
        each epoch's first step against the others': where the wait falls names the limit."""
        waits = []
        for done in range(a.warmup + a.steps):
            if done == a.warmup:
                sync()
                t0 = time.perf_counter()
            w0 = time.perf_counter()
            xb, yb = next(batches)
            if done >= a.warmup:
                waits.append(time.perf_counter() - w0)
            step(xb.contiguous(memory_format=torch.channels_last_3d), yb % 400)
        sync()
        rate = a.steps * a.batch / (time.perf_counter() - t0)
        runs.setdefault(name, []).append(rate)
        row = {"clips_per_s": rate, "of_ceiling": rate / ceiling, "wait_ms_per_step": 1e3 * sum(waits) / len(waits),
               "wait_ms_each": [round(1e3 * w, 2) for w in waits]}
        if per_epoch:  # step k of the loop is batch k % per_epoch of its epoch
            first = [w for k, w in enumerate(waits, a.warmup) if k % per_epoch == 0]
            rest = [w for k, w in enumerate(waits, a.warmup) if k % per_epoch]
            row |= {"batches_an_epoch": per_epoch,
                    "wait_ms_epoch_first_steps": 1e3 * sum(first) / max(1, len(first)),
                    "wait_ms_other_steps": 1e3 * sum(rest) / max(1, len(rest)),
                    "wait_share_at_epoch_starts": sum(first) / max(sum(waits), 1e-9)}
        rows[f"{name}, round {r}"] = row

    ops = [RandomResizedCrop(a.train_size), RandomHorizontalFlip(), Normalize()]
    counts = [int(w) for w in a.train_workers.split(",")] if a.train_workers else [a.threads]
    default = Tuning()
    settings = [(counts[0], default), (counts[0], Tuning(carry=False))]
    settings += [(counts[0], Tuning(decode_nice=int(n))) for n in a.nice.split(",") if a.nice]
    settings += [(counts[0], _skip_other_way(default))]
    settings += [(counts[0], replace(default, clip_batches=n)) for n in _ints(a.clip_batches, default.clip_batches)]
    settings += [(w, default) for w in counts[1:]]
    settings = [(w, t, None, store) for w, t in settings]
    if a.nvdec:
        settings.insert(1, (counts[0], default, ("nvdec", "cpu"), store))
    if containers is not None:  # each clip through its container: what decoding from packets is worth here
        settings.insert(1, (counts[0], default, None, containers))
    for workers, tuning, decoders, source in settings:
        loader = Loader(
            source,
            batch_size=a.batch,
            device=device,
            augment=ops,
            dtype=torch.bfloat16,
            clip=Clip(frames=a.frames, stride=2, layout="NCTHW"),
            num_workers=workers,
            seed=r,
            tuning=tuning,
            decoders=decoders,
        )
        name = f"{a.model} fed by gpufeed, {loader.video.workers} decode processes"  # type: ignore[union-attr]
        if source is not store:
            name += ", through containers"
        if not tuning.carry:
            name += ", not carried"
        if tuning.decode_nice != default.decode_nice:
            name += f", nice {tuning.decode_nice}"
        name += _tuned(tuning, default)
        batches = _epochs(loader)
        fed(batches, name + (" + NVDEC" if decoders else ""), len(loader))
        if decoders:
            rows[f"{name} + NVDEC, round {r}, share"] = {"engines": _nvdec_said(loader, rows, r)}
        batches.close()
        loader.close()
    for other in a.train_others.split(",") if a.train_others else ():
        try:
            batches = _other_loader(other, a, store, device)
            fed(batches, f"{a.model} fed by {other}")
            batches.close()
        except Exception as e:  # noqa: BLE001  (not installed, or it failed: the row says why)
            rows[f"{a.model} fed by {other}, round {r}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        gc.collect()  # (DALI's pipeline and its threads go with it, before the next round's rows)


def _other_loader(name: str, a, store, device):
    """(N, C, T, H, W) normalized clips and labels on the device from another loader, epoch after epoch."""
    from video_others import PyAVClips, dali_video

    if name == "dali":
        files = [store.source(i) for i in range(len(store))]
        labels = [int(x) for x in store.labels]
        yield from dali_video(files, labels, a.frames, 2, a.batch, a.train_size, threads=4, layout="CFHW")
        return
    if name != "pyav":
        raise ValueError(f"unknown loader {name!r}: choose from pyav, dali")
    workers = a.threads or len(os.sched_getaffinity(0))
    data = PyAVClips(str(store.path), a.frames, 2, a.train_size)
    loader = torch.utils.data.DataLoader(
        data, batch_size=a.batch, shuffle=True, drop_last=True, num_workers=workers, pin_memory=True,
        persistent_workers=True, prefetch_factor=4, multiprocessing_context="spawn",
    )
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1, 1) * 255
    try:
        while True:
            for x, y in loader:
                x = x.to(device, non_blocking=True).float().sub_(mean).div_(std)
                yield x, y.to(device, non_blocking=True)
    finally:  # the persistent workers end with the row, not whenever the loader is collected
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()


if __name__ == "__main__":
    main()
