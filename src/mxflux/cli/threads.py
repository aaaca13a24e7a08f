"""The CPU thread pools of an `mxflux` process, sized and set to wait politely before torch loads.

On a CPU two thread pools run our work: torch's (OpenMP, for its own ops) and numba's (the compiled
MX packers and GEMM, `mxflux.kernels.operands_cpu`). Started with nothing set, each sizes itself to
every core of the machine, not the cores this process may use (its affinity, its cgroup's CPU
quota), and each busy-waits (spins) for a while whenever it waits for a peer. Alone on idle cores
that is fastest; next to other work, a spinning thread burns the timeslice its descheduled peer
needed, and a run took 2.8x as long beside one busy process on 2 cores (benchmarks/cpu_threads.py).

`configure_threads()` runs before torch or numba is imported (the CLI calls it first), and sets, only
where the user has not: both pools' size to the usable cores, and libgomp's spin before sleeping to
SPIN_COUNT iterations (about SPIN_US microseconds) instead of its 300,000. MXFLUX_THREADS=off leaves the
environment as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SPIN_COUNT", "configure_threads", "usable_cpus"]

# libgomp's GOMP_SPINCOUNT: how many times a waiting thread polls before it sleeps (its default, with
# OMP_WAIT_POLICY unset, is 300,000; PASSIVE is 0). Chosen by benchmarks/cpu_threads.py.
SPIN_COUNT = 10000


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs this process's cgroup may use (quota / period), None without a quota (cgroup v2 and v1)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        n = min(n, max(1, int(quota)))
    return max(1, n)


def configure_threads(environ=os.environ) -> dict[str, str]:
    """Set the thread pools' size and wait policy in `environ` where unset; returns what it set."""
    if environ.get("MXFLUX_THREADS", "").lower() == "off":
        return {}
    n = str(usable_cpus())
    wanted = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "NUMBA_NUM_THREADS": n}
    if "OMP_WAIT_POLICY" not in environ:
        wanted["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    set_now = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(set_now)
    return set_now
