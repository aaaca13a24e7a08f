"""The trainer's optimizer: torch's AdamW whose step can multiply the gradients by a device scalar
in its own pass over them (`step(grad_factor=...)`), which is how gradient clipping costs no pass
of its own (`train.clipping`).

Which kernel applies the factor:
- `kernel="triton"` (what `optim.implementation: auto` builds on CUDA): `adamw_cuda`'s kernel for
  every fp32 CUDA parameter of at least `adamw_cuda.LARGE` elements (reads the gradient once,
  writes nothing but parameter and moments), torch's fused kernel for the small rest;
- a fused AdamW otherwise: torch's fused kernel with the factor as its `grad_scale` (it divides by
  1/factor in fp64, and writes the divided gradients back);
- foreach or per-parameter: torch's `_foreach_mul_` on the gradients, then the step.

The Triton step also computes, for the MX weights whose state is attached (`weight_state`, an
`mxflux.nn.MXWeightState`), the row-granularity e_ref the packer would otherwise find in a first
pass over each weight at the next forward, and the operands of those it keeps.

State, parameter groups and state_dict are torch's AdamW's whichever runs, so a checkpoint does not
record the kernel.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..nn.weight_state import MXWeightState
from . import adamw_cuda

__all__ = ["STEP_KERNELS", "ClippingAdamW"]


# What `ClippingAdamW.last_step` says, by the path the step took.
STEP_KERNELS = {
    "triton": "our Triton AdamW, the clipping factor applied in its pass",
    "triton_shards": "our Triton AdamW on each rank's shards, the clipping factor applied in its pass",
    "fused_grad_scale": "torch's fused AdamW, the clipping factor as its grad_scale (the gradients written back)",
    "foreach_mul": "torch's AdamW after a multiply of every gradient by the clipping factor",
    "plain": "torch's AdamW (the gradients clipped before it, if at all, by clip_grad_norm_'s own pass)",
}


class ClippingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with `step(grad_factor=t)`; `kernel` is "triton" or "torch"."""

    def __init__(self, params, *, kernel: str = "torch", **kw):
        if kernel not in ("triton", "torch"):
            raise ValueError(f"kernel: expected 'triton' or 'torch', got {kernel!r}")
        super().__init__(params, **kw)
        self.kernel = kernel
        self.lr_scalars: dict[int, torch.Tensor] = {}  # the Triton step's learning rates on the device
        # The MX weights' state the Triton step writes as it updates them (`build_optimizer` attaches it).
        self.weight_state: MXWeightState | None = None
        # Which kernel took the last step (`STEP_KERNELS`), for the run's report of its step path.
        self.last_step: str | None = None
        # Whether `release_weight_rows` frees anything: set by the owner, who knows that nothing reads
        # the row operands between a forward and the step (`train.build.rows_release_off`).
        self.releases_rows = False

    def release_weight_rows(self) -> int:
        """Between the last micro-batch's forward and its backward: free the kept weights' row operands
        until this optimizer's step writes them again (`MXWeightState.release_rows`), where the owner
        allows it; the bytes freed."""
        if self.weight_state is None or not self.releases_rows:
            return 0
        return self.weight_state.release_rows()

    def refresh_weight_state(self) -> None:
        """Bring the attached MX weights' state up to date (a captured step before each replay: the
        graph's forward reads it unchecked)."""
        if self.weight_state is not None:
            self.weight_state.refresh()

    @torch.no_grad()
    def step(self, closure=None, *, grad_factor: torch.Tensor | None = None):
        """torch's AdamW step; with `grad_factor` (a device scalar) every gradient is first
        multiplied by it, by the kernel the module docstring names."""
        if grad_factor is None:
            self.last_step = "plain"
            return super().step(closure)
        if closure is not None:
            raise ValueError("step: a closure re-evaluates the gradients, which grad_factor would then miss")
        with_grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.kernel == "triton" and adamw_cuda.eligible(self, with_grads):
            adamw_cuda.adamw_clipped_step(self, grad_factor, self.lr_scalars, self.weight_state)
            self.last_step = "triton_shards" if any(isinstance(p, DTensor) for p in with_grads) else "triton"
        elif all(g.get("fused") for g in self.param_groups):
            self.grad_scale = grad_factor.reciprocal()
            try:
                super().step()
            finally:
                del self.grad_scale
            self.last_step = "fused_grad_scale"
        else:
            torch._foreach_mul_([p.grad for p in with_grads], grad_factor)
            super().step()
            self.last_step = "foreach_mul"
        return None
