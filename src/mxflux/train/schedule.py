"""The learning-rate schedule: a linear warm-up, then constant (MLPerf) or a decay to the run's end."""

from __future__ import annotations

import math

__all__ = ["lr_factor"]


def lr_factor(warmup_steps: int, decay: str, decay_steps: int | None, min_ratio: float, total: int,
              step: int) -> float:
    """The LR factor of optimizer step `step` (0-based) of a `total`-step run.

    A linear warm-up over `warmup_steps` (factor (step + 1) / warmup_steps), then 1: with
    `decay` "none" that is all (MLPerf reference). With "cosine" or "linear" the factor falls over
    the last `decay_steps` steps (None: all steps after the warm-up), from 1 at their first step
    towards `min_ratio` at step `total` (the one after the last), so no step takes a zero LR;
    it multiplies the warm-up factor where the two overlap.
    """
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if decay == "none":
        return warm
    span = decay_steps if decay_steps is not None else max(total - warmup_steps, 1)
    start = total - span
    progress = min(max((step - start) / span, 0.0), 1.0)
    fall = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return warm * (min_ratio + (1 - min_ratio) * fall)
