"""A run directory belongs to one run.

`mxflux train` writes a run's checkpoint, metrics, TensorBoard events, loss curve, samples and
MLPerf log into one directory. A new run never starts where another run's files are: it is
refused with a message saying how to continue that run (`--resume DIR`, which trains on in
DIR) or to start over (`--overwrite`, which removes those files first). Files that are not a
run's are never touched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["RUN_FILES", "RunDirError", "run_files", "check_new_run", "clear_run"]

# What a run writes into its directory (and nothing else there is ours to remove).
RUN_FILES = ("latest.pt", "latest.dcp", ".latest.dcp.old", ".latest.dcp.tmp", "metrics.csv", "tensorboard",
             "loss_curve.png", "samples.png", "mlperf.log")


class RunDirError(ValueError):
    """A run directory that a command may not use as asked; the message says what to do instead."""


def run_files(out_dir: str | Path) -> list[Path]:
    """The run's files present in `out_dir`."""
    out_dir = Path(out_dir)
    return [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]


def _describe(out_dir: Path) -> str:
    from .checkpoint import CheckpointCorruptError, CheckpointNotFoundError, read_checkpoint_meta

    try:
        progress = read_checkpoint_meta(out_dir)["progress"]
    except CheckpointNotFoundError:
        return "files of a run without a checkpoint"
    except CheckpointCorruptError:
        return "a run whose checkpoint cannot be read"
    return f"a run at step {progress['step']}"


def check_new_run(out_dir: str | Path, *, overwrite: bool) -> None:
    """Refuse a new run in a directory that holds a run, unless `overwrite` (then clear it)."""
    out_dir = Path(out_dir)
    if not run_files(out_dir):
        return
    if overwrite:
        clear_run(out_dir)
        return
    raise RunDirError(f"run directory {out_dir} already holds {_describe(out_dir)}; continue it with "
                      f"`mxflux train --resume {out_dir}`, start over there with --overwrite (deletes its "
                      f"checkpoint and metrics), or choose another --out")


def clear_run(out_dir: str | Path) -> None:
    """Remove a run's files from `out_dir` (only those: anything else there stays)."""
    for path in run_files(out_dir):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
