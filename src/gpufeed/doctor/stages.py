"""Time the stages a target lets us separate, in seconds per 1000 images.

- an image folder: read bytes, decode (Pillow), transform (RandomResizedCrop 224 + flip +
  ToTensor + Normalize), collate, host-to-device (as float32 from pageable memory, the usual way),
  and on a GPU the model step it feeds (ResNet-18 forward + backward), for scale;
- a gpufeed store: the Loader's own stages from `loader.stats()` (gather, decode, copy, augment,
  waiting for data);
- `module:function`: the user's iterable of (images, labels) batches: producing a batch, and
  host-to-device of what it yields (with its dtype and whether it is pinned).
Each stage runs under a `record_function` (and NVTX on a GPU) range for `--trace`.
"""

from __future__ import annotations

import importlib
import inspect
import io
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.profiler import record_function

from gpufeed.loader.stats import stage_range

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
WALL = "total (wall)"
WAIT = "waiting for data"  # the loop's idle time: a symptom of a slower stage, not a stage to make cheaper
QUEUE_FULL = "queue full (the loader waits for the loop)"  # the producers' idle time
IDLE = (WAIT, QUEUE_FULL)
# a store's stages on the loop's thread (the others run on the Loader's threads and processes, beside it)
LOOP = (WAIT, "hand-over", "augment", "augment (launch)", "between batches (the consumer's own time)")
PARTS = ("resize: of it, the tables' copies",)  # listed, and counted in their whole too
USAGE = "give module:function, a function that takes no arguments and returns an iterable of (images, labels) batches"


@dataclass
class Timings:
    """Seconds per 1000 images for each stage, plus facts the recommendations use."""

    kind: str
    images: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    unit: str = "img"  # what `images` counts: "clips" for a video store

    def per_1000(self) -> dict[str, float]:
        return {k: v * 1000 / max(self.images, 1) for k, v in self.seconds.items()}


def host_steal() -> tuple[int, int]:
    """(steal, all) CPU time of this host so far, in clock ticks, over all its CPUs (Linux /proc/stat;
    (0, 0) elsewhere). Steal is time a virtual CPU was ready to run while the hypervisor ran something
    else: another guest's load, which slows whatever runs here."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return (ticks[7], sum(ticks)) if len(ticks) == 8 else (0, 0)


@contextmanager
def stage(t: Timings, name: str, cuda: bool):
    """Time a stage (synchronising the GPU) inside a named profiler and NVTX range."""
    t0 = time.perf_counter()
    with stage_range(f"doctor.{name}", cuda):
        yield
        if cuda:
            torch.cuda.synchronize()
    t.seconds[name] = t.seconds.get(name, 0.0) + time.perf_counter() - t0


def decode(data: bytes) -> Image.Image:
    """Decode one image file's bytes (a stage of its own, so it can be measured and replaced)."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def folder(path: Path, limit: int, device: str) -> Timings:
    from torchvision import transforms

    from gpufeed.sources import Item, open_source

    # (a folder's items have paths)
    files: list[str] = [e.path for e in open_source(path).entries if isinstance(e, Item)][:limit]  # type: ignore[assignment]
    if not files:
        raise ValueError(f"{path}: no image files found")
    tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    t, cuda = Timings("image folder", len(files)), device == "cuda"
    skipped: dict[str, str] = {}  # what `gpufeed pack` would skip too: unreadable files, non-images
    with stage(t, "read bytes", False):
        datas = {f: data for f in files if (data := _attempt(skipped, f, Path(f).read_bytes)) is not None}
    with stage(t, "decode", False):
        images = [im for f, d in datas.items() if (im := _attempt(skipped, f, decode, d)) is not None]
    if skipped:
        t.facts["skipped"] = skipped
    if not images:
        first = next(iter(skipped.items()))
        raise ValueError(f"{path}: none of {len(files)} files could be read as an image (e.g. {first[0]}: {first[1]})")
    t.images, read = len(images), [d for f, d in datas.items() if f not in skipped]
    with stage(t, "transform", False):
        tensors = [tf(im) for im in images]
    with stage(t, "collate", False):
        batches = [torch.stack(tensors[k : k + 64]) for k in range(0, len(tensors), 64)]
    t.facts.update(
        dtype="float32",
        pinned=False,
        mean_kb=sum(map(len, read)) / len(read) / 1e3,
        mean_pixels=sum(im.size[0] * im.size[1] for im in images) / len(images),
    )
    if cuda:
        with stage(t, "host-to-device", True):
            batches = [b.to(device) for b in batches]
        model_step(t, batches, device)
    return t


def _attempt(skipped: dict[str, str], name, fn, *args):
    """`fn(*args)`, or None with the reason recorded under `name` in `skipped`."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  OSError (a symlink loop, a FIFO gone), Pillow's UnidentifiedImageError, ...
        skipped[str(name)] = f"{type(e).__name__}: {e}"
        return None


def model_step(t: Timings, batches: list[torch.Tensor], device: str) -> None:
    """The step the data feeds, for scale: ResNet-18 forward + backward (bf16 autocast) on the batches."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=10).to(device)
    run = lambda b: torch.nn.functional.cross_entropy(  # noqa: E731
        model(b.to(device).float()), torch.zeros(len(b), dtype=torch.int64, device=device)
    ).backward()
    with torch.autocast(device, dtype=torch.bfloat16):
        run(batches[0][:2])  # warm-up: kernels, allocator
        with stage(t, "model step (ResNet-18)", device == "cuda"):
            for b in batches:
                run(b)


def store(path: Path, batches: int, device: str) -> Timings:
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
    from gpufeed.loader import Loader
    from gpufeed.store import open_store

    opened = open_store(path)
    loader = Loader(
        opened,
        batch_size=min(64, len(opened)),
        device=device,
        shuffle=True,
        augment=[RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)],
    )
    if loader.jpeg is not None:  # the GPU decoders open on a thread (`Tuning.open_ahead`): measured open
        loader.jpeg.opened(60)
    t = Timings(f"gpufeed {loader.store.mode} store", 0, unit="clips" if loader.video is not None else "img")
    t0 = time.perf_counter()
    with record_function("doctor.gpufeed loader"):
        for k, (images, _) in enumerate(loader):
            t.images += len(images)
            if k + 1 >= batches:
                break
        if device == "cuda":
            torch.cuda.synchronize()
    stats = loader.stats()
    names = {
        "gather": "gather",
        "h2d_issue": "host-to-device (issue)",
        "wait": "waiting for data",
        "consumer": "between batches (the consumer's own time)",
        "augment": "augment (launch)" if device == "cuda" else "augment",
        "resize.copies": PARTS[0],
        "queue_full": QUEUE_FULL,
        "hand_over": "hand-over",
    }
    t.seconds = {names.get(k, k): v for k, v in stats["seconds"].items()}
    t.seconds[WALL] = time.perf_counter() - t0
    t.facts.update(
        tier=loader.tier.name,
        tier_reason=loader.tier.reason,
        decoders=stats.get("decoders"),
        decoded_by=stats.get("decoded_by"),
        mode=loader.store.mode,
    )
    if "video" in stats:  # how its clips were decoded, and what the Loader said (NVDEC not usable here)
        t.facts.update(video=stats["video"], notes=stats["notes"])
    # the CPU workers' pace: what a jpeg store can feed without the GPU decoders (every image they decoded
    # over their seconds: the images of batches collected alone would leave out the next batch's, decoded)
    workers = loader.jpeg.workers if loader.jpeg is not None else None
    if workers is not None and workers.rate > 0:
        t.facts.update(cpu_workers=workers.size, cpu_worker_rate=workers.rate)
    loader.close()
    return t


@contextmanager
def _current_folder_importable():
    """The current folder on sys.path while the user's code loads and runs, as `python -m` puts it there
    (the console script puts its own folder instead); taken off again after."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _factory(spec: str):
    """The function `spec` ("module:function") names, checked to be callable without arguments."""
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise ValueError(f"{spec}: cannot load it ({e}); {USAGE}") from None  # one of the module's imports
        raise ValueError(
            f"{spec}: {e}: not in the current folder ({os.getcwd()}) nor on sys.path; run doctor from "
            "the folder that holds it, or add that folder to PYTHONPATH"
        ) from None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{spec}: cannot load it ({e}); {USAGE}") from None
    if not callable(factory):
        raise ValueError(f"{spec}: {name} is a {type(factory).__name__}, not a function; {USAGE}")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ValueError(f"{spec}: it needs arguments; {USAGE}") from None
    except ValueError:  # no signature to read (some builtins): the call tells
        pass
    return factory


def _images(spec: str, item) -> torch.Tensor:
    """The images of one batch the user's iterable yielded."""
    if isinstance(item, (tuple, list)) and item and isinstance(item[0], torch.Tensor) and item[0].dim() > 0:
        return item[0]
    raise ValueError(f"{spec}: it yielded a {type(item).__name__}, not an (images, labels) batch; {USAGE}")


def iterable(spec: str, batches: int, device: str) -> Timings:
    with _current_folder_importable():
        return _time_iterable(spec, batches, device)


def _time_iterable(spec: str, batches: int, device: str) -> Timings:
    made = _factory(spec)()
    try:
        it = iter(made)
    except TypeError:
        raise ValueError(f"{spec}: it returned a {type(made).__name__}, not an iterable; {USAGE}") from None
    t, cuda = Timings(f"your iterable {spec}"), device == "cuda"
    for _ in range(batches):
        with stage(t, "produce batch (your iterable)", False):
            try:
                item = next(it)
            except StopIteration:
                break
        images = _images(spec, item)
        t.images += len(images)
        t.facts.update(
            dtype=str(images.dtype).replace("torch.", ""), pinned=images.is_pinned(), on_device=images.device.type
        )
        if cuda and images.device.type == "cpu":
            with stage(t, "host-to-device", True):
                images.to(device, non_blocking=True)
    if not t.images:
        raise ValueError(f"{spec}: it yielded no batches; {USAGE}")
    return t
