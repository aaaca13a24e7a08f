"""AdamW for a training loop of one's own: what the trainer's optimizer step does for MXFP6 weights,
in one call (as torchao's `precompute_float8_dynamic_scale_for_fsdp` gives a loop FP8's).

    apply_precision(model, "mxfp6")        # MXFP6Linear layers, the model on its device
    optimizer = mxflux.optim.AdamW(model, lr=1e-4, weight_decay=0.01, max_grad_norm=1.0)
    for batch in batches:
        loss = loss_of(model, batch)
        optimizer.release_weight_rows()    # optional: 1 byte per MX weight element less at the peak
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

Why. With `torch.optim.AdamW` each forward packs every MXFP6 weight from its fp32 values: a pass
that finds each row's and column's e_ref, then one that writes the FP8 operands, over every weight,
every step. The trainer's step (`mxflux.train.optimizer.ClippingAdamW`, Triton kernel on CUDA)
computes the updated weights' e_ref and operands while it writes the weights, so forward and
backward read them as they are (`mxflux.nn.MXWeightState`; docs/design.md, "The weights' operands
from the optimizer step"), and it applies gradient clipping in the same pass
(`mxflux.train.clipping`). This class is that step for any module with MXFP6 layers: torch's AdamW
(its state, parameter groups, state_dict and learning-rate schedulers as they are) whose `step()`
also clips (`max_grad_norm`) and writes the weights' state.

Where the Triton step does not run (the CPU, non-fp32 or non-contiguous parameters) the step is
torch's fused AdamW, clipping by its `grad_scale`, and the layers pack their weights themselves:
the same training, without the saving. Kept operands cost 2 bytes per MX weight element
(`keep_operands=False`: the e_ref alone, a few words per row and column; `keep_cols=False`: the row
operands alone, 1 byte, and each backward packs Wᵀ from the weight).

`release_weight_rows()`, called between a forward and its backward, frees the kept operands' row halves
(1 byte per weight element) until the step writes them again: backward does not read them. Call it after
the last forward before a step only (a forward in between packs the weights again), and not where
something reads them at fixed addresses or runs forward again in backward (CUDA graphs, full activation
checkpointing).

A compiled model reads the kept state unchecked; it is brought up to date by a forward pre-hook on
`model`, so compile its blocks (`block.compile()`), not `model` as a whole, or call
`refresh_weight_state()` before each forward of a model compiled whole.
"""

from __future__ import annotations

import torch
from torch import nn

from .nn.weight_state import MXWeightState
from .train import adamw_cuda
from .train.clipping import clip_and_step
from .train.optimizer import ClippingAdamW

__all__ = ["AdamW"]


class AdamW(ClippingAdamW):
    """torch's AdamW over `model`'s trained parameters (`requires_grad`) whose step writes the MXFP6
    weights' e_ref (and, with `keep_operands`, their operands: Wᵀ too with `keep_cols`) for the next
    forward, and clips the gradients to total 2-norm `max_grad_norm` (None: no clipping) in the same
    pass; the norm before clipping is `last_grad_norm` (a device scalar; None without clipping)."""

    def __init__(self, model: nn.Module, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, max_grad_norm: float | None = None,
                 keep_operands: bool = True, keep_cols: bool = True):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        for name, value in (("keep_operands", keep_operands), ("keep_cols", keep_cols)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: expected True or False, got {value!r}")
        trained = [p for p in model.parameters() if p.requires_grad]
        if not trained:
            raise ValueError("model: no parameter requires a gradient, nothing to optimize")
        super().__init__(trained, kernel="triton", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         fused=True)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        state = MXWeightState.of_model(model, keep_operands=keep_operands, keep_cols=keep_cols,
                                       min_elements=adamw_cuda.LARGE)
        if state.of:  # MXFP6 weights the Triton step can update (on CUDA, fp32, contiguous)
            self.weight_state = state
            state.install(model)
        self.releases_rows = True  # in a loop of one's own, calling release_weight_rows is the choice
        self._one: torch.Tensor | None = None
        self._clipping = False

    @torch.no_grad()
    def step(self, closure=None, *, grad_factor: torch.Tensor | None = None):
        """Clip (with `max_grad_norm`) and take the step; `grad_factor` as `ClippingAdamW.step`."""
        if grad_factor is not None or self._clipping:  # clip_and_step's own call: its factor, or clipped already
            return super().step(closure, grad_factor=grad_factor)
        if closure is not None:
            raise ValueError("step: no closure (the gradients are those of the last backward)")
        params = [p for g in self.param_groups for p in g["params"]]
        if self.max_grad_norm is not None:
            self._clipping = True
            try:
                self.last_grad_norm = clip_and_step(self, params, self.max_grad_norm)
            finally:
                self._clipping = False
            return None
        with_grads = [p for p in params if p.grad is not None]
        if with_grads and adamw_cuda.eligible(self, with_grads):
            # the Triton step, which writes the weights' state, takes its factor in its pass: 1, exact
            if self._one is None or self._one.device != with_grads[0].device:
                self._one = torch.ones((), device=with_grads[0].device)
            return super().step(grad_factor=self._one)
        return super().step()
