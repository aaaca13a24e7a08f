"""A run directory belongs to one run.

`mxflux train` writes a run's checkpoint, metrics, TensorBoard events, loss curve, samples and
MLPerf log into one directory, under the directory's lock (`mxflux.train.runlock`). A new run
never starts where another run's checkpoint is: it is refused with a message saying how to
continue that run (`--resume DIR`, which trains on in DIR, offered only where the checkpoint can
be read) or to start over (`--overwrite`, which removes those files first). A directory whose run
stopped before its first checkpoint holds nothing to continue, so a new run takes it over. Files
that are not a run's are never touched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["RUN_FILES", "RunDirError", "run_files", "check_new_run", "clear_run", "remove_leftovers"]

# What a run writes into its directory (and nothing else there is ours to remove).
RUN_FILES = ("latest.pt", "latest.dcp", ".latest.dcp.old", ".latest.dcp.tmp", "metrics.csv", "tensorboard",
             "loss_curve.png", "samples.png", "mlperf.log", "train.log", "run_id")
# Half-written files of an interrupted write (a checkpoint's, the metrics' rewrite on resume).
LEFTOVER_PATTERNS = (".latest.pt.*.tmp", ".metrics.csv.tmp", ".samples.png.*.tmp")


class RunDirError(ValueError):
    """A run directory that a command may not use as asked; the message says what to do instead."""


def _leftovers(out_dir: Path) -> list[Path]:
    return sorted(p for pattern in LEFTOVER_PATTERNS for p in out_dir.glob(pattern))


def run_files(out_dir: str | Path) -> list[Path]:
    """The run's files present in `out_dir` (leftover temporary files included)."""
    out_dir = Path(out_dir)
    return [out_dir / name for name in RUN_FILES if (out_dir / name).exists()] + _leftovers(out_dir)


def remove_leftovers(out_dir: str | Path) -> None:
    """Remove the temporary files of writes that never finished (only under the run's lock:
    then no write of this directory is under way)."""
    for path in _leftovers(Path(out_dir)):
        path.unlink(missing_ok=True)


def check_new_run(out_dir: str | Path, *, overwrite: bool) -> str | None:
    """Refuse a new run in a directory that holds a run's checkpoint, unless `overwrite` (then
    clear it). Files of a run without a checkpoint are cleared; the returned line says so."""
    from .checkpoint import CheckpointCorruptError, CheckpointNotFoundError, read_checkpoint_meta

    out_dir = Path(out_dir)
    found = run_files(out_dir)
    if not found:
        return None
    if overwrite:
        clear_run(out_dir)
        return None
    try:
        step = read_checkpoint_meta(out_dir)["progress"]["step"]
    except CheckpointNotFoundError:
        candidates = (out_dir / "latest.pt", out_dir / "latest.dcp", out_dir / ".latest.dcp.old")
        damaged = [p for p in candidates if p.exists()]
        if damaged:  # a checkpoint is there but is none we can read: not ours to delete unasked
            raise RunDirError(f"run directory {out_dir} holds {damaged[0]}, which is not a readable checkpoint (a "
                              f"{'directory' if damaged[0].is_dir() else 'file'} without what a checkpoint holds); "
                              f"start over there with --overwrite (deletes it and the run's other files), or "
                              f"choose another --out") from None
        clear_run(out_dir)
        names = ", ".join(p.name for p in found)
        return f"note: {out_dir} held a run that stopped before its first checkpoint ({names}); starting anew there"
    except CheckpointCorruptError as e:
        raise RunDirError(f"run directory {out_dir} holds a run whose checkpoint cannot be read ({e}); start over "
                          f"there with --overwrite (deletes its files), or choose another --out") from None
    raise RunDirError(f"run directory {out_dir} already holds a run at step {step}; continue it with "
                      f"`mxflux train --resume {out_dir}`, start over there with --overwrite (deletes its "
                      f"checkpoint and metrics), or choose another --out")


def clear_run(out_dir: str | Path) -> None:
    """Remove a run's files from `out_dir` (only those: anything else there stays)."""
    for path in run_files(out_dir):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
