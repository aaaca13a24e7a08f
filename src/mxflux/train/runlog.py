"""What a run says in words: `train.log` in its directory, plain lines on a console that is not a
terminal, the start-up phases, and the summary at its end.

A run started by a batch system, `nohup` or a pipe has no terminal for the progress bar, and a bar
written into a file says nothing until the run ends. So every run appends plain lines to
`<run>/train.log` (rank 0), and where stdout is not a terminal (or the bar is turned off) prints
the same lines: a training line every `interval_s` seconds (and at the first and last step), each
evaluation, and the start-up phases that took more than a second. Speed and time left come from
the same window (`mxflux.train.eta.SmoothedETA`, the last minutes), so the two agree.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

from .callbacks import Callback
from .eta import SmoothedETA, format_remaining

__all__ = ["LogLines", "RunLog", "summary_lines"]


class RunLog:
    """Appends lines to `<out_dir>/train.log` and, with `echo`, prints them to stdout. Lines are
    time-stamped in the file only (the console has its own clock). Without a directory yet, lines wait
    until `attach` names it: a run that fails while it starts (bad data, say) leaves no log behind in a
    directory it never used."""

    def __init__(self, out_dir: str | Path | None, *, echo: bool, enabled: bool = True):
        self.path = None if out_dir is None else Path(out_dir) / "train.log"
        self.echo, self.enabled = echo, enabled  # enabled: rank 0 only, under torchrun
        self.pending: list[str] = []

    def attach(self, out_dir: str | Path) -> None:
        if not self.enabled:
            return
        self.path = Path(out_dir) / "train.log"
        pending, self.pending = self.pending, []
        self._write(pending)

    def _write(self, lines: list[str]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(f"{line}\n" for line in lines)
        except OSError:  # a log line is never worth a run: the console still gets it
            pass

    def line(self, text: str, *, console: bool | None = None) -> None:
        if not self.enabled:
            return
        stamped = f"{datetime.datetime.now().isoformat(sep=' ', timespec='seconds')}  {text}"
        if self.path is None:
            self.pending.append(stamped)
        else:
            self._write([stamped])
        if self.echo if console is None else console:
            print(text, flush=True)

    def phase(self, what: str):
        """A context manager that logs `what` with its duration where it took more than a second."""
        return _Phase(self, what)


class _Phase:
    def __init__(self, log: RunLog, what: str):
        self.log, self.what = log, what

    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        took = time.monotonic() - self.t0
        if exc[0] is None and took > 1.0:
            self.log.line(f"{self.what}: {took:.1f} s", console=True)
        return False


class LogLines(Callback):
    """Training lines into the run log every `interval_s` seconds, at the first log step and the last
    step, and every evaluation; `clock`: seconds, monotonic (tests pass their own)."""

    def __init__(self, log: RunLog, *, interval_s: float = 30.0, clock=time.monotonic):
        self.log, self.interval_s, self.clock = log, interval_s, clock
        self.eta = SmoothedETA()
        self.last = None
        self.first_step_from = None

    def on_fit_start(self, trainer, end_step: int) -> None:
        self.end_step, self.batch = end_step, trainer.cfg.batch.global_batch_size
        self.compiled = trainer.cfg.model.compile
        self.log.line(f"training {trainer.cfg.name}: steps {trainer.step + 1} to {end_step} of "
                      f"{self.batch} images; a line every {self.interval_s:.0f} s")
        self.first_step_from = self.clock()

    def on_step_end(self, trainer, result) -> None:
        if self.first_step_from is None:
            return
        took, self.first_step_from = self.clock() - self.first_step_from, None
        if took > 1.0:  # a start-up phase of its own: compilation, first allocations, the loader's start
            self.log.line(f"first step{' (compiled)' if self.compiled else ''}: {took:.1f} s", console=True)

    def on_log(self, trainer, row: dict) -> None:
        now = self.clock()
        self.eta.update(row["step"], now)
        if self.last is not None and now - self.last < self.interval_s and row["step"] < self.end_step:
            return
        self.last = now
        self.log.line(progress_line(row, self.end_step, self.eta, self.batch))

    def on_eval_end(self, trainer, loss: float) -> bool:
        self.log.line(f"step {trainer.step}: eval loss {loss:.4f}")
        return False


def progress_line(row: dict, end_step: int, eta: SmoothedETA, batch: int) -> str:
    """"step 120/2300 (5.2 %)  loss 0.4823  lr 2.94e-03  31.2 img/s  0:04:12 left": speed and time left
    from the same window."""
    speed = eta.steps_per_s()
    rate = "– img/s" if speed is None else f"{speed * batch:.1f} img/s"
    return (f"step {row['step']}/{end_step} ({100 * row['step'] / end_step:.1f} %)  loss {row['loss']:.4f}  "
            f"lr {row['lr']:.2e}  {rate}  {format_remaining(eta.remaining_s(end_step))} left")


def summary_lines(result: dict, *, out_dir: Path, wall_s: float, images: int) -> list[str]:
    """The run's end in words: what it trained, how fast, its losses, what it wrote, what to do next."""
    lines = [f"done: step {result['step']} ({result['samples']} images) in {format_remaining(wall_s)}"
             + (f", {images / wall_s:.1f} images/s this session" if wall_s > 0 and images else "")]
    losses = []
    if result.get("train_loss") is not None:
        losses.append(f"last training loss {result['train_loss']:.4f}")
    if result.get("eval_loss") is not None:
        losses.append(f"validation loss {result['eval_loss']:.4f}")
    if losses:
        lines.append("  " + ", ".join(losses))
    made = [(name, result.get(key)) for name, key in (("checkpoint", "checkpoint"), ("samples", "samples_png"),
                                                      ("loss curve", "loss_curve"))]
    made += [("metrics", str(out_dir / "metrics.csv")), ("log", str(out_dir / "train.log"))]
    for name, path in made:
        if path and Path(path).exists():
            lines.append(f"  {name + ':':<12} {path}")
    lines.append(f"  next: mxflux sample {out_dir} --prompt \"...\" --out grid.png   |   mxflux eval {out_dir}   |   "
                 f"train longer: mxflux train --resume {out_dir} --set train.train_samples=N")
    return lines


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()
