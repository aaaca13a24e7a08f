"""FusedMXFP6MLP: fc1 → GELU(tanh) → fc2 as one autograd Function, with per-module fallback."""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from .functional import fused_mx_mlp
from .linear import MXFP6Linear, _as_2d

__all__ = ["FusedMXFP6MLP", "FUSED_MLP_MODES", "FUSED_MLP_ENV", "resolve_fused_mode"]

FUSED_MLP_MODES = ("auto", "on", "off")
FUSED_MLP_ENV = "MXFLUX_FUSED_MLP"
FUSED_ACTIVATION = "gelu_tanh"
_ACTIVATIONS = {
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu": nn.functional.gelu,
    "silu": nn.functional.silu,
    "relu": nn.functional.relu,
}


def resolve_fused_mode(mode: str, environ=os.environ) -> str:
    """The argument, unless MXFLUX_FUSED_MLP overrides it (for A/B runs from the shell)."""
    mode = environ.get(FUSED_MLP_ENV, mode)
    if mode not in FUSED_MLP_MODES:
        raise ValueError(f"fused_mlp mode: expected one of {FUSED_MLP_MODES}, got {mode!r} "
                         f"(argument or ${FUSED_MLP_ENV})")
    return mode


def activation_name(module: nn.Module) -> str | None:
    """Name of a recognised activation module, or None."""
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if isinstance(module, nn.SiLU):
        return "silu"
    if isinstance(module, nn.ReLU):
        return "relu"
    return None


class FusedMXFP6MLP(nn.Module):
    """fc1 → activation → fc2 with MXFP6 linears; fused into one Function for GELU(tanh).

    `child_names` lets the module keep a checkpoint's key layout: the Flux MLP is an
    nn.Sequential whose linears are "0" and "2", so the policy builds this module with
    child_names=("0", "2") and state dicts load unchanged.

    mode: "on" requires the fused path and raises if this module cannot take it; "auto" falls
    back to the unfused MXFP6 path with one warning; "off" always runs unfused. The
    MXFLUX_FUSED_MLP environment variable overrides the argument.
    """

    def __init__(self, dim: int, hidden: int, *, bias: bool = True, mode: str = "auto",
                 activation: str = FUSED_ACTIVATION, mx_gemm: str = "rowwise", hadamard: bool = True,
                 child_names: tuple[str, str] = ("fc1", "fc2"), device=None, dtype=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        for n, d in (("dim", dim), ("hidden", hidden)):
            if d % 32:
                raise ValueError(f"{n}: {d} is not a multiple of 32, so these linears cannot run in MXFP6")
        kw = dict(bias=bias, device=device, dtype=dtype, mx_gemm=mx_gemm, hadamard=hadamard)
        self._names = tuple(child_names)
        self.add_module(self._names[0], MXFP6Linear(dim, hidden, **kw))
        self.add_module(self._names[1], MXFP6Linear(hidden, dim, **kw))
        self._finish(mode, activation)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, *, activation: str, mode: str = "auto",
                     mx_gemm: str = "rowwise", hadamard: bool = True,
                     child_names: tuple[str, str] = ("fc1", "fc2")) -> "FusedMXFP6MLP":
        """Build around existing linears, keeping their Parameters."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc2: in_features {fc2.in_features} != fc1.out_features {fc1.out_features}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._names = tuple(child_names)
        for name, lin in zip(new._names, (fc1, fc2)):
            new.add_module(name, MXFP6Linear.from_linear(lin, mx_gemm=mx_gemm, hadamard=hadamard))
        new._finish(mode, activation)
        return new

    def _finish(self, mode: str, activation: str) -> None:
        self.activation = activation
        self.mode = resolve_fused_mode(mode)
        reason = self.fallback_reason()
        if self.mode == "off":
            self.fused = False
        elif reason is None:
            self.fused = True
        elif self.mode == "on":
            raise ValueError(f"FusedMXFP6MLP: fused_mlp mode is 'on' but this MLP cannot be fused: {reason}")
        else:
            warnings.warn(f"FusedMXFP6MLP: falling back to the unfused MXFP6 MLP: {reason}", stacklevel=3)
            self.fused = False

    def fallback_reason(self) -> str | None:
        if self.activation != FUSED_ACTIVATION:
            return f"activation {self.activation!r} is not tanh GELU, which the fused prologue computes"
        if self.fc1.cfg != self.fc2.cfg:
            return "fc1 and fc2 use different MX settings"
        return None

    def _child(self, i: int) -> MXFP6Linear:
        try:
            return self._modules[self._names[i]]
        except KeyError:  # during construction; AttributeError keeps hasattr() working
            raise AttributeError(f"fc{i + 1}") from None

    @property
    def fc1(self) -> MXFP6Linear:
        return self._child(0)

    @property
    def fc2(self) -> MXFP6Linear:
        return self._child(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.fc2(_ACTIVATIONS[self.activation](self.fc1(x)))
        x2, lead = _as_2d(x)
        x2, w1, b1 = self.fc1._compute_params(x2)
        _, w2, b2 = self.fc2._compute_params(x2)
        y = fused_mx_mlp(x2, w1, b1, w2, b2, self.fc1.fold_outside_window, self.fc1.cfg)
        return y.reshape(*lead, self.fc2.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"activation={self.activation}, mode={self.mode}, fused={self.fused}"

