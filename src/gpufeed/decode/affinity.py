"""Which CPUs the decode worker processes run on: whole physical cores of their own, the others left
to the training process.

A worker that decodes on the other hardware thread (SMT sibling) of the core running the training
thread slows that thread's Python and kernel launches, and the training step with them; the
operating system places workers and threads without knowing which one the model waits on. So the
workers are pinned to the last physical cores, as many as they need (one hardware thread each),
and at least `LEFT` whole cores stay free for the training thread, the producer and the GPU
decoders' threads. docs/benchmarks.md has the measurements.
"""

from __future__ import annotations

import os
from pathlib import Path

PIN = True  # False: the workers run wherever the operating system puts them (train_bench rows pin=False)
LEFT = 2  # physical cores never given to the workers

_SYS = Path("/sys/devices/system/cpu")


def cores(cpus: set[int] | None = None, sys_cpu: Path = _SYS) -> list[list[int]]:
    """The CPUs this process may use (`cpus`, default its affinity), grouped by physical core (package
    and core id from sysfs), in the order of their lowest CPU; [] where the topology is unknown."""
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return []
        cpus = os.sched_getaffinity(0)
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            key = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            return []
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values())


def worker_cpus(workers: int, groups: list[list[int]] | None = None) -> set[int] | None:
    """The CPUs for `workers` decode processes: those of the last physical cores, enough for a
    hardware thread each, leaving `LEFT` whole cores; None (not pinned) where PIN is off, the
    topology is unknown or there are too few cores to leave any."""
    groups = cores() if groups is None else groups
    if not PIN or workers <= 0 or len(groups) <= LEFT:
        return None
    per_core = max(len(g) for g in groups)
    need = min(len(groups) - LEFT, -(-workers // per_core))
    return {cpu for g in groups[len(groups) - need :] for cpu in g}


def pin(pid: int, cpus: set[int] | None) -> None:
    """Run process `pid` on `cpus` (None: leave it where it may run); best effort, it may have ended."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            pass
