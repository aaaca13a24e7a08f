"""What happens around training that is not training: hooks the fit loop calls.

`Trainer.fit` calls every callback at fixed points; each hook gets the trainer and the values
already read on the host, so no hook ever forces a host-device synchronisation of its own. The
metrics files (`mxflux.train.metrics`), the MLPerf log (`mxflux.train.mlperf`) and the progress
bar (here) are callbacks; a new one subclasses `Callback` and overrides what it needs.
"""

from __future__ import annotations

__all__ = ["Callback", "ProgressBar"]


class Callback:
    """No-op hooks, called in this order: on_fit_start, then per optimizer step on_step_end (the
    `StepResult`, unread) and at log steps on_log (the row as host floats), around each
    evaluation on_eval_start / on_eval_end, on_checkpoint after each checkpoint, and on_fit_end once
    (also when the run fails)."""

    # Whether `fit` may evaluate once more at its last step (MLPerf evaluates on its schedule only).
    final_eval = True

    def on_fit_start(self, trainer, end_step: int) -> None:
        pass

    def on_step_end(self, trainer, result) -> None:
        pass

    def on_log(self, trainer, row: dict) -> None:
        """`row`: step, samples, loss, lr, grad_norm, images_per_s and, with MX layers,
        blocks_outside_window (cumulative over the run)."""

    def on_eval_start(self, trainer) -> None:
        pass

    def on_eval_end(self, trainer, loss: float) -> bool:
        """Return True to stop training here (e.g. a convergence target reached)."""
        return False

    def on_fit_end(self, trainer) -> None:
        pass

    def on_checkpoint(self, trainer, path) -> None:
        """After each checkpoint, at its interval, on a stop and at the run's end (`path` written)."""


class ProgressBar(Callback):
    """A rich progress bar: steps done of the run's end step, loss, LR, and images/s and the time left
    both at the mean speed of the last minutes (`mxflux.train.eta`). `clock`: seconds, monotonic."""

    def __init__(self, name: str, *, clock=None, console=None):
        import time

        from .eta import SmoothedETA

        self.name = name
        self.bar = None
        self.clock = clock or time.monotonic
        self.console = console
        self.eta = SmoothedETA()

    def on_fit_start(self, trainer, end_step: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.end_step = end_step
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[stats]}"), TextColumn("[cyan]{task.fields[left]}"),
                            console=self.console)
        self.bar.start()
        self.batch = trainer.cfg.batch.global_batch_size
        first = "first step (compiling)" if trainer.cfg.model.compile else "first steps"
        self.task = self.bar.add_task(self.name, total=end_step, completed=trainer.step, stats=f"{first} ...",
                                      left="-:--:--")

    def on_log(self, trainer, row: dict) -> None:
        from .eta import format_remaining

        # The first sample is the first log, not the fit's start: the first steps' one-time costs
        # (allocation, compiled kernels' first calls) would otherwise enter the mean.
        self.eta.update(row["step"], self.clock())
        speed = self.eta.steps_per_s()  # the window the time left is taken from: the two agree
        rate = "– img/s" if speed is None else f"{speed * self.batch:.1f} img/s"
        self.bar.update(self.task, completed=row["step"], stats=f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {rate}",
                        left=format_remaining(self.eta.remaining_s(self.end_step)) + " left")

    def on_eval_end(self, trainer, loss: float) -> bool:
        self.bar.console.print(f"step {trainer.step}: eval loss {loss:.4f}")
        return False

    def on_fit_end(self, trainer) -> None:
        if self.bar is not None:
            self.bar.stop()
