"""Gradient clipping by total 2-norm, then the optimizer step: `clip_and_step`.

`torch.nn.utils.clip_grad_norm_` multiplies every gradient by min(1, max_norm / (norm + 1e-6)) in
a pass of its own, every step (the factor stays on the device, so it cannot skip the pass when it
is 1): a read and a write of all gradients in fp32, 8.3 ms of a 3.8 B-parameter model's step on
the H200 (benchmarks/RESULTS.md). The optimizer reads every gradient anyway, so
`ClippingAdamW.step(grad_factor=...)` applies the same factor in its own pass (`train.optimizer`
says which kernel does it).

The norm, which the metrics log, is torch's computation. The update equals torch's clip-then-step
up to fp32 rounding where a factor below 1 clips, and exactly where it does not (a factor of 1)
when torch's fused kernel applies it. Sharded (FSDP2) gradients fold into the step where the Triton
kernels take it (they update each rank's shards; the norm is of all shards, as torch's); elsewhere
they, other optimizers and `optim.clip_in_optimizer: false` take torch's separate pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import adamw_cuda
from .optimizer import ClippingAdamW

__all__ = ["clip_and_step"]

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def clip_and_step(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], max_norm: float, *,
                  in_optimizer: bool = True) -> torch.Tensor:
    """Clip the gradients of `params` to total 2-norm `max_norm` and take `optimizer`'s step;
    returns the norm before clipping (for FSDP2 gathered to a plain tensor), on the device, without
    synchronising. `in_optimizer=False` always uses torch's `clip_grad_norm_` pass."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    folds = in_optimizer and grads and isinstance(optimizer, ClippingAdamW)
    if folds and not all(type(g) is torch.Tensor for g in grads):
        # sharded gradients: only the Triton step takes the factor (torch's kernels would mix the
        # plain factor with DTensors)
        with_grads = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        folds = (optimizer.kernel == "triton" and all(isinstance(g, DTensor) for g in grads)
                 and adamw_cuda.eligible(optimizer, with_grads))
    if not folds:
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norm = nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
    if isinstance(norm, DTensor):  # of every rank's shards: one all-reduce, no host synchronisation
        norm = norm.full_tensor()
    optimizer.step(grad_factor=torch.clamp(max_norm / (norm + _EPS), max=1.0))  # torch's factor, as torch computes it
    return norm
