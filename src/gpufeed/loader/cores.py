"""How many CPU cores this rank may use, counted once, however it was launched.

Three limits apply, each counted once:

- **Affinity**: the CPUs the scheduler lets this process run on (`taskset`, `numactl`, a scheduler's
  cores-per-task, `os.sched_setaffinity` in the script, a container's cpuset).
- **Sharing**: under torchrun, `LOCAL_WORLD_SIZE` ranks run on this machine. They divide the affinity
  only when they share it: a rank whose affinity is narrower than its launcher's (torchrun's agent, or
  whatever started it) was given its own slice, and dividing that again starved it (a rank bound to 16
  of 32 cores got 6 decode workers, issue 46).
- **Quota**: a cgroup CPU quota (`cpu.max`, or cgroup v1's `cpu.cfs_quota_us`), as containers and
  Kubernetes set it: the cgroup may use that many CPUs' time whatever its affinity, shared by the ranks
  in the same cgroup.

Every reading goes through a function of its own, so tests fake each one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RankCores:
    """The cores this rank may use (`usable`), and what they were counted from."""

    usable: int
    affinity: int  # CPUs in this process's affinity mask
    sharing: int  # local ranks that divide it (1 where the rank was given its own slice)
    quota: float | None  # the cgroup's CPU quota in CPUs, None without one
    quota_sharing: int  # local ranks in the same cgroup

    def describe(self) -> str:
        """One line for logs and `gpufeed doctor`."""
        parts = [
            f"{self.affinity} CPUs in its affinity"
            + (f", shared by {self.sharing} local ranks" if self.sharing > 1 else "")
        ]
        if self.quota is not None:
            parts.append(
                f"a cgroup CPU quota of {self.quota:g} CPUs"
                + (f" for {self.quota_sharing} local ranks" if self.quota_sharing > 1 else "")
            )
        return f"{self.usable} cores for this rank ({'; '.join(parts)})"


def affinity(pid: int = 0) -> set[int] | None:
    """The CPUs process `pid` (0: this one) may run on; None where that can't be read."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return set(os.sched_getaffinity(pid))
    except OSError:
        return None


def launcher() -> int:
    """The process that started this one (torchrun's agent, srun's step daemon, a shell)."""
    return os.getppid()


def local_ranks() -> int:
    """Ranks on this machine, as torchrun says (LOCAL_WORLD_SIZE); 1 otherwise."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def cgroup(pid: int = 0) -> str | None:
    """The cgroup (v2 path, or v1's cpu controller path) of `pid` (0: this process)."""
    try:
        lines = Path(f"/proc/{pid or 'self'}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" or "cpu" in controllers.split(","):
            return path
    return None


def cpu_quota(path: str | None) -> float | None:
    """The CPU quota, in CPUs, of the cgroup at `path` (and of those above it: the smallest applies),
    None where there is none or it can't be read."""
    if path is None:
        return None
    found = []
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        here = root / path.lstrip("/")
        while True:
            found.append(_quota_at(here))
            if here == root or root not in here.parents:
                break
            here = here.parent
    quotas = [q for q in found if q is not None]
    return min(quotas) if quotas else None


def _quota_at(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def rank_cores() -> RankCores:
    """The cores this rank may use: its affinity, divided among the local ranks only if they share it,
    and no more than its part of a cgroup CPU quota."""
    mine = affinity()
    count = len(mine) if mine else os.cpu_count() or 1
    local = local_ranks()
    sharing = 1
    if local > 1:
        parent = affinity(launcher())
        # narrower than the launcher's: this rank was given its own slice. Unknown: shared if it spans
        # the whole machine
        own = (mine < parent) if (mine and parent) else count < (os.cpu_count() or count)
        sharing = 1 if own else local
    usable = max(1, count // sharing)
    here = cgroup()
    quota = cpu_quota(here)
    quota_sharing = 1
    if quota is not None:
        quota_sharing = local if local > 1 and cgroup(launcher()) == here else 1
        usable = max(1, min(usable, math.floor(quota / quota_sharing)))
    return RankCores(usable, count, sharing, quota, quota_sharing)
