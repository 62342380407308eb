"""Prints how many cores this process may use: the CPUs it may run on, capped by a
container's CPU quota (cgroup v2 cpu.max or v1 cpu.cfs_quota_us), which os.cpu_count()
and pytest-xdist's own count ignore: a 2-core quota on a 64-CPU host prints 2."""

from __future__ import annotations

import os
from pathlib import Path


def quota_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Whole cores of the CPU quota, or None where there is none."""
    v2, v1 = cgroup / "cpu.max", cgroup / "cpu" / "cpu.cfs_quota_us"
    try:
        if v2.exists():
            quota, period = v2.read_text().split()
        elif v1.exists():
            quota, period = v1.read_text(), (v1.parent / "cpu.cfs_period_us").read_text()
        else:
            return None
        if quota.strip() in ("max", "-1"):
            return None
        return max(1, int(quota) // int(period))
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1  # macOS: no affinity, no cgroups
    print(min(cores, quota_cores() or cores))
