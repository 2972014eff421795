"""How many threads a CPU engine runs: the CPUs this process may use.

The CPUs the process may run on (its affinity mask) are not the CPU time it may
use: a container with a CPU limit (Kubernetes `resources.limits.cpu`, `docker
run --cpus`) sees every core of its node but gets only the limit's share of
time, enforced by the cgroup's CFS quota. OpenMP regions with one thread per
visible core there are throttled every period and wait on descheduled threads:
with 2 CPUs visible and a 1-CPU quota the engine ran 1.2-1.6x slower than with
one thread (docs/benchmarks.md), and a node's dozens of cores under a limit of a
few are worse. So the default is the smaller of the affinity mask and
the quota (rounded down, at least one), and `OMP_NUM_THREADS`, the variable
every OpenMP program honours, overrides both.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroup and its ancestors in CPUs (quota
    over period; the smallest on the path), or None when there is none.
    cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us`) alike; `root` and
    `proc_cgroup` are parameters for the tests."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":                           # v2: "0::/path"
            limits += [_v2_limit(d) for d in _dirs(Path(root), path)]
        elif "cpu" in controllers.split(","):           # v1: "3:cpu,cpuacct:/path"
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                base = Path(root) / mount
                if base.is_dir():
                    limits += [_v1_limit(d) for d in _dirs(base, path)]
                    break
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def _dirs(base: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount. In a container
    the mount is often the container's own cgroup, whose path /proc names from
    the host's view (not there): the mount itself is then what applies."""
    parts = [p for p in path.strip().split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_limit(d: Path) -> Optional[float]:
    text = _read(d / "cpu.max")                          # "max 100000" or "200000 100000"
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or 100000)
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(d: Path) -> Optional[float]:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, p = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None          # -1: no quota


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def usable_cpus(limit: Optional[float]) -> int:
    """The affinity mask's CPUs, capped by a CPU quota (`limit`, as
    `cgroup_cpu_limit` reads it; None: no quota)."""
    cpus = affinity_cpus()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return cpus


def default_threads(environ=os.environ) -> tuple[int, str]:
    """(threads for the engine, why): OMP_NUM_THREADS when it is set to a
    positive integer, else `usable_cpus` under this process's cgroup quota."""
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value), "OMP_NUM_THREADS"
    affinity, limit = affinity_cpus(), cgroup_cpu_limit()
    cpus = usable_cpus(limit)
    if cpus < affinity:
        return cpus, f"the cgroup's CPU quota of {limit:g} CPUs ({affinity} visible)"
    return cpus, "the CPUs this process may run on"
