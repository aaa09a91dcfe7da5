"""Reading a folder of images in place against reading the store packed from it, and DALI's
`readers.file` on the same folder where nvidia-dali is installed (a benchmark-only import).

The folder: `--n` JPEGs (`--data photos`, the default: photo-like ones of ImageNet's spread of sizes
and qualities, benchmarks/photos.py; `--data smooth`: generated `--image` sized q90 ones), of which a fraction `--mixed` are made PNG, progressive JPEGs or
EXIF-rotated photos in turn (what the decoders can't read as they are: the in-place reader
re-encodes them once, when it builds its index). Times: building the index (cold, no cache file),
opening with the cached index, and one evaluation pass (Resize(256), CenterCrop(224), Normalize,
float16) over the folder (and a second with the same Loader), over a jpeg store packed from it with
its bytes kept (`reencode=False`), over that store again with the same Loader (its steady state:
nothing left to start), and through DALI (its pipeline build timed too); the CUDA context is made
before them all. Each of those is the process's first Loader (no decode worker running, no GPU decoder kept
idle, no decoder rates learned: all let go before each row, DALI's too; a second DALI row runs beside
the engines' decoder the gpufeed row before it kept, as DALI's rows did before 2026-12-07); a next Loader made right after each (an
evaluation each epoch) takes the running workers, the GPU decoder the one before kept and the rates
it measured, and its pass is a row of its own. Each pass is timed from the constructor call: to its return ("construct"), to the
first batch on the device ("first batch") and to the last ("pass"); img/s is images over the whole.
gpufeed's passes also give where the time went (the Loader's `stats()["start"]`, seconds from the
constructor call): Triton's once-a-process work done (0: before the constructor), the last decode
worker's ready heard, the GPU decoders taken into use, and the rate after the first batch; and
each decode worker's start in steps: to its `main` (interpreter, numpy), imports, nvImageCodec's
decoder, heard.
With `--fresh`, the store's, the folder's and DALI's first pass also run each in a new interpreter
(its CUDA context and the reader's imports made before the timer, their seconds noted under the
table): a process's first Loader as an evaluation script has it, with nothing of an earlier row's
in the process (nvImageCodec's library loaded, DALI's state).
The rows are interleaved over `--rounds`, so host drift hits each alike; the table gives median
(min-max) over the rounds.

    python benchmarks/folder_bench.py --n 2000 --device cuda --rounds 3 --out folder.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import common
import feeds
import photos
import waits

PYSPY_SECONDS = 2  # py-spy's record of a watched pass (`--pyspy`), from its attaching (about a second) on
SMOKE = dict(n=16, image="64x48", size=32, device="cpu", batch=4, rounds=1, root=None, mixed=0.25)


@dataclass
class Pass:
    """One timed pass: seconds from the constructor call to its return, to the first batch on the
    device and to the last; the images it gave."""

    construct: float
    first: float
    total: float
    images: int
    decoded_by: dict | None = None  # gpufeed's: images per decoder (the GPU decoders join once open)
    after_first: float | None = None  # img/s from the first batch on the device to the last
    stats: dict | None = None  # gpufeed's: the Loader's stats() at the pass's end (seconds since its start)

    @property
    def rate(self) -> float:
        return self.images / self.total


def split(runs: list[Pass]) -> list[str]:
    """Median seconds from the constructor call to Triton's work done (0: before it), the last decode
    worker ready, the GPU decoders in use: "-" where no run had it (DALI; a CPU)."""
    def median(key):
        values = []
        for r in runs:
            at = ((r.stats or {}).get("start") or {}).get(key)
            if isinstance(at, list):
                at = max(at) if at else None
            if at is not None:
                values.append(max(0.0, at))
        return f"{statistics.median(values):.3f}" if values else "-"

    return [median("triton_ready_s"), median("workers_ready_s"), median("gpu_decoders_in_use_s")]


def after_first(runs: list[Pass]) -> str:
    rates = [r.after_first for r in runs if r.after_first]
    return common.cell(rates) if rates else "-"


def gpufeed_passes(path: Path, device: str, batch: int, size: int, passes: int = 1, tuning=None, step=None,
                   watch: str | None = None) -> list[Pass]:
    """`passes` evaluation passes with one Loader (the later ones: its steady state; `tuning`: its
    `Tuning`, None the default; `step`: what each batch goes through, a model's inference; `watch`: the
    last pass watched by `waits.Watch` with py-spy in this mode, its findings in its stats' "waits")."""
    import gpufeed
    from gpufeed.augment import CenterCrop, Normalize, Resize
    from gpufeed.bench.common import sync

    recipe = [Resize(round(size * 8 / 7)), CenterCrop(size), Normalize()]
    t0 = time.perf_counter()
    loader = gpufeed.Loader(path, batch_size=batch, device=device, shuffle=False, drop_last=False, augment=recipe,
                            **({} if tuning is None else {"tuning": tuning}))
    construct = time.perf_counter() - t0
    out = []
    for k in range(passes):
        first, first_count, count = None, 0, 0
        watching = waits.Watch(watch, PYSPY_SECONDS, mine="gpufeed_passes") if watch and k == passes - 1 else None
        if k:
            t0, construct = time.perf_counter(), 0.0
        for images, _ in loader:
            count += len(images)
            if step is not None:
                step(images)
            if first is None:
                sync(device)
                first, first_count = time.perf_counter() - t0, count
        sync(device)
        total = time.perf_counter() - t0
        after = (count - first_count) / (total - first) if first is not None and total > first else None
        decoded = dict(loader.stats().get("decoded_by", {}))
        if out:  # the loader's counts are since its start: this pass's alone
            decoded = {k: v - sum(p.decoded_by.get(k, 0) for p in out) for k, v in decoded.items()}  # type: ignore[union-attr]
        stats = json.loads(json.dumps(loader.stats(), default=str))
        if watching is not None:  # (per batch: its "steps")
            stats["waits"] = json.loads(json.dumps(watching.stop(max(1, -(-count // batch)), total), default=str))
        out.append(Pass(construct, first or 0.0, total, count, decoded, after, stats))
    loader.close()
    return out


def fresh_process(spec: dict, let_go) -> Pass | None:
    """One pass (`one_pass`'s `spec`) in a new interpreter, after `let_go` (what this process's rows left
    running); its `Pass`, with the seconds its imports took before the timer in `stats["imports_s"]`;
    None, said on stderr, where it failed or ran past 600 s (the other rows go on)."""
    let_go()
    try:
        done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                              timeout=600, env=_with_nvimgcodec_libs(os.environ))
        if done.returncode == 0:
            return Pass(**json.loads(done.stdout.strip().splitlines()[-1]))
        why = done.stderr[-3000:]
    except (subprocess.TimeoutExpired, ValueError, IndexError, TypeError) as e:
        why = repr(e)
    print(f"folder_bench: a fresh process's {spec['kind']} pass failed: {why}", file=sys.stderr)
    return None


def _with_nvimgcodec_libs(env) -> dict:
    """`env` with nvImageCodec's wheel's library folder on LD_LIBRARY_PATH, where that wheel is installed:
    DALI dlopens libnvimgcodec by name, which a fresh process finds only there (in this process gpufeed
    had loaded it first; a fresh DALI row failed without it, 2026-12-07)."""
    from gpufeed.decode.codecs.nvimgcodec_api import library_folder

    env = dict(env)
    try:
        found = library_folder()  # (where gpufeed loads it from)
    except ImportError:
        return env
    if any(found.glob("libnvimgcodec.so*")):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(found), env.get("LD_LIBRARY_PATH", "")] if p)
    return env


def one_pass(spec: dict) -> None:
    """A fresh process's one pass (`fresh_process`): the CUDA context and the reader's imports made, then
    gpufeed's pass (`gpufeed_passes`) or DALI's (`dali_pass`), timed as in the other rows; its `Pass` as
    the last line of stdout."""
    os.environ["XDG_CACHE_HOME"] = spec["cache"]  # the folder's cached index, as the other rows read it
    if spec["device"].startswith("cuda"):
        torch.zeros(1, device=spec["device"])
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if spec["kind"] == "dali":
        import nvidia.dali.plugin.pytorch  # noqa: F401  (as dali_pass imports it)
    else:
        import gpufeed.augment  # noqa: F401  (gpufeed and its augment, as gpufeed_passes imports them)
        import gpufeed.loader  # noqa: F401  (what `gpufeed.Loader` imports on first use: 0.2-0.3 s of modules)
    imports = time.perf_counter() - t0
    path = Path(spec["path"])
    if spec["kind"] == "dali":
        done = dali_pass(path, spec["batch"], spec["threads"], spec["size"])
    else:
        done = gpufeed_passes(path, spec["device"], spec["batch"], spec["size"])[0]
    done.stats = (done.stats or {}) | {"imports_s": imports}
    print(json.dumps(vars(done), default=str))


def model_step(name: str, device: str):
    """A torchvision model's inference on a batch (`name`, random weights; float16 and channels_last
    on a GPU), as a function of the batch."""
    import torchvision

    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    net = getattr(torchvision.models, name)().eval().to(device, dtype, memory_format=torch.channels_last)

    @torch.inference_mode()
    def step(images: torch.Tensor) -> None:
        net(images.to(dtype=dtype, memory_format=torch.channels_last))

    return step


def bound_pass(step, n: int, batch: int, size: int, device: str) -> Pass:
    """The model's bound: `step` on one batch already on the device, as many times as a pass has
    batches (after one untimed call)."""
    from gpufeed.bench.common import sync

    images = torch.randn(batch, 3, size, size, device=device)
    step(images)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(-(-n // batch)):
        step(images)
    sync(device)
    return Pass(0.0, 0.0, time.perf_counter() - t0, n)


def dali_pass(path: Path, batch: int, threads: int, size: int, step=None, let_go=None) -> Pass:
    """The same evaluation pass through DALI: mixed decoder, resize shorter, crop + normalize; timed
    from the pipeline's definition, its build included (`step`: as for `gpufeed_passes`; `let_go`:
    called first, to let go of what gpufeed's rows left running)."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(path), random_shuffle=False, name="reader")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=round(size * 8 / 7))
        images = fn.crop_mirror_normalize(
            images,
            crop=(size, size),
            dtype=types.FLOAT16,
            output_layout="CHW",
            mean=[m * 255 for m in feeds.MEAN],
            std=[s * 255 for s in feeds.STD],
        )
        return images, labels

    if let_go is not None:
        let_go()
    t0 = time.perf_counter()
    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="reader", last_batch_policy=LastBatchPolicy.PARTIAL)
    construct = time.perf_counter() - t0
    first, count = None, 0
    for out in it:
        if step is not None:
            step(out[0]["images"])
        if first is None:
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
        count += len(out[0]["images"])
    torch.cuda.synchronize()
    return Pass(construct, first or 0.0, time.perf_counter() - t0, count)


def mix(images: Path, fraction: float) -> int:
    """Make every (1/fraction)-th image of the folder a PNG, a progressive JPEG or an EXIF-rotated
    photo, in turn; how many."""
    from PIL import Image

    if fraction <= 0:
        return 0
    step = max(1, round(1 / fraction))
    files = sorted(images.rglob("*.jpg"))[::step]
    for k, path in enumerate(files):
        img = Image.open(path)
        img.load()
        if k % 3 == 0:
            img.save(path.with_suffix(".png"))
            path.unlink()
        elif k % 3 == 1:
            img.save(path, quality=90, progressive=True)
        else:
            exif = Image.Exif()
            exif[0x0112] = 6
            img.save(path, quality=90, exif=exif)
    return len(files)


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=2000, help="images (4 classes)")
    p.add_argument("--data", choices=feeds.DATA, default="photos",
                   help="photos: photo-like JPEGs of ImageNet's spread of sizes and qualities (photos.py); "
                   "smooth: generated ones, one size")
    p.add_argument("--image", default="500x375", help="--data smooth: the images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--size", type=int, default=224, help="CenterCrop's side (Resize to size*8/7 first)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default=None, help="work folder, kept, its images and store reused (default: a temporary one)")
    p.add_argument("--mixed", type=float, default=0.02, help="fraction made PNG, progressive or EXIF-rotated")
    p.add_argument("--model", default="", help="a torchvision model (e.g. resnet50): rows of a process's first "
                   "Loader's pass (and DALI's) with its inference on each batch, and the model alone on one batch")
    p.add_argument("--tuning", default="", help="KEY=VALUE,... of gpufeed's Tuning: rows of a process's first Loader "
                   "with them (the folder and the store, one pass each), interleaved with the default's")
    p.add_argument("--pyspy", nargs="?", const="gil", choices=tuple(waits.PYSPY_RATES), default=None,
                   help="watch the steady passes (the folder's second, the store's third) with py-spy on PATH "
                        "(gil: the GIL holders; native: where the main thread waits) and the threads' "
                        "counters, in each pass's stats' waits: passes of 3 s or more (--n 50000)")
    p.add_argument("--fresh", action="store_true", help="also rows of a fresh process's one pass (the store, the "
                   "folder, DALI): each a new interpreter, its imports and CUDA context made before the timer")
    p.add_argument("--cold-index", action=argparse.BooleanOptionalAction, default=True,
                   help="build the folder's index from the images first and time it (--no-cold-index: a kept "
                   "--root's cached index is used as it is, for runs that compare trees)")
    a = common.parse(p, argv, SMOKE)
    import gpufeed
    from gpufeed.decode.pool.shared import stop_idle
    from gpufeed.decode.scheduling.choice import let_go_kept
    from gpufeed.decode.scheduling.steering import forget
    from gpufeed.loader import folder
    from gpufeed.synth import make_image_folder

    if a.device.startswith("cuda"):
        # the CUDA context made before any reader, as a program that trains or runs a model has it: the
        # first row of a process paid for it alone, and that was gpufeed's folder row
        torch.zeros(1, device=a.device)
        torch.cuda.synchronize()
    with common.workdir(a.root, "gpufeed-folder-bench-") as root:
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # the index and re-encoded images: not in ~/.cache
        width, height = (int(x) for x in a.image.split("x"))
        kind = a.image if a.data == "smooth" else a.data
        made = root / f"made-{a.n}-{kind}-{a.mixed}.json"  # a kept --root's folder and store, reused
        if made.exists():
            images, mixed = root / "images", json.loads(made.read_text())["mixed"]
        else:
            shutil.rmtree(root / "images", ignore_errors=True)  # another --data's or --n's
            if a.data == "photos":
                images = photos.make_folder(root / "images", a.n, classes=4)
            else:
                images = make_image_folder(root / "images", per_class=max(1, a.n // 4), classes=4, width=width, height=height)
            mixed = mix(images, a.mixed)
            gpufeed.pack(images, root / "store", mode="jpeg", reencode=False, progress=False, overwrite=True)
            made.write_text(json.dumps({"mixed": mixed}))
        cold = None
        if a.cold_index:
            shutil.rmtree(root / "cache", ignore_errors=True)  # the index is built cold
            t0 = time.perf_counter()
            folder.FolderStore(images).close()
            cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        folder.FolderStore(images).close()
        warm = time.perf_counter() - t0
        steady: list[Pass] = []
        again: list[Pass] = []
        next_loader: dict[str, list[Pass]] = {"store": [], "folder": []}

        def fresh() -> None:
            """No decode worker running, no engines' decoder kept, no decoder rates learned: as in a
            process's first Loader."""
            stop_idle()
            let_go_kept()
            forget()

        def packed() -> Pass:
            """The store's first pass, the process's first Loader (no decode worker running); its third,
            with the same Loader, is its steady state; then a next Loader's (the workers kept running)."""
            fresh()
            first, _, third = gpufeed_passes(root / "store", a.device, a.batch, a.size, passes=3, watch=a.pyspy)
            steady.append(third)
            next_loader["store"] += gpufeed_passes(root / "store", a.device, a.batch, a.size)
            return first

        def in_place() -> Pass:
            """The folder's first pass (as the store's); its second, with the same Loader, is its steady
            state; then a next Loader's."""
            fresh()
            first, second = gpufeed_passes(images, a.device, a.batch, a.size, passes=2, watch=a.pyspy)
            again.append(second)
            next_loader["folder"] += gpufeed_passes(images, a.device, a.batch, a.size)
            return first

        rows = {"gpufeed, folder in place": in_place, "gpufeed, packed store": packed}
        dali_threads = max(1, torch.get_num_threads())
        if a.device.startswith("cuda") and feeds.has_dali():
            # right after the store's row, as every DALI row ran before 2026-12-07: the engines' decoder
            # that row's next Loader kept is alive (one made beside a live one is ready in 0.1 s)
            rows["DALI readers.file, beside gpufeed's idle engines' decoder"] = lambda: dali_pass(
                images, a.batch, dali_threads, a.size)

        def first_loader(path: Path, **kw):
            """A row: a process's first Loader's one pass over `path` (`gpufeed_passes`'s `kw`)."""
            def run() -> Pass:
                fresh()
                return gpufeed_passes(path, a.device, a.batch, a.size, **kw)[0]
            return run

        if a.model:  # the first Loader's pass again with a model's inference on each batch, and the model alone
            step = model_step(a.model, a.device)
            rows[f"gpufeed, folder in place, with {a.model}"] = first_loader(images, step=step)
            rows[f"gpufeed, packed store, with {a.model}"] = first_loader(root / "store", step=step)
            if a.device.startswith("cuda") and feeds.has_dali():
                rows[f"DALI readers.file, with {a.model}"] = lambda: dali_pass(
                    images, a.batch, dali_threads, a.size, step, let_go=fresh)
            rows[f"{a.model} alone on one batch (the model's bound)"] = lambda: bound_pass(
                step, a.n, a.batch, a.size, a.device)
        if a.tuning:  # the process's first Loader's pass again with other settings, interleaved with the default's
            other = feeds.tuning(feeds.settings(":" + a.tuning))
            rows[f"gpufeed, folder in place, {a.tuning}"] = first_loader(images, tuning=other)
            rows[f"gpufeed, packed store, {a.tuning}"] = first_loader(root / "store", tuning=other)
        if a.device.startswith("cuda") and feeds.has_dali():
            rows["DALI readers.file"] = lambda: dali_pass(images, a.batch, dali_threads, a.size, let_go=fresh)
        if a.fresh:  # each pass in a new interpreter: nothing of this process's (its library loads, its workers)
            kinds = {"gpufeed, packed store": ("gpufeed", root / "store"), "gpufeed, folder in place": ("gpufeed", images)}
            if a.device.startswith("cuda") and feeds.has_dali():
                kinds["DALI readers.file"] = ("dali", images)
            for name, (kind, path) in kinds.items():
                spec = {"kind": kind, "path": str(path), "device": a.device, "batch": a.batch, "size": a.size,
                        "threads": dali_threads, "cache": str(root / "cache")}
                rows[f"{name}, a fresh process"] = lambda spec=spec: fresh_process(spec, fresh)
        results: dict[str, list[Pass]] = {name: [] for name in rows}
        for _ in range(a.rounds):
            for name, run in rows.items():
                done = run()
                if done is not None:  # (a fresh process's that failed: said, and left out)
                    results[name].append(done)
        results = {name: runs for name, runs in results.items() if runs}
        stop_idle()
        results["gpufeed, folder in place, steady state (second pass)"] = again
        results["gpufeed, packed store, steady state (third pass)"] = steady
        results["gpufeed, folder in place, a next Loader (workers running)"] = next_loader["folder"]
        results["gpufeed, packed store, a next Loader (workers running)"] = next_loader["store"]
    print(
        f"{a.n} images {kind} ({mixed} PNG, progressive or rotated), device {a.device}: index built (and "
        f"those re-encoded) in {'-' if cold is None else f'{cold:.2f}'} s, opened with the cached index in {warm:.3f} s"
    )
    lines = [
        [
            name,
            common.cell([r.rate for r in runs]),
            f"{statistics.median(r.construct for r in runs):.3f}",
            *split(runs),
            f"{statistics.median(r.first for r in runs):.3f}",
            f"{statistics.median(r.total for r in runs):.2f}",
            after_first(runs),
            ", ".join(f"{r.rate:,.0f}" for r in runs),
        ]
        for name, runs in results.items()
    ]
    header = ["reader", "img/s", "construct s", "Triton ready s", "workers ready s", "GPU decoders s", "first batch s",
              "pass s", "img/s after the first batch", "rounds"]
    markdown = common.table(header, lines)
    for name in ("gpufeed, folder in place", "gpufeed, packed store"):  # where the workers' start went
        steps = [(r.stats or {}).get("workers_start_s") for r in results.get(name, [])]
        if any(steps):
            markdown += f"\n\n{name}: a decode worker's start, seconds (median over the workers, by round): " + "; ".join(
                ", ".join(f"{k} {v:.3f}" for k, v in step.items()) for step in steps if step)
    imports = {name: [(r.stats or {}).get("imports_s") for r in runs] for name, runs in results.items()
               if name.endswith("a fresh process")}
    if imports:
        markdown += "\n\nFresh processes, their reader's imports before the timer, s: " + "; ".join(
            f"{name.removesuffix(', a fresh process')} {common.cell([v for v in values if v is not None], '{:.2f}')}"
            for name, values in imports.items())
    for name in ("gpufeed, folder in place, steady state (second pass)", "gpufeed, packed store, steady state (third pass)"):
        for r in results.get(name, []):  # (--pyspy: who held the GIL while the pass ran)
            gil = ((r.stats or {}).get("waits") or {}).get("gil")
            if gil:
                top = "; ".join(f"{stack.split(';')[-1]} {n}" for stack, n in gil["other_top"][:6])
                markdown += (f"\n\n{name}: GIL held by the loop's thread {gil['train_thread_share']:.0%}, by the "
                             f"others {gil['other_threads_share']:.0%} (top: {top})")
    raw = {name: [vars(r) for r in runs] for name, runs in results.items()}
    return common.write(a, __file__, raw, markdown, a.device, index_build_s=cold, index_cached_open_s=warm)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one_pass(json.loads(sys.argv[2]))
    else:
        main()
