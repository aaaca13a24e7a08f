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

The Triton step also computes, for the MX weights it is told about (`track_weight_erefs`), the
row-granularity e_ref the packer would otherwise find in a first pass over each weight at the next
forward (`mxflux.kernels.weight_erefs`).

State, parameter groups and state_dict are torch's AdamW's whichever runs, so a checkpoint does not
record the kernel.
"""

from __future__ import annotations

import torch

from . import adamw_cuda

__all__ = ["ClippingAdamW"]


class ClippingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with `step(grad_factor=t)`; `kernel` is "triton" or "torch"."""

    def __init__(self, params, *, kernel: str = "torch", **kw):
        if kernel not in ("triton", "torch"):
            raise ValueError(f"kernel: expected 'triton' or 'torch', got {kernel!r}")
        super().__init__(params, **kw)
        self.kernel = kernel
        self.lr_scalars: dict[int, torch.Tensor] = {}  # the Triton step's learning rates on the device
        self.weight_erefs: adamw_cuda.WeightErefs | None = None

    def track_weight_erefs(self, weights, linears=()) -> int:
        """Have the Triton step compute the row-granularity e_ref of these MX weights ((parameter,
        hadamard) pairs) as it updates them, so that the packer skips its first pass over them, and
        for the weights of `linears` (MXFP6Linear modules) their packed operands, which those layers
        then use as they are (`adamw_cuda.WeightErefs`). Returns how many weights qualify; none with
        the "torch" kernel. Whoever runs a compiled forward of those layers calls
        `refresh_weight_erefs` first (`build_optimizer` hooks it onto the model)."""
        if self.kernel != "triton":
            return 0
        self.weight_erefs = adamw_cuda.WeightErefs(weights, linears)
        return len(self.weight_erefs.of)

    def refresh_weight_erefs(self) -> None:
        """Recompute the e_ref (and kept operands) of tracked weights written by anything but this
        optimizer's step since (before every forward of the model; a captured step before each
        replay: the graph's forward reads them unchecked)."""
        if self.weight_erefs is not None:
            self.weight_erefs.refresh()

    @torch.no_grad()
    def step(self, closure=None, *, grad_factor: torch.Tensor | None = None):
        """torch's AdamW step; with `grad_factor` (a device scalar) every gradient is first
        multiplied by it, by the kernel the module docstring names."""
        if grad_factor is None:
            return super().step(closure)
        if closure is not None:
            raise ValueError("step: a closure re-evaluates the gradients, which grad_factor would then miss")
        with_grads = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.kernel == "triton" and adamw_cuda.eligible(self, with_grads):
            adamw_cuda.adamw_clipped_step(self, grad_factor, self.lr_scalars, self.weight_erefs)
        elif all(g.get("fused") for g in self.param_groups):
            self.grad_scale = grad_factor.reciprocal()
            try:
                super().step()
            finally:
                del self.grad_scale
        else:
            torch._foreach_mul_([p.grad for p in with_grads], grad_factor)
            super().step()
        return None
