"""Which JPEG decoders a pipeline gets: the names a user may ask for, the default, and making the
GPU ones (each that can't be made here is said once, with the reason and the fix)."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from gpufeed.decode.base import nvimgcodec_install
from gpufeed.logs import logger

log = logger(__name__)
START_RATES = {"hw": 15_000.0, "nvjpeg": 10_000.0, "cuda": 8_000.0}
KNOWN = ("hw", "nvjpeg", "cuda", "cpu")
# the default: one GPU decoder (the engines through nvImageCodec where installed, else nvJPEG) and the
# CPU workers. Two GPU decoders at once decode faster alone but slow the training loop they feed
# (docs/benchmarks.md, "One GPU decoder")
DEFAULT = ("hw", "nvjpeg", "cpu")

# the engines' decoder makes its buffers for a whole batch of the store's images at once
# (`decoder_room`, unless `Tuning.prealloc` is off), sides at most ROOM_SIDE, ROOM_PIXELS in all (RGB
# buffers for them all would take 400 MB)
ROOM_SIDE = 1024
ROOM_PIXELS = 1 << 27

_warned: set[str] = set()  # every pipeline of every loader builds its decoders: say each reason once
# per CUDA device index: an idle engines' decoder kept for the process (`keep_idle`)
_kept: dict[int, Any] = {}
_keeping = threading.Lock()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _nvimgcodec(
    device: torch.device, name: str, cpu_threads: int, room: tuple[int, int, int] | None = None, padding: int = 32 << 20
):
    """An nvImageCodec decoder (`hw` engines or `cuda` hybrid), or None with the reason logged once."""
    what = {"hw": "the GPU's hardware JPEG engines", "cuda": "nvImageCodec's CUDA decoder"}[name]
    try:
        from gpufeed.decode.codecs.nvimgcodec import NvImgCodecDecoder

        return NvImgCodecDecoder(device, name, cpu_threads, room, padding)
    except ImportError:
        warn_once(f"nvImageCodec is not installed ({nvimgcodec_install()}): {what} stay(s) unused")
    except Exception as e:  # noqa: BLE001  no engines on this GPU, driver too old, a wheel for another CUDA, ...
        warn_once(
            f"{what} unavailable ({e}): using the other decoders; `gpufeed doctor` checks the versions "
            "of the driver, torch and nvImageCodec and names the fix"
        )
    return None


def _nvjpeg(device: torch.device):
    """torchvision's nvJPEG decoder, imported only when asked for: torchvision's import brings
    torch._dynamo's, seconds before a first batch that the other decoders make without it."""
    try:
        from gpufeed.decode.codecs.nvjpeg import NvJpegDecoder

        return NvJpegDecoder(device)
    except ImportError as e:  # a torchvision without its image codecs (`nvjpeg.problem` says which)
        warn_once(f"{e}: using the other decoders")
        return None


def load_ahead(device: torch.device, use: tuple[str, ...] | None) -> None:
    """Start opening nvImageCodec (its library, an instance and its JPEG extensions made, once a
    process: `nvimgcodec_api.open_library`) on a thread of its own where `use` would make one of its
    decoders on `device`. A Loader reading a folder in place calls this before it indexes the folder:
    indexing 50,000 files takes 0.6-1.2 s, opening the library 1 s in a fresh process (0.57 s of it
    making the extensions), and the two then overlap, since the opening lets go of the GIL; one of a
    jpeg store calls it once the store is open, before it makes its pipelines and what they hold. The
    decoders' opening (`gpu_decoders`, on the pipeline's own thread) then finds it open, or waits for
    it. Making the extensions sends stderr aside meanwhile (`pixels.quiet_codecs`): decode workers
    started then get the process's own (`gpufeed.stderr.child_stderr`), and the index's warnings reach
    stderr once it is back. Nothing is said here: where the opening fails, the decoders' opening
    fails the same way and says why."""
    names = DEFAULT if use is None else use
    if device.type != "cuda" or not {"hw", "cuda"} & set(names):
        return
    from gpufeed.decode.codecs import nvimgcodec_api

    def load() -> None:
        try:
            nvimgcodec_api.open_library()
        except Exception:  # noqa: BLE001  said by the decoders' opening, which tries again
            pass

    loader = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-nvimgcodec")
    loader.submit(load)
    loader.shutdown(wait=False)  # its one thread ends with the load; the interpreter joins it at exit


def check_decoders(names: tuple[str, ...]) -> None:
    """Raise ValueError naming any of `names` that is not a decoder."""
    unknown = set(names) - set(KNOWN)
    if unknown:
        raise ValueError(f"unknown decoders {sorted(unknown)}: choose from {', '.join(KNOWN)}")


def gpu_decoders(
    device: torch.device,
    use: tuple[str, ...] | None,
    host_threads: int,
    room: tuple[int, int, int] | None = None,
    padding: int = 32 << 20,
    warm: bool = False,
) -> list:
    """The GPU decoders of `use` that can be made on `device` (none on a CPU); `use` None: the first of
    `DEFAULT`'s that can be made (the others are never built). `host_threads`: nvImageCodec's host threads;
    `room`: (images, width, height) of the batches the engines' decoder makes its buffers for;
    `padding`: what nvJPEG rounds its allocations up to, in bytes; `warm`: each decodes one small
    image before it is returned (`warmed`)."""
    first_only = use is None
    use = DEFAULT if use is None else use
    check_decoders(use)
    made = []
    for name in [name for name in KNOWN[:-1] if name in use] if device.type == "cuda" else []:
        decoder = _taken_back(device) if name == "hw" else None
        fresh = decoder is None  # (one taken back decoded before: no warming)
        if fresh:
            decoder = _nvjpeg(device) if name == "nvjpeg" else _nvimgcodec(device, name, host_threads, room, padding)
        if decoder is not None and (not fresh or not warm or warmed(decoder, device)):
            made.append(decoder)
            if first_only:
                break
    return made


def _taken_back(device: torch.device):
    """The engines' decoder kept idle for `device` (`keep_idle`), taken out of the keeping for one
    pipeline; None where none is kept (or another pipeline has it). Its room and host threads are
    those of the pipeline that made it: nvJPEG grows a buffer a batch outgrows."""
    with _keeping:
        engines = _kept.pop(device.index or 0, None)
    if engines is not None:
        engines.taken_back()
    return engines


def let_go_kept() -> int:
    """Let go of the engines' decoders kept idle (`keep_idle`), destroyed once unreferenced, so that
    the next Loader makes its own as a process's first does (a benchmark's rows of first Loaders,
    as `pool.shared.stop_idle` stops the idle workers); how many."""
    with _keeping:
        kept = list(_kept.values())
        _kept.clear()
    for engines in kept:
        engines.taken_back()
    return len(kept)


def keep_idle(decoders: list) -> None:
    """Keep an engines' decoder of `decoders` (a closing pipeline's: none is used again) for the rest of
    the process, where its GPU has none kept yet: never destroyed, as nvImageCodec's instance is, and
    its output buffers let go. The next pipeline to open the engines on that GPU takes it back
    (`_taken_back`) rather than making one: an engines' decoder made and warmed takes 0.9-1.0 s while
    no other is alive in the process, and 0.10-0.15 s beside one (H200, docs/benchmarks.md "Start-up
    and GPU memory"), so every later Loader of the process (an evaluation pass each epoch, an
    inference run after training) has its engines at work as soon as its pipeline starts. Kept at
    the close, it costs the loader's start nothing (making an idle one while the decoders opened held
    the first Loader's engines back by a second or more)."""
    # (nvImageCodec's engines; a test's stand-in has no `keep_for_process`)
    engines = next((d for d in decoders if d.name == "hw" and hasattr(d, "keep_for_process")), None)
    if engines is None:
        return
    index = engines.device.index or 0
    with _keeping:
        if index in _kept:
            return
        try:
            engines.keep_for_process()
        except Exception as e:  # noqa: BLE001  (a CUDA error of the process's): let go as usual
            log.debug("gpufeed: no idle engines' decoder kept (%s)", e)
            return
        _kept[index] = engines


def warmed(decoder, device: torch.device) -> bool:
    """Decode one small JPEG with `decoder`, so that what its first decode sets up (the engines: 0.6 s
    in a fresh process on an H100, docs/benchmarks.md "Start-up and GPU memory") is not on a batch's
    time. False, with the reason said once, where it fails: the decoder is not used."""
    from PIL import Image

    from gpufeed.decode.base import Encoded

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 90, 60)).save(buf, format="JPEG", quality=90)
    tiny = buf.getvalue()
    try:
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            part = decoder.decode(Encoded.joined([tiny]), np.array([[64, 64]]))
        stream.synchronize()
    except Exception as e:  # noqa: BLE001  a decoder that was made but cannot decode here (a driver, a wheel)
        warn_once(f"the {decoder.name} JPEG decoder failed its first decode ({e}): using the other decoders")
        return False
    if part.on_done is not None:
        part.on_done(None)
    if part.failed:
        warn_once(f"the {decoder.name} JPEG decoder could not decode a plain JPEG ({part.failed[0]}): using the others")
        return False
    return True


def decoder_room(shapes: np.ndarray, batch_size: int, prealloc: bool = True) -> tuple[int, int, int] | None:
    """(images, width, height) for the GPU decoders' first buffers (`BatchDecoder`): a whole batch of
    images (fewer if they would pass ROOM_PIXELS) as wide and as tall as 99 % of the store's (stored
    `shapes` (N, 2) height, width), rounded up to 64 and at most ROOM_SIDE; None without `prealloc`
    (one 1x1 image, nvImageCodec's default) or for an empty store."""
    if not prealloc or not len(shapes):
        return None
    sides = np.ceil(np.percentile(shapes, 99, axis=0) / 64) * 64
    height, width = np.minimum(sides, ROOM_SIDE).astype(int).tolist()
    return max(1, min(batch_size, ROOM_PIXELS // (width * height))), width, height
