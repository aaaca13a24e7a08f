"""Drop-in nn.Linear replacement: MXFP6Linear (same parameters, same state dict)."""

from __future__ import annotations

import torch
from torch import nn

from ..mx.granularity import FoldGranularity
from .functional import MXConfig, mx_linear

__all__ = ["MXFP6Linear", "mx_ineligibility"]


def mx_ineligibility(in_features: int, out_features: int, mx_gemm: str = "rowwise") -> str | None:
    """Why a linear of this shape cannot run in MXFP6 with this GEMM mode, or None if it can.

    K is the fprop contraction axis and N the dgrad one, so both must hold whole 32-blocks (whole
    128-groups in block-wise mode); the token axis (wgrad's contraction) is zero-padded, which
    is exact.
    """
    multiple = FoldGranularity.from_mx_gemm(mx_gemm).row_multiple
    bad = [f"{n}={v}" for n, v in (("in_features", in_features), ("out_features", out_features))
           if v % multiple]
    return f"{' and '.join(bad)} not a multiple of {multiple}" if bad else None


def _as_2d(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class _QuantizedLinear(nn.Linear):
    """Common plumbing: bf16 compute, any leading dims, `from_linear` that keeps the parameters."""

    _ineligibility = staticmethod(mx_ineligibility)

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        reason = self._ineligibility(in_features, out_features)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "_QuantizedLinear":
        """A quantized linear sharing `linear`'s weight and bias Parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        reason = cls._ineligibility(linear.in_features, linear.out_features)
        if reason:
            raise ValueError(f"{cls.__name__}: {reason}")
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._setup(**kwargs)
        return new

    def _setup(self, **kwargs) -> None:
        pass

    def _compute_params(self, x: torch.Tensor):
        # bf16 compute: fp32 master weights are cast here, differentiably.
        w = self.weight.to(torch.bfloat16)
        b = None if self.bias is None else self.bias.to(torch.bfloat16)
        return x.to(torch.bfloat16), w, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: input's last dimension is {x.shape[-1]}, expected {self.in_features}"
            )
        x2, lead = _as_2d(x)
        y = self._linear(*self._compute_params(x2))
        return y.reshape(*lead, self.out_features).to(x.dtype)


class MXFP6Linear(_QuantizedLinear):
    """nn.Linear whose three GEMMs run in MXFP6 (E2M3, E8M0 per 32, Hadamard-rotated)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 mx_gemm: str = "rowwise", hadamard: bool = True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(mx_gemm=mx_gemm, hadamard=hadamard)

    def _setup(self, mx_gemm: str = "rowwise", hadamard: bool = True) -> None:
        FoldGranularity.from_mx_gemm(mx_gemm)  # validates the mode
        reason = mx_ineligibility(self.in_features, self.out_features, mx_gemm)
        if reason:
            raise ValueError(f"MXFP6Linear with mx_gemm={mx_gemm!r}: {reason}")
        self.cfg = MXConfig(mx_gemm, bool(hadamard))
        # Device-side count of blocks that fell outside the FP8 fold window (docs/design.md, "The exact FP8 fold and its window").
        self.register_buffer("fold_outside_window", torch.zeros(1, dtype=torch.int64,
                                                                device=self.weight.device),
                             persistent=False)

    def _linear(self, x, w, b):
        return mx_linear(x, w, b, self.fold_outside_window, self.cfg)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mx_gemm={self.cfg.mx_gemm}, hadamard={self.cfg.hadamard}"
