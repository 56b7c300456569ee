"""How many CPUs this process may use: the one number every thread count is sized from.

``os.cpu_count()`` is the host's core count. A process pinned to fewer cores (``taskset``,
``docker --cpuset-cpus``, Kubernetes' static CPU manager) or given a CPU quota (``docker --cpus``,
a Kubernetes CPU limit: the cgroup's ``cpu.max``, or ``cpu.cfs_quota_us`` under cgroup v1) that
sizes its thread pools from the host oversubscribes what it has: on a 16-core machine
``taskset -c 0,1 kiln serve`` started two 8-thread sessions on two cores and served 4.8x less than
``--cpus 2``. The budget is the smallest of the affinity mask, the quota (rounded down: see
``quota_cpus``) and what the user asked for, which may only lower it.

Linux only in full; elsewhere the affinity mask or ``os.cpu_count()`` is all there is."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KilnError

PROC_SELF = Path("/proc/self")


@dataclass(frozen=True)
class CpuBudget:
    count: int
    source: str  # what set it: "all cores", "affinity", "cgroup cpu.max", "cgroup cpu.cfs_quota_us", or a setting

    def __str__(self) -> str:
        return f"{self.count} ({self.source})"


@dataclass(frozen=True)
class Quota:
    """A cgroup's CPU bandwidth limit: ``cpus`` CPUs' worth of time (quota / period), from ``file``."""

    cpus: float
    file: str  # "cpu.max" or "cpu.cfs_quota_us"


def affinity_cpus() -> int | None:
    """The CPUs this process may run on (its affinity mask); None where the OS cannot say."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def quota_cpus(quota: Quota) -> int:
    """A quota as whole CPUs, rounded down (at least 1). More threads than the quota does not give
    more CPU time: a cgroup over its quota is throttled until the next period (100 ms by default),
    so 2 busy threads under a 1.5-CPU quota run 75 ms and then stall 25 ms, a stall every request in
    flight waits out. Below the quota the remainder goes to what runs beside the engine threads
    (the event loop, tokenizing)."""
    return max(1, math.floor(quota.cpus + 1e-9))


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(filesystem type, root inside the hierarchy, mount point, options) of every cgroup mount."""
    mounts = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((after[0], fields[3], fields[4], set(after[2].split(","))))
    return mounts


def _own_folders(mount_root: str, mount_point: str, path: str) -> list[Path]:
    """The folders of this process's cgroup ``path`` (as /proc/self/cgroup names it) and of its
    ancestors, under a mount of the hierarchy's ``mount_root``, innermost first. A parent's limit
    binds its children too. In a container whose cgroup namespace is not its own, ``path`` names
    the host's hierarchy and is not under the mount: then the mount point itself is the cgroup."""
    relative = os.path.relpath(path, mount_root)
    folder = Path(mount_point) / ("." if relative.startswith("..") else relative)
    if not folder.is_dir():
        folder = Path(mount_point)
    folders = [folder]
    while folder != Path(mount_point) and folder.parent != folder:
        folder = folder.parent
        folders.append(folder)
    return folders


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(folder: Path) -> float | None:
    """``cpu.max`` is "QUOTA PERIOD" in microseconds, or "max PERIOD" for no limit."""
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    """``cpu.cfs_quota_us`` is -1 for no limit; ``cpu.cfs_period_us`` beside it."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_quota(proc: Path = PROC_SELF) -> Quota | None:
    """The tightest CPU quota of this process's cgroup and its ancestors (cgroup v2's ``cpu.max``
    or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), found through ``proc``'s mountinfo and
    cgroup files; None when there is none or it cannot be read."""
    mountinfo, membership = _read(proc / "mountinfo"), _read(proc / "cgroup")
    if not mountinfo or not membership:
        return None
    paths: dict[str, str] = {}  # "" (v2) or a v1 controller → this process's cgroup path
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[""] = parts[2]
        for controller in parts[1].split(","):
            if controller:
                paths[controller] = parts[2]
    found: list[Quota] = []
    for kind, root, point, options in _cgroup_mounts(mountinfo):
        if kind == "cgroup2" and "" in paths:
            reader, path, name = _v2_quota, paths[""], "cpu.max"
        elif kind == "cgroup" and "cpu" in options and "cpu" in paths:
            reader, path, name = _v1_quota, paths["cpu"], "cpu.cfs_quota_us"
        else:
            continue
        for folder in _own_folders(root, point, path):
            cpus = reader(folder)
            if cpus is not None:
                found.append(Quota(cpus, name))
    return min(found, key=lambda q: q.cpus, default=None)


def available_cpus() -> CpuBudget:
    """What this process may use: its affinity mask, or less under a cgroup CPU quota."""
    cores = os.cpu_count() or 1
    mask = affinity_cpus()
    budget = CpuBudget(mask, "affinity") if mask is not None and mask < cores else CpuBudget(cores, "all cores")
    quota = cgroup_quota()
    if quota is not None and quota_cpus(quota) < budget.count:
        budget = CpuBudget(quota_cpus(quota), f"cgroup {quota.file}")
    return budget


def cpu_budget(requested: int | None = None, setting: str = "--cpus") -> CpuBudget:
    """The CPUs to size threads from: what the process may use (``available_cpus``), or
    ``requested`` (named ``setting`` in messages), which may only lower it. KilnError when asked
    for more than the process may use: those threads would share fewer cores."""
    available = available_cpus()
    if requested is None:
        return available
    if requested < 1:
        raise KilnError(f"{setting} {requested}: must be at least 1")
    if requested > available.count:
        raise KilnError(f"{setting} {requested} is more than the {available.count} CPUs this process may use "
                        f"({available.source})")
    return CpuBudget(requested, setting)
