"""What one optimizer step produced, kept on the device until the loop reads it.

Reading a device value on the host waits for the device to finish everything queued before
it; a training step that never does so lets the host run ahead and keep the device fed
(docs/design.md, "The trainer"). `read_results` reads any number of steps with one wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["StepResult", "read_results", "first_non_finite"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced, still on the device."""

    step: int  # optimizer steps taken, this one included
    samples: int  # training samples consumed (global), this step's included
    loss: torch.Tensor  # fp64 scalar: the step's mean loss over micro-batches and ranks
    grad_norm: torch.Tensor  # scalar: the total gradient norm before clipping
    lr: float  # the learning rate this step used
    blocks_outside_window: torch.Tensor | None  # int64 scalar, cumulative over the run; None without MX
    sample_indices: tuple[torch.Tensor, ...]  # this rank's dataset indices, per micro-batch

    def read(self) -> dict[str, float]:
        """The values as Python numbers (one host-device synchronisation)."""
        return read_results([self])[0]


def read_results(results: list[StepResult]) -> list[dict[str, float]]:
    """`StepResult.read()` of many steps with one synchronisation for all of them."""
    if not results:
        return []
    values = [t for r in results for t in (r.loss, r.grad_norm.double())]
    window = results[-1].blocks_outside_window
    host = torch.stack(values + ([window.double()] if window is not None else [])).tolist()
    rows = [{"loss": host[2 * i], "grad_norm": host[2 * i + 1], "lr": r.lr} for i, r in enumerate(results)]
    if window is not None:  # cumulative: the last step's count is the one that matters
        rows[-1]["blocks_outside_window"] = int(host[-1])
    return rows


def first_non_finite(steps: list[StepResult], rows: list[dict]) -> str | None:
    """A message naming the first step whose loss or gradient norm is not finite, with its
    training samples; None when all are finite. `rows`: `read_results(steps)`."""
    for r, values in zip(steps, rows):
        bad = [f"{name} {values[key]}" for key, name in (("loss", "loss"), ("grad_norm", "gradient norm"))
               if not math.isfinite(values[key])]
        if bad:
            idx = torch.cat(r.sample_indices).tolist()
            shown = ", ".join(map(str, idx[:64])) + (", ..." if len(idx) > 64 else "")
            return (f"step {r.step}: non-finite {' and '.join(bad)}; the step's training samples "
                    f"(dataset indices): {shown}")
    return None
