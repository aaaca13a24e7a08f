"""The run: optimizer steps, with logging, evaluation and checkpoints at their intervals.

`fit` reads the steps' device values only where something needs them (a log row, an eval, a
checkpoint, an interrupt), all unread steps at once, so the device is never waited on in
between. That read is also the non-finite guard: a non-finite loss or gradient norm raises
`NonFiniteError` naming the step and its samples before any later checkpoint is written. The
metrics files, the MLPerf log and the progress bar are callbacks (`mxflux.train.callbacks`).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .callbacks import ProgressBar
from .results import StepResult, first_non_finite, read_results
from .stop import NonFiniteError, SignalFlag, TrainingInterrupted

__all__ = ["fit"]


def fit(trainer, *, progress: bool = True, max_steps: int | None = None) -> dict:
    """Train to `train.train_samples`, or until the run has taken `max_steps` optimizer steps
    in all (steps before a resume count); log, evaluate and checkpoint on the way.

    SIGINT/SIGTERM/SIGHUP end the run after the current step with a checkpoint (TrainingInterrupted);
    a non-finite loss or gradient norm ends it before anything more is written (NonFiniteError).
    """
    from .metrics import MetricsCallback

    c = trainer.cfg
    end_step = trainer.total_steps if max_steps is None else min(trainer.total_steps, max_steps)
    callbacks = list(trainer.callbacks)
    if c.lora is not None:  # every rank: under FSDP2 the adapters are gathered from their shards
        from .adapters import AdaptersFile

        callbacks.append(AdaptersFile())
    if trainer.rank == 0:
        callbacks.append(MetricsCallback(trainer.out_dir, title=f"{c.name} ({c.precision.name})"))
        if progress:
            callbacks.append(ProgressBar(c.name))
    final_eval = all(cb.final_eval for cb in callbacks)
    next_eval = (trainer.samples // c.train.eval_every_samples + 1) * c.train.eval_every_samples
    unread: list[StepResult] = []  # steps not yet read on the host
    row: dict = {}
    clock = (time.perf_counter(), trainer.samples)
    stop = False
    with SignalFlag() as signals:
        try:
            for cb in callbacks:
                cb.on_fit_start(trainer, end_step)
            if trainer.step == 0 and c.model.init_from and final_eval:  # the loaded weights' loss: a fine-tune's baseline
                for cb in callbacks:
                    cb.on_eval_start(trainer)
                trainer.last_eval = trainer.evaluate()
                for cb in callbacks:
                    cb.on_eval_end(trainer, trainer.last_eval)
            batches = trainer.batches()
            while trainer.step < end_step and not stop:
                result = trainer.train_step([next(batches) for _ in range(trainer.accum)])
                unread.append(result)
                for cb in callbacks:
                    cb.on_step_end(trainer, result)
                log_now = trainer.step % c.train.log_every == 0 or trainer.step == end_step
                eval_now = trainer.samples >= next_eval or (trainer.step == end_step and final_eval)
                save_now = bool(c.train.checkpoint_every) and trainer.step % c.train.checkpoint_every == 0
                interrupted = _interrupt_signal(trainer, signals, log_now)
                if log_now or eval_now or save_now or interrupted:
                    row = _read_checked(trainer, unread)
                if log_now:
                    now = time.perf_counter()
                    row["images_per_s"] = (trainer.samples - clock[1]) / max(now - clock[0], 1e-9)
                    clock = (now, trainer.samples)
                    for cb in callbacks:
                        cb.on_log(trainer, {"step": trainer.step, "samples": trainer.samples, **row})
                if eval_now:
                    next_eval += c.train.eval_every_samples
                    for cb in callbacks:
                        cb.on_eval_start(trainer)
                    trainer.last_eval = trainer.evaluate()
                    if not math.isfinite(trainer.last_eval):
                        raise NonFiniteError(f"step {trainer.step}: the validation loss is {trainer.last_eval}; "
                                             f"{_kept(trainer)}")
                    stop = any([cb.on_eval_end(trainer, trainer.last_eval) for cb in callbacks])
                if save_now or interrupted:
                    _save(trainer, callbacks)
                if interrupted:
                    raise TrainingInterrupted(interrupted, trainer.step, trainer.last_checkpoint)
            if unread:
                row = _read_checked(trainer, unread)
            # a stop asked for during the last steps' evaluation (or after the last check): honoured, not
            # swallowed; the run's end is saved below as usual, and nothing after it (samples) runs
            late_stop = _interrupt_signal(trainer, signals, True)
        finally:
            for cb in callbacks:
                cb.on_fit_end(trainer)
    _save(trainer, callbacks)
    if late_stop:
        raise TrainingInterrupted(late_stop, trainer.step, trainer.last_checkpoint)
    return {"step": trainer.step, "samples": trainer.samples, "train_loss": row.get("loss"),
            "eval_loss": trainer.last_eval}


def _save(trainer, callbacks) -> None:
    path = trainer.save()
    for cb in callbacks:
        cb.on_checkpoint(trainer, path)


def _read_checked(trainer, unread: list[StepResult]) -> dict:
    """Read the unread steps (one synchronisation); stop at the first non-finite one."""
    rows = read_results(unread)
    bad = first_non_finite(unread, rows)
    if bad:
        raise NonFiniteError(f"{bad}{f' (rank {trainer.rank})' if trainer.world > 1 else ''}; {_kept(trainer)}")
    unread.clear()
    return rows[-1]


def _kept(trainer) -> str:
    if trainer.last_checkpoint is None:
        return "no checkpoint was written"
    return f"the last good checkpoint, {trainer.last_checkpoint}, is kept"


def _interrupt_signal(trainer, signals: SignalFlag, at_log_step: bool) -> int | None:
    """The signal that asks the run to stop, agreed by all ranks. Alone: checked every step
    (a host flag); with several ranks only at log steps, where the host syncs anyway."""
    if trainer.world == 1:
        return signals.signum
    if not at_log_step:
        return None
    flag = torch.tensor(signals.signum or 0, device=trainer.device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) or None
