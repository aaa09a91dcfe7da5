"""`diagnose(target)`: time the stages, rank them, recommend, and say what gpufeed would use here."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpufeed.decode.base import nvimgcodec_install
from gpufeed.decode.codecs import cpu, nvjpeg
from gpufeed.decode.pool.segment import unavailable
from gpufeed.doctor import stages
from gpufeed.doctor.report import findings, table
from gpufeed.doctor.versions import report as versions


def _rank_line(device: str) -> str:
    """The cores this process may use and the decode workers a jpeg Loader starts by default, with its
    rank under torchrun (run `gpufeed doctor` under torchrun to see each rank's)."""
    from gpufeed.loader.cores import rank_cores
    from gpufeed.loader.jpeg import default_workers

    rank = os.environ.get("RANK")
    who = (
        f"rank {rank} of {os.environ.get('WORLD_SIZE', '?')} (local {os.environ.get('LOCAL_RANK', '?')})"
        if rank is not None
        else "this process"
    )
    return (
        f"{who}: {rank_cores().describe()}; a jpeg Loader starts "
        f"{default_workers(torch.device(device))} CPU decode workers by default"
    )


def _jpeg_decoders() -> str:
    """The JPEG decoders a Loader on this GPU can use, and why any of the GPU ones can't."""
    found, missing = [], []
    try:
        from gpufeed.decode.codecs.nvimgcodec import NvImgCodecDecoder

        NvImgCodecDecoder(torch.device("cuda", torch.cuda.current_device()), "hw")
        found.append("hardware engines (nvImageCodec)")
    except Exception:  # noqa: BLE001  any failure: said as missing
        missing.append(f"nvImageCodec missing or unsupported; {nvimgcodec_install()}")
    why_not = nvjpeg.problem()  # torchvision's decoder, deprecated since its 0.29
    if why_not is None:
        found.append("nvJPEG")
    else:
        missing.append(why_not)
    return f"jpeg decoders available: {' + '.join(found + ['CPU'])}" + (f" ({'; '.join(missing)})" if missing else "")


def _video_lines(video: dict, notes: list[str], device: str) -> list[str]:
    """How a video store's clips were decoded: the processes (or threads), the frames decoded a clip,
    the videos decoded through their containers (slower), the GPU's engines if the Loader used them,
    and whether TorchCodec could drive them here."""
    from gpufeed.decode.codecs.nvdec import NvdecUnavailable, open_torchcodec

    who = (
        f"{video['processes']} decode processes (niceness {video['niceness']})"
        if video["processes"]
        else f"{video['threads']} decode threads"
    )
    per_clip = video["frames_decoded"] / max(1, video["frames_delivered"])
    lines = [
        f"gpufeed video decode: {who}; {per_clip:.1f} frames decoded for each frame a clip holds (from "
        "each clip's keyframe: re-encode with a shorter GOP to lower it)"
    ]
    if video.get("through_container"):
        lines.append(
            f"gpufeed video decode: {video['through_container']} video(s) decoded through their containers, about a "
            "tenth slower a clip than from their packets alone (an earlier gpufeed packed the store, or their "
            "codec or container does not allow it: pack again, or re-encode with gop=)"
        )
    if device == "cuda":
        try:
            open_torchcodec()
            lines.append('NVDEC (decoders=("nvdec", "cpu")): available through TorchCodec; not the default')
        except NvdecUnavailable as e:
            lines.append(f'NVDEC (decoders=("nvdec", "cpu")): unavailable: {e}')
    lines += [f"gpufeed said: {note}" for note in notes]
    return lines


def _gpufeed_here(t: stages.Timings, device: str) -> list[str]:
    lines = versions()
    lines.append(_rank_line(device))
    if t.facts.get("skipped"):
        shown = "; ".join(f"{k}: {v}" for k, v in list(t.facts["skipped"].items())[:3])
        lines.append(
            f"skipped {len(t.facts['skipped'])} file(s) that are not readable images ({shown}"
            f"{'; ...' if len(t.facts['skipped']) > 3 else ''})"
        )
    if "tier" in t.facts:
        lines.append(f"gpufeed tier: {t.facts['tier']} ({t.facts['tier_reason']})")
    if t.facts.get("decoders"):
        lines.append(f"gpufeed decoders: {' + '.join(t.facts['decoders'])} (decoded: {t.facts['decoded_by']})")
    if t.facts.get("cpu_workers"):
        workers, rate = t.facts["cpu_workers"], t.facts["cpu_worker_rate"]
        lines.append(
            f"gpufeed CPU decode: {workers} worker processes at {rate:,.0f} img/s each while decoding, "
            f"about {workers * rate:,.0f} img/s together on this rank's cores"
            + (
                "; a model that trains faster waits for them (the GPU decoders take only what they "
                "can't: beside a model they cost it more), and a raw store needs no decoding"
                if device == "cuda"
                else ""
            )
        )
    if t.facts.get("video"):
        lines += _video_lines(t.facts["video"], t.facts.get("notes", []), device)
    if device == "cuda" and "tier" not in t.facts:
        free, _ = torch.cuda.mem_get_info()
        lines.append(f"gpufeed would keep a store of up to {free / 2e9:.0f} GB in GPU memory (the gpu tier)")
    if device == "cuda":
        lines.append(_jpeg_decoders())
    else:
        lines.append("no CUDA GPU here: gpufeed runs its pipeline on the CPU (no pinning, no GPU decode)")
    why = unavailable()
    lines.append(
        "CPU JPEG decode: in worker processes"
        if why is None
        else f"CPU JPEG decode: on threads, which share the GIL with the training loop (slower): {why}"
    )
    problem, regions = cpu.roi_problem(), "CPU JPEG decode of crop regions alone"
    if problem is None:
        lines.append(f"{regions}: available (nvImageCodec's CPU backend)")
    elif not cpu.roi_available() and not torch.cuda.is_available():  # no GPU here for the GPU package it would need
        lines.append(f"{regions}: unavailable, whole images instead (slower)")
    else:
        lines.append(f"{regions}: unavailable, whole images instead (slower): {problem}")
    return lines


def diagnose(target: str | None, device: str | None = None, limit: int = 256, trace: str | Path | None = None) -> dict:
    """Profile `target` (image folder, gpufeed store or module:function) and return the report.

    Without a target, only the environment: versions, mismatches, and what gpufeed would use here.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = Path(target or "")

    def run() -> stages.Timings:
        if target is None:
            return stages.Timings("environment")
        if (path / "manifest.json").is_file():
            return stages.store(path, max(2, limit // 64), device)
        if path.is_dir():
            return stages.folder(path, limit, device)
        if ":" in target and not path.exists():
            return stages.iterable(target, max(2, limit // 64), device)
        raise ValueError(f"{target}: not an image folder, a gpufeed store or module:function")

    steal0 = stages.host_steal()
    if trace:
        activities = [torch.profiler.ProfilerActivity.CPU]
        activities += [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
        with torch.profiler.profile(activities=activities) as prof:
            timings = run()
        prof.export_chrome_trace(str(trace))
    else:
        timings = run()
    steal, total = (b - a for a, b in zip(steal0, stages.host_steal()))
    if total > 0:
        timings.facts["host_steal_share"] = steal / total
    report = {
        "target": target,
        "kind": timings.kind,
        "device": device,
        "images": timings.images,
        "unit": "clips" if timings.unit == "clips" else "images",
        "seconds_per_1000": timings.per_1000(),
        "facts": timings.facts,
        "findings": findings(timings, device == "cuda", torch.cuda.is_available()),
        "table": table(timings),
        "gpufeed": _gpufeed_here(timings, device),
    }
    return report
