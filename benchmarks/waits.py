"""What a training process's threads wait for over train_bench.py's timed steps, in one `Watch`:

- `gc`: the garbage collector's collections per generation: count, total and longest ms (a
  collection holds the GIL: every thread of the process waits), and whose allocations set them off;
- `threads`: per thread name, ms per step on a CPU and runnable but waiting for one, and blocks
  (voluntary context switches: waits for the GIL, a lock, a CUDA call or work), Linux schedstat;
- `os`: this process's page faults, the training thread's context switches, the host's TLB
  shootdowns and function-call interrupts, and the host's steal time (a busy neighbour);
- with py-spy on PATH, `gil` (`--pyspy`: the GIL holders' shares) or `native` (`--pyspy native`:
  where the training thread is, running or not, native frames included).

`Lateness` (remote_bench's epochs) says how long a thread that wants the GIL waits for it: a
thread in Python that a C call holds it for, or that holds it without pause, keeps the others waiting
one switch interval (5 ms) at a time. The fetch ahead's downloads are such a thread's work (s3fs's
event loop takes the GIL for each piece of a response): beside a thread holding the GIL without
pause they carried 25 MB/s of a 125 MB/s link, beside one holding it half the time in 2 ms turns
103 (the development machine, 1 Gbit/s and 20 ms through remote_bench's link).

Linux /proc; the counters are empty elsewhere.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

PYSPY_RATES = {"gil": 500, "native": 100, "gilnative": 50}  # samples per second; native ones pause the process


class Watch:
    """Started before the timed steps, `stop(steps, wall)` after them: the dict the module describes.
    `pyspy`: None, "gil", "native" or "gilnative" (the GIL holders with native frames); `mine`: a
    frame name on the training thread's stack (its GIL samples count as its own)."""

    def __init__(self, pyspy: str | None = None, seconds: int = 2, rate: int = 0, mine: str = "run_row"):
        self.mine = mine
        self.spy = _PySpy(pyspy, seconds, rate or PYSPY_RATES[pyspy]) if pyspy else None
        self.gc = GcWatch()
        self.sched, self.os = schedstat(), os_counters()

    def stop(self, steps: int, wall: float) -> dict:
        self.gc.stop()
        out = {"threads": per_step(self.sched, schedstat(), steps),
               "os": {k: round((v - self.os.get(k, 0)) / steps, 2) for k, v in os_counters().items()},
               "gc": self.gc.summary()}
        if self.spy is not None:
            out.update(self.spy.result(wall, steps, self.mine))
        return out


class Lateness:
    """A thread that sleeps `tick` seconds at a time and records how late each wake-up came (a wait for
    the GIL, or for a core); `stop()` gives the median and 99th percentile in ms, and the share of the
    watched time spent in wake-ups later than `late` seconds."""

    def __init__(self, tick: float = 0.002, late: float = 0.005):
        self.tick, self.late = tick, late
        self.delays: list[float] = []
        self._stop = threading.Event()
        self._began = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-gil-lateness")
        self._thread.start()

    def _run(self) -> None:
        while True:  # (one wake-up at least, however soon it is stopped)
            t = time.perf_counter()
            time.sleep(self.tick)
            self.delays.append(time.perf_counter() - t - self.tick)
            if self._stop.is_set():
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._began
        delays = sorted(self.delays)
        late = sum(d for d in delays if d > self.late)
        return {"wakeups": len(delays), "p50_ms": round(1e3 * delays[len(delays) // 2], 2),
                "p99_ms": round(1e3 * delays[min(len(delays) - 1, int(0.99 * len(delays)))], 2),
                "late_share": round(late / wall, 3)}


def host_cpu() -> tuple[int, int]:
    """(busy, all) clock ticks of every core of the host since it booted (/proc/stat's first line; idle
    and I/O wait are not busy): two readings give the share of the host's CPU busy between them, the
    benchmark's own processes and everything else. (0, 0) where /proc/stat can't be read."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


class GcWatch:
    """The garbage collector's collections while it watches: (generation, seconds, thread name)."""

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
            out[f"gen{gen}"] = {"count": len(times), "ms": round(1e3 * sum(times), 2),
                                "max_ms": round(1e3 * max(times), 2),
                                "threads": dict(Counter(name for g, _, name in self.seen if g == gen))}
        return out


def schedstat() -> dict[int, tuple[str, int, int, int]]:
    """This process's threads: {tid: (name, ns on a CPU, ns runnable but waiting for one, blocks)};
    Python threads by their `threading` names."""
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


def per_step(before: dict, after: dict, steps: int) -> dict:
    """Per thread name (numbered threads together): ms per step on a CPU and waiting for one, blocks
    per step. A training thread that waits for a CPU is crowded out by the loader's threads or processes."""
    out: dict[str, list[float]] = {}
    for tid, (name, run, delay, blocked) in after.items():
        run0, delay0, blocked0 = before.get(tid, (name, 0, 0, 0))[1:]
        got = out.setdefault(name.rstrip("0123456789_"), [0.0, 0.0, 0.0])
        got[0] += (run - run0) / 1e6 / steps
        got[1] += (delay - delay0) / 1e6 / steps
        got[2] += (blocked - blocked0) / steps
    return {k: {"run_ms": round(v[0], 2), "runqueue_ms": round(v[1], 2), "blocks": round(v[2], 1)}
            for k, v in out.items() if v[0] >= 0.05}


def os_counters() -> dict[str, int]:
    """What threads cost each other through the kernel rather than a lock (see the module's docstring)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    out = {"minor_faults": use.ru_minflt, "major_faults": use.ru_majflt}
    try:
        from gpufeed.doctor.stages import host_steal

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


class _PySpy:
    """py-spy (on PATH) recording this process for `seconds` from about now (its attaching, about a
    second, is waited for here): the GIL holders ("gil"; "gilnative" with native frames), or every
    thread, idle or not, with native frames ("native")."""

    def __init__(self, mode: str, seconds: int, rate: int):
        self.mode, self.seconds, self.rate, self.proc = mode, seconds, rate, None
        exe = shutil.which("py-spy")
        if exe is None:
            print("py-spy not found: no GIL samples", file=sys.stderr)
            return
        self.path = tempfile.mktemp(suffix=".txt")
        how = {"native": ["--native", "--idle"], "gilnative": ["--gil", "--native"]}.get(mode,
                                                                                         ["--gil", "--nonblocking"])
        self.proc = subprocess.Popen([exe, "record", *how, "--threads", "-r", str(rate), "-d", str(seconds), "-f",
                                      "raw", "-o", self.path, "-p", str(os.getpid())],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)

    def stacks(self) -> dict[str, int] | str:
        """{stack (frames joined by ';'): samples} once py-spy ended, or its error text."""
        self.proc.wait(timeout=self.seconds + 60)
        try:
            lines = Path(self.path).read_text().splitlines()
        except OSError:
            return self.proc.stderr.read().decode()[-500:]
        stacks: dict[str, int] = {}
        for line in lines:
            stack, _, count = line.rpartition(" ")
            stacks[stack] = stacks.get(stack, 0) + int(count)
        return stacks

    def result(self, wall: float, steps: int, mine: str) -> dict:
        if self.proc is None:
            return {}
        stacks = self.stacks()
        if isinstance(stacks, str):
            return {"pyspy_error": stacks}
        if self.mode == "native":
            return {"native": _where_training_waits(stacks)}
        return {"gil": _gil_shares(stacks, self.seconds, self.rate, wall, steps, mine)}


def _gil_shares(stacks: dict[str, int], seconds: int, rate: int, wall: float, steps: int, mine: str) -> dict:
    """Share of samples with the GIL held by the training thread (stacks through `mine`) and by any
    other thread; the others' top holders (a frame and its two callers)."""
    own, top = 0, Counter()
    for stack, n in stacks.items():
        if mine in stack:
            own += n
        else:
            top[";".join(stack.split(";")[-3:])] += n
    other, samples = sum(top.values()), seconds * rate
    return {"train_thread_share": own / samples, "other_threads_share": other / samples,
            "other_ms_per_step": 1e3 * other / rate / (seconds * steps / wall), "other_top": top.most_common(20),
            "other_stacks": {stack: n for stack, n in stacks.items() if mine not in stack}}


def _where_training_waits(stacks: dict[str, int]) -> dict:
    """The training thread's samples by their innermost frames (addresses left out), how many are in
    the CUDA driver or waiting on a condition variable (as for the GIL); the other threads' innermost
    frames, by thread name."""
    tails, others = Counter(), {}
    total = driver = cond = 0
    for stack, n in stacks.items():
        frames = stack.split(";")
        named = [f for f in frames[1:] if not f.startswith("0x")]
        if "MainThread" not in frames[0]:
            label = re.sub(r"\(0x[0-9a-fA-F]+\)|\d+", "", frames[0]).strip()
            others.setdefault(label, Counter())[";".join(named[-3:])] += n
            continue
        total += n
        driver += n * any("libcuda" in f for f in named)
        cond += n * any("pthread_cond" in f for f in named[-3:])
        tails[";".join(named[-4:])] += n
    return {"samples": total, "in_cuda_driver": driver, "cond_wait": cond, "top": tails.most_common(30),
            "others": {label: {"samples": sum(c.values()), "top": c.most_common(12)} for label, c in others.items()}}
