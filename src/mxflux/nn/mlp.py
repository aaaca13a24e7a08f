"""FusedMXFP6MLP: fc1 → GELU(tanh) → fc2 in MXFP6, run as one autograd Function where it can be."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..mx import FoldGranularity
from .functional import fused_mx_mlp
from .linear import MXFP6Linear, as_2d, output_dtype

__all__ = ["FUSED_ACTIVATION", "FUSED_MLP_MODES", "FusedMXFP6MLP", "activation_module", "activation_name",
           "linears_with_own_forward"]

FUSED_MLP_MODES = ("auto", "on", "off")
FUSED_ACTIVATION = "gelu_tanh"  # the one activation the packer's prologue computes
_ACTIVATIONS = {
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "relu": nn.ReLU,
}


def activation_name(module: nn.Module) -> str | None:
    """Name of a recognised activation module, or None."""
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if isinstance(module, nn.SiLU):
        return "silu"
    if isinstance(module, nn.ReLU):
        return "relu"
    return None


def activation_module(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]()


class FusedMXFP6MLP(nn.Sequential):
    """nn.Sequential(MXFP6Linear, activation, MXFP6Linear) whose forward is one autograd Function.

    Being the Sequential it replaces, it keeps that module's state-dict keys ("0.weight",
    "2.bias", ...) and indexing, so checkpoints and code written for the bf16 MLP work unchanged.
    Fused, the activation exists only inside the MX packer: fc1's output h is kept (as GELU's
    backward needs it) and the activation is written straight out as FP8 operands, saving one
    bf16 write and read of the hidden activation per pass (docs/design.md, "Fusions").

    mode: "on" requires the fused path and raises if this MLP cannot take it; "auto" falls back
    to the unfused MXFP6 path with one warning; "off" always runs unfused.
    """

    def __init__(self, dim: int, hidden: int, *, bias: bool = True, mode: str = "auto",
                 activation: str = FUSED_ACTIVATION, mx_gemm: str = "rowwise", hadamard: bool = True,
                 saved_operands: str = "e4m3", repack_weights: bool = False, device=None, dtype=None):
        kw = dict(bias=bias, device=device, dtype=dtype, mx_gemm=mx_gemm, hadamard=hadamard,
                  saved_operands=saved_operands, repack_weights=repack_weights)
        super().__init__(MXFP6Linear(dim, hidden, **kw), activation_module(activation),
                         MXFP6Linear(hidden, dim, **kw))
        self._choose_path(mode)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, *, activation: str, mode: str = "auto",
                     mx_gemm: str = "rowwise", hadamard: bool = True,
                     saved_operands: str = "e4m3", repack_weights: bool = False) -> "FusedMXFP6MLP":
        """Build around existing linears, keeping their Parameters (no copy)."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc2: in_features {fc2.in_features} != fc1.out_features {fc1.out_features}")
        new = cls.__new__(cls)
        mx = dict(mx_gemm=mx_gemm, hadamard=hadamard, saved_operands=saved_operands, repack_weights=repack_weights)
        nn.Sequential.__init__(new, MXFP6Linear.from_linear(fc1, **mx), activation_module(activation),
                               MXFP6Linear.from_linear(fc2, **mx))
        new._choose_path(mode)
        return new

    def _choose_path(self, mode: str) -> None:
        if mode not in FUSED_MLP_MODES:
            raise ValueError(f"fused_mlp mode: expected one of {FUSED_MLP_MODES}, got {mode!r}")
        self.mode = mode
        reason = self.fallback_reason()
        if mode == "off":
            self.fused = False
        elif reason is None:
            self.fused = True
        elif mode == "on":
            raise ValueError(f"FusedMXFP6MLP: fused_mlp mode is 'on' but this MLP cannot be fused: {reason}")
        else:
            warnings.warn(f"FusedMXFP6MLP: falling back to the unfused MXFP6 MLP: {reason}", stacklevel=3)
            self.fused = False

    @property
    def activation(self) -> str:
        return activation_name(self[1])

    @property
    def fc1(self) -> MXFP6Linear:
        return self[0]

    @property
    def fc2(self) -> MXFP6Linear:
        return self[2]

    def fallback_reason(self) -> str | None:
        """Why this MLP cannot take the fused path, or None if it can."""
        if self.activation != FUSED_ACTIVATION:
            return f"activation {self.activation!r} is not tanh GELU, which the fused prologue computes"
        if self.fc1.cfg != self.fc2.cfg:
            return "fc1 and fc2 use different MX settings"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().forward(x)
        x2, lead = as_2d(x)
        x2, w1, b1 = self.fc1.compute_params(x2)
        _, w2, b2 = self.fc2.compute_params(x2)
        erefs = (self.fc1.kept_weight_state()[0], self.fc2.kept_weight_state()[0])
        y = fused_mx_mlp(x2, w1, b1, w2, b2, self.fc1.blocks_outside_window, self.fc1.cfg, erefs)
        return y.reshape(*lead, self.fc2.out_features).to(output_dtype(x))

    def extra_repr(self) -> str:
        return f"mode={self.mode}, fused={self.fused}"


def linears_with_own_forward(model: nn.Module) -> list[MXFP6Linear]:
    """The row-granularity MXFP6Linear modules of `model` that run their own forward, that is all but
    the fc1 / fc2 of a FusedMXFP6MLP (whose Function packs their weights): those that can take their
    weight's operands from the optimizer step (`mxflux.nn.weight_state`)."""
    inside_fused = {id(m) for f in model.modules() if isinstance(f, FusedMXFP6MLP) for m in f.modules()}
    return [m for m in model.modules() if isinstance(m, MXFP6Linear) and id(m) not in inside_fused
            and m.cfg.granularity is FoldGranularity.ROWWISE]
