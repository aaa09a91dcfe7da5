"""What every bench experiment shares: the context it runs in, repeat timing, the result shape.

An experiment returns figures; a figure has series; a series has, for each x, the median,
min and max over repeats. `plots.py` draws any figure from that alone, so measuring and
plotting stay apart (the plot step reads results.json).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


class Skipped(Exception):
    """This experiment cannot run here (e.g. no GPU); the message says why."""


@dataclass
class Context:
    """Where and how an experiment runs."""

    device: str  # "cuda" or "cpu"
    quick: bool
    work: Path  # scratch space for generated data

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def repeats(self) -> int:
        return 2 if self.quick else 7


@dataclass
class Series:
    x: list = field(default_factory=list)
    median: list = field(default_factory=list)
    min: list = field(default_factory=list)
    max: list = field(default_factory=list)

    def add(self, x, samples: list[float]) -> None:
        self.x.append(x)
        self.median.append(statistics.median(samples))
        self.min.append(min(samples))
        self.max.append(max(samples))


@dataclass
class Figure:
    name: str  # file stem of the PNG
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, Series] = field(default_factory=dict)
    kind: str = "line"  # or "bar" (categorical x)
    logx: bool = False
    logy: bool = False
    note: str = ""

    def line(self, name: str) -> Series:
        return self.series.setdefault(name, Series())

    def as_dict(self) -> dict:
        return asdict(self)


def cpu_seconds() -> float:
    """CPU time of this process and of its children, finished ones (reaped) and live ones such as
    DataLoader or decode workers, whose time the kernel reports only in /proc while they run."""
    r = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(x.ru_utime + x.ru_stime for x in r) + sum(_proc_seconds(pid) for pid in _descendants(os.getpid()))


def _descendants(pid: int) -> list[int]:
    """Live descendant processes of `pid` (Linux /proc; none elsewhere)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _proc_seconds(pid: int) -> float:
    """User + system seconds of a live process, from /proc/PID/stat (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mapped_mb(directory: str | Path) -> dict[str, float]:
    """Rss and Pss (MB) of this process's mappings of the files under `directory` (Linux).

    Pss splits each shared page between the processes mapping it, so the ranks' Pss of a store
    adds up to the host RAM the store takes for all of them together."""
    root, inside, out = str(Path(directory).resolve()), False, {"rss": 0.0, "pss": 0.0}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = len(head) >= 6 and head[5].startswith(root)
            elif inside and head[0] in ("Rss:", "Pss:"):
                out[head[0][:-1].lower()] += int(head[1]) / 1024
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], object], repeats: int, device: str, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `repeats` times after `warmup` calls (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return samples
