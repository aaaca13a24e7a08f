"""Where a measured number came from, written by the tools themselves into every result they save.

`provenance()` is a flat dict: the commit measured and whether the tree differed from it, the
date, the card and its driver, the versions of Python, torch, CUDA, Triton and torchao, the exact
command, the MXFLUX_* switches of the environment, and the host's load average when it ran (a busy
host makes timings meaningless, so a reader needs to see it). `check_provenance(d)` names what a
result lacks; the results generator (benchmarks/results_tables.py) refuses a result without it.

The commit comes from MXFLUX_GIT_COMMIT and MXFLUX_GIT_DIRTY where the caller sets them (a copy of the
tree sent to a GPU machine: benchmarks/gpu_run.sh says how), else from git; `commit_source` says which.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["REQUIRED_KEYS", "check_provenance", "git_state", "provenance"]

REQUIRED_KEYS = ("commit", "dirty", "date", "card", "driver", "python", "torch", "cuda", "triton", "torchao",
                 "command")

_REPO = Path(__file__).resolve().parents[3]


def git_state(repo: Path = _REPO) -> tuple[str | None, bool | None, str]:
    """(commit, dirty, source): from MXFLUX_GIT_COMMIT (and MXFLUX_GIT_DIRTY=0/1) where the caller set
    them, else from git in `repo`, else (None, None, "unknown"). The caller's word comes first: a copy
    of the tree sent to another machine may carry a .git of an older commit, whose HEAD git would
    report (as dirty)."""
    commit = os.environ.get("MXFLUX_GIT_COMMIT")
    if commit:
        return commit, os.environ.get("MXFLUX_GIT_DIRTY", "1") != "0", "environment"
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
        return commit, bool(status.strip()), "git"
    except (OSError, subprocess.SubprocessError):
        return None, None, "unknown"


def _version(distribution: str) -> str | None:
    """An installed distribution's version, without importing it (torchao's import is slow and loud);
    None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _card_and_driver() -> tuple[str, str | None]:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True)
            driver = smi.stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            driver = None
        return name, driver
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {cpu}, {os.cpu_count()} logical cores", None


def provenance(command: list[str] | None = None) -> dict:
    """This process's provenance (`command`: the command line to record, default this process's own)."""
    import torch

    commit, dirty, source = git_state()
    card, driver = _card_and_driver()
    argv = command if command is not None else [Path(sys.executable).name, *sys.argv]
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "commit": commit, "dirty": dirty, "commit_source": source,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "card": card, "driver": driver,
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _version("triton"), "torchao": _version("torchao"),
        "command": shlex.join(argv),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("MXFLUX_") and not k.startswith("MXFLUX_GIT")},
        "load_average": load, "cpu_count": os.cpu_count(),
    }


def check_provenance(result: dict) -> list[str]:
    """What a saved result's provenance lacks ([] when complete): the missing keys, an unknown commit."""
    p = result.get("provenance") if isinstance(result, dict) else None
    if not isinstance(p, dict):
        return ["provenance"]
    missing = [f"provenance.{k}" for k in REQUIRED_KEYS if k not in p]
    if not p.get("commit"):
        missing.append("provenance.commit (unknown)")
    return missing
