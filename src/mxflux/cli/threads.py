"""The CPU thread pools of an `mxflux` process, sized before torch or numba loads.

On a CPU two thread pools run our work: torch's (OpenMP, for its own ops) and numba's (the compiled
MX packers and GEMM, `mxflux.kernels.operands_cpu`). Started with nothing set, each sizes itself to
every core of the machine, not to the cores this process may use (its affinity, its cgroup's CPU
quota), and neither knows what else runs there.

Measured (benchmarks/cpu_threads.py, 2 cores, a short default run, alone and beside one busy process):
torch's pool shares well, numba's does not. Its parallel kernels split their rows evenly between its
threads, so a kernel lasts as long as its slowest thread, and a thread that shares its core with
another process gets half of it: the run took 2.6-2.8x as long beside the busy process. With numba on
one thread it took as long beside it as alone, but alone 1.4x as long as with two. Letting OpenMP
threads sleep at once (OMP_WAIT_POLICY=PASSIVE) shared well too but made the run alone 1.55x slower.

`configure_threads()` runs before torch or numba is imported (the CLI calls it first), and sets, only
where the user has not: torch's pool to the usable cores (affinity, cgroup CPU quota), and numba's to
the cores no other process is running on as it starts (`free_cpus`: the usable cores less the
other runnable threads the kernel counts, sampled over a tenth of a second). MXFLUX_THREADS=off
leaves the environment as it is.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

__all__ = ["configure_threads", "free_cpus", "other_runnable", "usable_cpus"]


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


def other_runnable(samples: int = 5, interval_s: float = 0.02, loadavg: Path = Path("/proc/loadavg")) -> float:
    """Threads of other processes running or waiting for a core now: the kernel's count of runnable
    threads (/proc/loadavg's fourth field, which includes the reader), less this one, median of
    `samples` reads; 0 where the count cannot be read (not Linux)."""
    counts = []
    for i in range(samples):
        try:
            counts.append(int(loadavg.read_text().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return 0.0
        if i + 1 < samples:
            time.sleep(interval_s)
    return float(statistics.median(counts))


def free_cpus(usable: int | None = None, others: float | None = None) -> int:
    """The usable cores that no other process is running on now (at least 1)."""
    usable = usable_cpus() if usable is None else usable
    others = other_runnable() if others is None else others
    return max(1, min(usable, usable - int(round(others))))


def configure_threads(environ=os.environ) -> dict[str, str]:
    """Set the thread pools' sizes in `environ` where unset; returns what it set."""
    if environ.get("MXFLUX_THREADS", "").lower() == "off":
        return {}
    usable = usable_cpus()
    wanted = {"OMP_NUM_THREADS": str(usable), "MKL_NUM_THREADS": str(usable)}
    if "NUMBA_NUM_THREADS" not in environ:
        wanted["NUMBA_NUM_THREADS"] = str(free_cpus(usable))
    set_now = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(set_now)
    return set_now
