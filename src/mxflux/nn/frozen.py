"""A frozen base for adapters: MXFP6 linears kept only as their fprop operand, everything else bf16.

`freeze_base(model)` turns a converted model (after `apply_precision` and any weight load) into the
base a LoRA run trains adapters on (docs/design.md, "LoRA on a frozen MXFP6 base"):

- every MXFP6Linear becomes a `FrozenMXFP6Linear` holding its weight's row operand (E4M3 bytes
  [N, K] and the fold's scale), 1 byte per weight element, and no weight: no fp32 master, no bf16
  copy, no Wᵀ operand. Its forward multiplies those bytes; its backward computes dX only, with Wᵀ's
  operand made from the same bytes (the same values, re-scaled per column);
- a fused MLP becomes the plain Sequential of its two linears (the fused Function multiplies the
  weight parameters themselves), so each linear can carry an adapter;
- every other parameter (embedders, modulation, norms, bf16 linears) is cast to the compute dtype and
  frozen: a frozen tensor needs no fp32 master, and at flux-12b's size the modulation linears alone
  would otherwise keep 13 GB of fp32.

The frozen tensors are buffers that checkpoints do not store (`persistent=False`): a run rebuilds its
base from the recipe (`model.init_from`), the same bytes every time (the packer is
deterministic), and `base_fingerprint` lets a resume check that it did.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ..mx.operands import transposed_column_scale
from ..ops import mx_operands
from .functional import MXConfig, frozen_mx_linear
from .linear import MXFP6Linear, as_2d, output_dtype
from .mlp import FusedMXFP6MLP

__all__ = ["FrozenMXFP6Linear", "base_fingerprint", "freeze_base"]


class FrozenMXFP6Linear(nn.Module):
    """A linear with a frozen weight kept as its MXFP6 fprop operand (row data E4M3 [N, K], row scale)
    and a frozen bias; Y = X·Wᵀ + b with X quantized along K, dX = dY·W with dY quantized along N
    (W's operand for dgrad made from the same bytes in each backward, exactly)."""

    def __init__(self, in_features: int, out_features: int, w_data: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, cfg: MXConfig):
        super().__init__()
        self.in_features, self.out_features, self.cfg = in_features, out_features, cfg
        self.register_buffer("w_data", w_data, persistent=False)
        self.register_buffer("w_scale", w_scale, persistent=False)
        # fp32 [K]: what dgrad's transposition of these bytes divides each column by, found once here
        # rather than by a reduction over the weight in every backward (4 bytes per input feature)
        self.register_buffer("w_column_scale", transposed_column_scale(w_data, w_scale), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("blocks_outside_window", torch.zeros(1, dtype=torch.int64, device=w_data.device),
                             persistent=False)

    @classmethod
    @torch.no_grad()
    def from_mx_linear(cls, linear: MXFP6Linear, bias_dtype: torch.dtype) -> "FrozenMXFP6Linear":
        """The frozen form of `linear`'s current weight (packed once, as its forward would pack it)."""
        cfg = linear.cfg._replace(saved_operands="e4m3", repack_weights=False)
        counter = torch.zeros(1, dtype=torch.int64, device=linear.weight.device)
        w = linear.weight.detach()
        rd, rs = mx_operands(w if w.dtype in (torch.float32, torch.bfloat16) else w.to(torch.bfloat16), None,
                             counter, True, False, cfg.granularity.value, cfg.hadamard, "none", False)[:2]
        bias = None if linear.bias is None else linear.bias.detach().to(bias_dtype)
        return cls(linear.in_features, linear.out_features, rd, rs, bias, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"FrozenMXFP6Linear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        x2, lead = as_2d(x)
        y = frozen_mx_linear(x2.to(torch.bfloat16), self.w_data, self.w_scale, self.w_column_scale, self.bias,
                             self.blocks_outside_window, self.cfg)
        return y.reshape(*lead, self.out_features).to(output_dtype(x))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mx_gemm={self.cfg.mx_gemm}, hadamard={self.cfg.hadamard}, frozen")


def _unfused(mlp: FusedMXFP6MLP) -> nn.Sequential:
    return nn.Sequential(*mlp)  # the same children under the same names ("0", "1", "2")


@torch.no_grad()
def freeze_base(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Freeze every parameter of `model` in place: MXFP6Linear modules become FrozenMXFP6Linear (the
    weight kept as its fprop operand only), fused MLPs their plain Sequential, and every other
    floating-point parameter is cast to `dtype` with requires_grad off. Returns the names of the
    frozen MX linears. Call after the base's weights are loaded and before adapters are added."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMXFP6MLP):
            _replace(model, name, _unfused(module))
    frozen = []
    for name, module in list(model.named_modules()):
        if isinstance(module, MXFP6Linear):
            _replace(model, name, FrozenMXFP6Linear.from_mx_linear(module, dtype))
            frozen.append(name)
    for p in model.parameters():
        p.requires_grad_(False)
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return frozen


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@torch.no_grad()
def base_fingerprint(model: nn.Module) -> str:
    """A digest of every frozen tensor of `model` (the MX operands, biases and frozen parameters), by
    name: what a resumed LoRA run compares to be sure it rebuilt the base it trained on. Reads each
    tensor once (a device-to-host copy of the bytes)."""
    digest = hashlib.sha256()
    tensors = [(n, b) for n, b in model.named_buffers() if n.endswith(("w_data", "w_scale", ".bias"))]
    tensors += [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    for name, t in sorted(tensors, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
