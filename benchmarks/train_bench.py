"""Training throughput fed by each loader, against a synthetic-data ceiling, in one call.

A torchvision ResNet (random init, bf16 autocast, channels_last, SGD with momentum, batch 256) is
trained for `--steps` steps after `--warmup` steps, fed by each row; every row runs in a process of
its own, and the rows are interleaved over `--rounds` rounds, so host drift hits every row alike.
Rows: `synthetic` (one batch already on the GPU: the ceiling), `raw` (a raw store), `jpeg` (a jpeg
store, the Loader's defaults; `jpeg:KEY=VALUE,...` passes Loader arguments, and `policy=randaugment`
(or trivialaugment, autoaugment) adds that policy to the recipe, `switch=SECONDS` sets the process's
`sys.setswitchinterval`; rows are separated by `;`), `dataloader` (torch
DataLoader over the image folder, PIL, uint8 to the GPU, normalized there), `dali` (when nvidia-dali
is installed: a benchmark-only import), `shadow` (the synthetic loop, with a jpeg row's Loader, the
same settings, taking `rate=` batches a second (46) on a thread beside it and dropping them: what
the loader's presence costs when the model never waits for its batches).

    PYTHONPATH=src python benchmarks/train_bench.py --n 10000 --models resnet18,resnet50 --rounds 3 \
        --out train.json

Per row: img/s, % of the same round's ceiling, seconds from the loader's construction returning to
its first batch, GPU memory in use (the whole device, so other processes' contexts count), CPU
cores used, and the training thread's time per step spent waiting for data and launching the step.
The JSON (`--out`) also has each step's wait, per thread of the row's process its time per step on a CPU and
runnable but waiting for one (Linux schedstat), and the garbage collector's collections during the timed steps.
`--pyspy` (py-spy on PATH) samples which threads hold the GIL during the timed steps; `--pyspy native`
instead samples where the training thread is, running or not, native frames included (is it waiting
for the GIL, for a lock of the CUDA driver, or running?), pausing the process per sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the sibling benchmarks (interference, jpeg_bench) and this tree's gpufeed, run from anywhere without PYTHONPATH
sys.path[:0] = [p for p in (str(HERE), str(HERE.parent / "src")) if p not in sys.path]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _ops(policy: str | None = None):
    """The training recipe: crop, flip, normalize; `policy` ("randaugment", "trivialaugment",
    "autoaugment") adds that policy after the flip, as torchvision's and timm's recipes do."""
    from gpufeed import augment as A

    policies = {None: [], "randaugment": [A.RandAugment(2, 9)], "trivialaugment": [A.TrivialAugmentWide()],
                "autoaugment": [A.AutoAugment("imagenet")]}
    return [A.RandomResizedCrop(224), A.RandomHorizontalFlip(), *policies[policy], A.Normalize(MEAN, STD)]


# row settings that are no Loader argument but a field of the JPEG path's `Tuning` (its defaults are
# what these rows measured): `jpeg:pipelines=2,gpu_min=0.3` builds Tuning(pipelines=2, gpu_min=0.3)
# row settings of the training loop itself, set by `feeder`: `side=1` trains on a stream of its own
# instead of the default stream (what a loader's work synchronized with the default stream costs);
# `gc=freeze` moves every object made so far out of the garbage collector's reach before the timed
# steps (`gc.freeze()`: full collections then traverse only what was made since);
# `sched=spin|yield|blocking` (any row) sets how the process's CUDA syncs wait (`_context_scheduling`)
LOOP: dict = {}


def _settings(row: str) -> dict[str, str]:
    """A row's KEY=VALUE settings (`name:KEY=VALUE,...`), as text."""
    return dict(kv.split("=", 1) for kv in row.partition(":")[2].split(",") if "=" in kv)


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.startswith("(") or text.startswith("["):
        return tuple(x for x in text.strip("()[]").split("+") if x)
    return {"None": None, "True": True, "False": False}.get(text, text)


def feeder(row: str, work: Path, batch: int):
    """(the time the feeder took to build, an endless iterator of (images, labels) on the GPU, stats fn)."""
    import torch

    name, _, spec = row.partition(":")
    kwargs = {k: _value(v) for k, v in _settings(row).items()}
    LOOP["gc"] = kwargs.pop("gc", None)
    t0 = time.perf_counter()
    if name == "synthetic":
        images = torch.randn(batch, 3, 224, 224, device="cuda").half()
        labels = torch.randint(0, 1000, (batch,), device="cuda")

        def it():
            while True:
                yield images, labels
        return time.perf_counter() - t0, it(), None
    if name == "interfere":  # synthetic data + one piece of a loader's work on a paced thread
        import interference

        interference.start(spec.split(",")[0], rate=float(kwargs.get("rate", 50)))
        built, batches, _ = feeder("synthetic", work, batch)
        return built, batches, lambda: dict(interference.COUNTS)
    if name == "shadow":  # synthetic data; a jpeg Loader beside it, paced, its batches dropped
        rate = float(kwargs.pop("rate", 46))
        settings = ",".join(f"{k}={v}" for k, v in _settings(row).items() if k != "rate")
        built, made, stats = feeder(f"jpeg:{settings}", work, batch)
        threading.Thread(target=_shadow, args=(made, rate), daemon=True).start()
        return built, feeder("synthetic", work, batch)[1], stats
    if name in ("raw", "jpeg"):
        import gpufeed
        from gpufeed.decode.tuning import Tuning

        tuned = {key: kwargs.pop(key) for key in list(kwargs) if key in Tuning.names()}
        if tuned:
            defaults = Tuning()
            kwargs["tuning"] = Tuning(**{k: type(getattr(defaults, k))(v) for k, v in tuned.items()})
        if "malloc" in kwargs:  # glibc keeps freed memory instead of unmapping it (`_keep_freed_memory`)
            _keep_freed_memory(int(kwargs.pop("malloc")))
        if "switch" in kwargs:  # the process's GIL switch interval, seconds (Python's default 0.005)
            sys.setswitchinterval(float(kwargs.pop("switch")))
        LOOP["side"] = bool(kwargs.pop("side", 0))
        kwargs.pop("sched", None)  # set when the row's process began (`_context_scheduling`)
        ops = _ops(kwargs.pop("policy", None))
        loader = gpufeed.Loader(work / name, batch_size=batch, device="cuda", augment=ops, **kwargs)
        built = time.perf_counter() - t0

        def it():
            while True:
                yield from loader
        return built, it(), loader.stats
    if name == "dataloader":
        from torchvision import datasets, transforms

        tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                 transforms.PILToTensor()])
        dl = torch.utils.data.DataLoader(datasets.ImageFolder(work / "images", tf), batch_size=batch, shuffle=True,
                                         drop_last=True, num_workers=kwargs.get("workers", os.cpu_count()),
                                         pin_memory=True, persistent_workers=True, prefetch_factor=4)
        mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1) * 255
        std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255
        built = time.perf_counter() - t0

        def it():
            while True:
                for x, y in dl:
                    yield ((x.cuda(non_blocking=True).float() - mean) / std).half(), y.cuda(non_blocking=True)
        return built, it(), None
    if name == "dali":
        return _dali(work, batch, kwargs.get("threads", 8), t0)
    raise SystemExit(f"unknown row {row!r}")


def _keep_freed_memory(megabytes: int) -> None:
    """Row setting `malloc=MB`: glibc serves allocations under `megabytes` from its heaps and does not
    give freed memory back to the kernel, so that no thread's free unmaps memory (each unmap
    interrupts every CPU that runs a thread of this process) (mallopt M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)."""
    import ctypes

    libc = ctypes.CDLL(None)
    size = megabytes << 20
    if not (libc.mallopt(-3, min(size, 32 << 20)) and libc.mallopt(-1, size)):
        raise SystemExit(f"malloc={megabytes}: mallopt refused")


def _shadow(batches, rate: float) -> None:
    """Take `rate` batches a second from `batches` on a stream of this thread's own and drop them:
    the loader's work beside the model, with the model never waiting for it."""
    import torch

    from interference import paced

    with torch.cuda.stream(torch.cuda.Stream()):
        for _tick, _batch in zip(paced(rate), batches):
            pass


def _dali(work: Path, batch: int, threads: int, t0: float):
    from jpeg_bench import dali_loader

    loader = dali_loader(work / "images", batch, threads, [m * 255 for m in MEAN], [s * 255 for s in STD])
    built = time.perf_counter() - t0

    def it():
        while True:
            for out in loader:
                yield out[0]["images"], out[0]["labels"].view(-1).long()
    return built, it(), None


def _context_scheduling(row: str) -> None:
    """A row's `sched=spin|yield|blocking`: how the CUDA context's host waits (syncs) wait, for every
    thread of the process, set through the driver before torch makes the context. CUDA's default
    (auto) spins while the process has more cores than contexts."""
    settings = _settings(row)
    if "sched" not in settings:
        return
    import ctypes

    flags = {"spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*
    if settings["sched"] not in flags:
        raise SystemExit(f"{row}: sched={settings['sched']} is none of {', '.join(flags)}")
    flag = flags[settings["sched"]]
    try:
        cuda, dev = ctypes.CDLL("libcuda.so.1"), ctypes.c_int()
    except OSError as e:
        raise SystemExit(f"{row}: no CUDA driver to set the context's scheduling with ({e})") from e
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    for call in (lambda: cuda.cuInit(0), lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0), lambda: set_flags(dev, flag)):
        if call() != 0:
            raise SystemExit(f"{row}: could not set the CUDA context's scheduling to {settings['sched']}")


def run_row(a) -> dict:
    """One row in this process: build the feeder, time its first batch, train, measure."""
    _context_scheduling(a.row)  # before torch makes the context
    import torch

    from gpufeed.bench.training import training_step

    torch.backends.cudnn.benchmark = True
    work = Path(a.workdir)
    step = training_step(a.model, "cuda", 1000)
    torch.cuda.synchronize()
    built, batches, stats = feeder(a.row, work, a.batch)
    with torch.cuda.stream(torch.cuda.Stream() if LOOP.get("side") else torch.cuda.current_stream()):
        return _train(a, step, built, batches, stats)


def _train(a, step, built: float, batches, stats) -> dict:
    """Time the first batch, warm up, time `a.steps` steps, on the current stream."""
    import torch

    from gpufeed.bench.common import cpu_seconds

    t0 = time.perf_counter()
    images, labels = next(batches)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0

    step(images, labels)
    for _ in range(a.warmup):
        step(*next(batches))
    torch.cuda.synchronize()
    if LOOP.get("gc") == "freeze":
        gc.freeze()
    spy = _pyspy(a) if a.pyspy else None
    collections = GcWatch()
    before = stats() if stats is not None else None
    sched0, os0 = _schedstat(), _os_counters()
    wait = launch = 0.0
    waits = []
    c0, w0 = cpu_seconds(), time.perf_counter()
    for k in range(a.steps):
        s0 = time.perf_counter()
        images, labels = next(batches)
        s1 = time.perf_counter()
        loss = step(images, labels)
        s2 = time.perf_counter()
        wait, launch = wait + s1 - s0, launch + s2 - s1
        waits.append(s1 - s0)
    loss.item()
    torch.cuda.synchronize()
    wall = time.perf_counter() - w0
    collections.stop()
    cores = (cpu_seconds() - c0) / wall
    free, total = torch.cuda.mem_get_info()
    out = {"row": a.row, "model": a.model, "img_per_s": a.steps * a.batch / wall, "build_s": built,
           "first_batch_s": first, "gpu_used_gb": (total - free) / 1e9, "cpu_cores": cores,
           "wait_ms_per_step": 1e3 * wait / a.steps, "launch_ms_per_step": 1e3 * launch / a.steps,
           "device": torch.cuda.get_device_name(), "wait_ms_per_step_each": [round(1e3 * w, 2) for w in waits]}
    out["threads"] = _per_step(sched0, _schedstat(), a.steps)
    out["os"] = {k: round((v - os0[k]) / a.steps, 2) for k, v in _os_counters().items()}
    out["gc"] = collections.summary()
    if spy is not None and a.pyspy == "native":
        out["native"] = _where_training_waits(spy)
    elif spy is not None:
        out["gil"] = _gil_shares(spy, wall, a.steps)
    if stats is not None:  # the loader's counters over the timed steps (decoders, per-stage seconds, ...)
        after = {k: v for k, v in stats().items() if k != "bytes"}
        out["loader"] = _delta(after, before) | {"decoder_rates": after.get("decoder_rates")}  # rates: averages
    return out


class GcWatch:
    """The garbage collector's collections while it watches: per generation, how many, their total and
    longest milliseconds (a collection holds the GIL: every thread of the process waits), and which
    threads' allocations set them off."""

    def __init__(self):
        self._began: float | None = None
        self.seen: list[tuple[int, float, str]] = []
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seen.append((info["generation"], time.perf_counter() - self._began, threading.current_thread().name))
            self._began = None

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        out = {}
        for gen in sorted({g for g, _, _ in self.seen}):
            times = [t for g, t, _ in self.seen if g == gen]
            out[f"gen{gen}"] = {"count": len(times), "ms": round(1e3 * sum(times), 2), "max_ms": round(1e3 * max(times), 2),
                                "threads": dict(Counter(name for g, _, name in self.seen if g == gen))}
        return out


def _delta(after, before):
    """`after` with every number that `before` also holds at the same place made the difference."""
    if isinstance(after, dict):
        return {k: _delta(v, before.get(k) if isinstance(before, dict) else None) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def _schedstat() -> dict[int, tuple[str, int, int, int]]:
    """This process's threads: {tid: (name, ns run on a CPU, ns runnable but waiting for one, times it
    blocked)} from Linux's /proc schedstat and status; Python threads by their `threading` names
    (empty elsewhere). Blocks are voluntary context switches: waits for the GIL, a lock, a CUDA call
    or work."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            run, delay, _ = (task / "schedstat").read_text().split()
            comm = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue
        blocked = next((int(line.split(":")[1]) for line in status.splitlines()
                        if line.startswith("voluntary_ctxt_switches")), 0)
        out[int(task.name)] = (names.get(int(task.name), comm), int(run), int(delay), blocked)
    return out


def _os_counters() -> dict[str, int]:
    """What a process's threads cost each other through the kernel rather than a lock of ours: this
    process's page faults, the training thread's context switches (voluntary: it blocked, on the GIL,
    a lock or a sync; not: it was preempted), and the host's TLB shootdowns (a thread that unmaps
    memory interrupts every CPU running a thread of its process) and function-call interrupts, and the
    time the hypervisor gave the host's CPUs to others (a busy neighbour slows every row alike)."""
    import resource

    from gpufeed.doctor.stages import host_steal

    use = resource.getrusage(resource.RUSAGE_SELF)
    out = {"minor_faults": use.ru_minflt, "major_faults": use.ru_majflt}
    try:
        status = Path(f"/proc/self/task/{threading.main_thread().native_id}/status").read_text()
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                key, value = line.split(":")
                out["train_" + key.replace("_ctxt_switches", "_switches")] = int(value)
        out["host_steal_ms"] = host_steal()[0] * 1000 // os.sysconf("SC_CLK_TCK")
        for line in Path("/proc/interrupts").read_text().splitlines():
            name, _, rest = line.strip().partition(":")
            if name in ("TLB", "CAL"):
                out[f"host_{name.lower()}_interrupts"] = sum(int(x) for x in rest.split() if x.isdigit())
    except OSError:
        pass
    return out


def _per_step(before: dict, after: dict, steps: int) -> dict:
    """Per thread name (numbered threads together): ms per step run on a CPU and waiting for one.
    A training thread that waits for a CPU is crowded out by the loader's threads or processes."""
    out: dict[str, list[float]] = {}
    for tid, (name, run, delay, blocked) in after.items():
        run0, delay0, blocked0 = before.get(tid, (name, 0, 0, 0))[1:]
        key = name.rstrip("0123456789_")
        got = out.setdefault(key, [0.0, 0.0, 0.0])
        got[0] += (run - run0) / 1e6 / steps
        got[1] += (delay - delay0) / 1e6 / steps
        got[2] += (blocked - blocked0) / steps
    return {k: {"run_ms": round(v[0], 2), "runqueue_ms": round(v[1], 2), "blocks": round(v[2], 1)}
            for k, v in out.items() if v[0] >= 0.05}


def spy_on_gil(seconds: int, rate: int, native: bool = False, gil_native: bool = False):
    """py-spy (on PATH) sampling this process's GIL holders at `rate` Hz for `seconds` from about
    now (its attaching, about a second, is waited for here): (process, output file), or None.
    `native`: every thread, idle or not, with native frames, instead of the GIL holders;
    `gil_native`: the GIL holders with their native frames (each sample pauses the process)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    path = tempfile.mktemp(suffix=".txt")
    how = ["--native", "--idle"] if native else ["--gil", "--native"] if gil_native else ["--gil", "--nonblocking"]
    proc = subprocess.Popen([exe, "record", *how, "--threads", "-r", str(rate), "-d", str(seconds), "-f", "raw",
                             "-o", path, "-p", str(os.getpid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    return proc, path


def gil_stacks(spy, timeout: float) -> dict[str, int] | str:
    """{stack (frames joined by ';'): samples} once `spy_on_gil`'s py-spy ended, or its error text."""
    proc, path = spy
    proc.wait(timeout=timeout)
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return proc.stderr.read().decode()[-500:]
    stacks: dict[str, int] = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        stacks[stack] = stacks.get(stack, 0) + int(count)
    return stacks


def holder(stack: str) -> str:
    """A GIL holder as its frame and its two callers."""
    return ";".join(stack.split(";")[-3:])


def holders(stacks: dict[str, int], mine: str) -> tuple[int, dict[str, int]]:
    """(samples of the stacks with frame `mine`, samples of every other stack by `holder`)."""
    own, top = 0, {}
    for stack, n in stacks.items():
        if mine in stack:
            own += n
        else:
            top[holder(stack)] = top.get(holder(stack), 0) + n
    return own, top


GIL_RATE = 500  # py-spy's samples per second of the GIL holders (`--pyspy`)


def _pyspy(a):
    """py-spy sampling this process's GIL holders (or, `--pyspy native`, the training thread's stacks)
    for the timed steps (its own process)."""
    seconds = max(2, int(a.steps * a.batch / 8000))
    rate = a.pyspy_rate or {"native": 100, "gilnative": 50}.get(a.pyspy, GIL_RATE)
    spy = spy_on_gil(seconds, rate, native=a.pyspy == "native", gil_native=a.pyspy == "gilnative")
    if spy is None:
        print("py-spy not found: no GIL samples", file=sys.stderr)
        return None
    return spy, seconds, rate


def _gil_shares(spy, wall: float, steps: int) -> dict:
    """Share of samples with the GIL held by the training thread and by any other thread."""
    spy, seconds, rate = spy
    stacks = gil_stacks(spy, seconds + 30)
    if isinstance(stacks, str):
        return {"error": stacks}
    train, top = holders(stacks, "run_row")
    other = sum(top.values())
    samples = seconds * rate
    return {"train_thread_share": train / samples, "other_threads_share": other / samples,
            "other_ms_per_step": 1e3 * other / rate / (seconds * steps / wall),
            "other_top": sorted(top.items(), key=lambda kv: -kv[1])[:20],
            "other_stacks": {stack: n for stack, n in stacks.items() if "run_row" not in stack}}


def _where_training_waits(spy) -> dict:
    """`--pyspy native`: the training thread's samples by their innermost frames (addresses left out),
    and how many are inside the CUDA driver or waiting on a condition variable (as for the GIL); the
    other threads' innermost frames, by thread name."""
    spy, seconds, _ = spy
    stacks = gil_stacks(spy, seconds + 60)
    if isinstance(stacks, str):
        return {"error": stacks}
    tails: dict[str, int] = {}
    others: dict[str, Counter] = {}
    total = driver = cond = 0
    for stack, n in stacks.items():
        frames = stack.split(";")
        named = [f for f in frames[1:] if not f.startswith("0x")]
        if "MainThread" not in frames[0]:  # the other threads, by name (numbers left out), innermost frames
            label = re.sub(r"\(0x[0-9a-fA-F]+\)|\d+", "", frames[0]).strip()
            others.setdefault(label, Counter())[";".join(named[-3:])] += n
            continue
        total += n
        driver += n * any("libcuda" in f for f in named)
        cond += n * any("pthread_cond" in f for f in named[-3:])
        tail = ";".join(named[-4:])
        tails[tail] = tails.get(tail, 0) + n
    return {"samples": total, "in_cuda_driver": driver, "cond_wait": cond,
            "top": sorted(tails.items(), key=lambda kv: -kv[1])[:30],
            "others": {label: {"samples": sum(c.values()), "top": c.most_common(12)} for label, c in others.items()}}


def prepare(work: Path, n: int) -> None:
    import gpufeed
    from gpufeed.synth import make_image_folder

    if not (work / "images").exists():
        make_image_folder(work / "images", per_class=n // 10, classes=10)
    if not (work / "raw").exists():
        gpufeed.pack(work / "images", work / "raw", size=256, progress=False)
    if not (work / "jpeg").exists():
        gpufeed.pack(work / "images", work / "jpeg", mode="jpeg", reencode=False, progress=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10000, help="generated images (500x375 q90)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpufeed-train-bench"))
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--rows", default="synthetic;raw;jpeg;dataloader;dali", help="rows, separated by ;")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pyspy", nargs="?", const="gil", choices=("gil", "native", "gilnative"),
                   help="sample GIL holders with py-spy (on PATH); `native`: every thread's native stacks; "
                        "`gilnative`: the GIL holders' native frames too")
    p.add_argument("--pyspy-rate", type=int, default=0,
                   help="py-spy's samples per second (default 500, native 100; each native sample pauses the process)")
    p.add_argument("--out", default=None, help="write every run and the table as JSON here")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.row:
        print("RESULT " + json.dumps(run_row(a)), flush=True)
        return
    work = Path(a.workdir)
    prepare(work, a.n)
    rows = a.rows.split(";")
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        rows = [r for r in rows if not r.startswith("dali")]
        print("nvidia-dali not installed: no dali row", flush=True)
    runs = []
    for r in range(a.rounds):
        for model in a.models.split(","):
            order = rows if r % 2 == 0 else rows[::-1]
            for row in order:
                cmd = [sys.executable, __file__, "--row", row, "--model", model, "--workdir", str(work),
                       "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch)]
                cmd += ["--pyspy", a.pyspy, "--pyspy-rate", str(a.pyspy_rate)] if a.pyspy else []
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                result = [ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                if not result:
                    print(f"round {r} {model} {row}: FAILED\n{done.stderr[-3000:]}", flush=True)
                    continue
                res = json.loads(result[0]) | {"round": r}
                runs.append(res)
                print(json.dumps(res), flush=True)
    table = summarize(runs)
    print(table)
    if a.out:
        Path(a.out).write_text(json.dumps({"runs": runs, "table": table}, indent=1))


def summarize(runs: list[dict]) -> str:
    """A markdown table: per model and row, median (min-max) img/s, % of the same round's ceiling, ..."""
    ceiling = {(r["model"], r["round"]): r["img_per_s"] for r in runs if r["row"] == "synthetic"}
    out = ["| model | row | img/s | % of ceiling | first batch s | GPU GB | CPU cores | wait ms/step | launch ms/step |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    keys = list(dict.fromkeys((r["model"], r["row"]) for r in runs))

    def cell(values, fmt):
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    for model, row in keys:
        mine = [r for r in runs if (r["model"], r["row"]) == (model, row)]
        pct = [100 * r["img_per_s"] / ceiling[(model, r["round"])] for r in mine if (model, r["round"]) in ceiling]
        out.append(f"| {model} | {row} | {cell([r['img_per_s'] for r in mine], '{:,.0f}')} | "
                   f"{cell(pct, '{:.1f}') if pct else '-'} | {cell([r['first_batch_s'] for r in mine], '{:.1f}')} | "
                   f"{cell([r['gpu_used_gb'] for r in mine], '{:.1f}')} | {cell([r['cpu_cores'] for r in mine], '{:.1f}')} | "
                   f"{cell([r['wait_ms_per_step'] for r in mine], '{:.1f}')} | "
                   f"{cell([r['launch_ms_per_step'] for r in mine], '{:.1f}')} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
