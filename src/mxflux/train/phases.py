"""Where `mxflux train` is when it is stopped, and the one line that says what is on disk then.

A stop signal in the training steps is handled by the loop (a checkpoint, `TrainingInterrupted`);
anywhere else (start-up, a second signal during the steps, the final sampling) it raises
`stop.Interrupted` where the program is. Nothing is lost either way: checkpoints are written
atomically (a write cut short leaves the previous one), and a run whose final sampling was cut
short draws its samples again when it is resumed. The same holds for a full disk.
"""

from __future__ import annotations

import errno
import signal
from pathlib import Path

from .rundir import RunDirError

__all__ = ["TrainPhase", "DISK_FULL"]

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class TrainPhase:
    """What the command is doing (`phase`), in which run directory, with which trainer."""

    def __init__(self):
        self.phase = "start-up"
        self.out: Path | None = None
        self.resume_step: int | None = None  # the checkpoint's step when resuming
        self.trainer = None
        self._released_checkpoint: Path | None = None

    def release_trainer(self) -> None:
        """Drop the trainer (its model holds the process group, which is destroyed next) and keep
        what the messages need of it."""
        if self.trainer is not None:
            self._released_checkpoint = self.trainer.last_checkpoint
        self.trainer = None

    @property
    def last_checkpoint(self) -> Path | None:
        return self.trainer.last_checkpoint if self.trainer is not None else self._released_checkpoint

    def _kept(self) -> str:
        ckpt = self.last_checkpoint
        if ckpt is not None:
            return f"the last checkpoint, {ckpt}, is kept"
        if self.resume_step is not None:
            return f"its checkpoint at step {self.resume_step} is as it was"
        return "no checkpoint was written"

    def _resume_hint(self) -> str:
        saved = self.last_checkpoint is not None or self.resume_step is not None
        if saved:
            return f"; continue with: mxflux train --resume {self.out}"
        return f"; {self.out} is free for a new run" if self.out is not None else ""

    def interrupted(self, signum: int) -> str:
        name = signal.Signals(signum).name
        if self.phase == "sampling":
            return (f"{name} during the final sampling: the run is finished ({self._kept()}); samples.png was not "
                    f"written; draw it with: mxflux train --resume {self.out}")
        where = "again: stopped at once" if self.phase == "training" else "during start-up: stopped"
        return f"{name} {where}, without a new checkpoint; {self._kept()}{self._resume_hint()}"

    def disk_full(self, e: OSError) -> RunDirError:
        target = f" writing {e.filename}" if e.filename else ""
        what = e.strerror if str(e.strerror).startswith("no space left") else f"no space left on device ({e.strerror})"
        return RunDirError(f"run directory {self.out}: {what}{target}; "
                           f"{self._kept()}; free some space{self._resume_hint().replace('; continue', ', then continue')}")
