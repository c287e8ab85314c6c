"""The CPUs this process may compute on: its affinity mask, capped by its cgroup's CPU quota (a pod's CPU limit).

torch starts one OpenMP thread per CPU in the affinity mask. In a Kubernetes pod without a static CPU-manager
policy that mask is the whole node, while the pod's CPU limit is a CFS quota: a pod limited to 4 CPUs on a 64-core
node would run 64 threads and be throttled for most of every period. The quota, rounded down (a share of a CPU
cannot host a thread of its own), bounds the threads, as Go's automaxprocs does for GOMAXPROCS.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs the process's cgroup may use per period (cgroup v2 cpu.max, else v1 cfs quota); None when unlimited or
    unreadable (no cgroup filesystem: not in a container, or not Linux)."""
    paths = _cgroup_paths(proc_cgroup)
    v2 = _read(root / paths.get("", "/").lstrip("/") / "cpu.max") or _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else _ratio(quota, period)
    for v1 in (root / "cpu" / paths.get("cpu", "/").lstrip("/"), root / "cpu", root / "cpu,cpuacct"):
        quota_us, period_us = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if quota_us is not None and period_us is not None:
            return None if quota_us.startswith("-") else _ratio(quota_us, period_us)
    return None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Threads worth running: the affinity mask's CPUs, at most the quota rounded down, at least 1."""
    cpus = len(os.sched_getaffinity(0))
    quota = quota_cpus(root, proc_cgroup)
    return max(1, min(cpus, math.floor(quota)) if quota is not None else cpus)


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller → the process's cgroup path ("" for the v2 unified hierarchy), from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        for c in controllers.split(","):
            out[c] = path
    return out


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = float(quota), float(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
