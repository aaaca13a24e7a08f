"""The autograd Functions behind MXFP6Linear, FP8Linear and FusedMXFP6MLP.

Each GEMM quantizes both operands along its own contraction axis (DESIGN.md §3):

    fprop  Y  = X  · Wᵀ     A = X [M,K] along K        B = W [N,K] along K
    dgrad  dX = dY · W      A = dY [M,N] along N       B = Wᵀ [K,N] along N
    wgrad  dW = dYᵀ · X     A = dYᵀ [N,M] along M      B = Xᵀ [K,M] along M

so every tensor is packed once into both orientations ("row" = along its last axis, "col" =
the transposed copy along its first). Forward saves only the quantized col copies that
backward needs (Xᵀ, Wᵀ), never bf16 activations. The bias is added in the GEMM's fp32
epilogue and its gradient is the column sum the dY packer produces while it quantizes dY.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.custom_ops import fp8_pack, mx_pack, scaled_gemm
from ..ops.gemm_reference import GEMM_MODES

__all__ = ["MXConfig", "mx_linear", "fp8_linear", "fused_mx_mlp", "granularity_code"]


class MXConfig(NamedTuple):
    """Static settings of one MX module (hashable, so compile treats them as constants)."""

    mx_gemm: str = "rowwise"
    hadamard: bool = True


def granularity_code(mx_gemm: str) -> int:
    """Fold granularity for a GEMM mode as the custom op takes it (0 = one scale per row)."""
    try:
        g = GEMM_MODES[mx_gemm]
    except KeyError:
        raise ValueError(f"mx_gemm: expected one of {sorted(GEMM_MODES)}, got {mx_gemm!r}") from None
    return 0 if g == "row" else g


class Operand(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor


def _pack(x, cfg: MXConfig, counter, *, row=True, col=True, prologue="none", aux=None, colsum=False):
    rd, rs, cd, cs, sums = mx_pack(x, aux, counter, row, col, granularity_code(cfg.mx_gemm),
                                   cfg.hadamard, prologue, colsum)
    return Operand(rd, rs), Operand(cd, cs), sums


def _gemm(a: Operand, b: Operand, bias=None, out_dtype=torch.bfloat16):
    return scaled_gemm(a.data, a.scale, b.data, b.scale, bias, out_dtype)


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counter, cfg: MXConfig):
        x_row, x_col, _ = _pack(x, cfg, counter, col=weight.requires_grad)
        w_row, w_col, _ = _pack(weight, cfg, counter, col=x.requires_grad)
        y = _gemm(x_row, w_row, bias, x.dtype)
        ctx.save_for_backward(*x_col, *w_col)
        ctx.cfg, ctx.counter = cfg, counter
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        xc_data, xc_scale, wc_data, wc_scale = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        dy_row, dy_col, dbias = _pack(dy, ctx.cfg, ctx.counter, row=need_x, col=need_w,
                                      colsum=need_b and ctx.has_bias)
        dx = _gemm(dy_row, Operand(wc_data, wc_scale), None, dy.dtype) if need_x else None
        dw = _gemm(dy_col, Operand(xc_data, xc_scale), None, dy.dtype) if need_w else None
        db = dbias.to(dy.dtype) if need_b and ctx.has_bias else None
        return dx, dw, db, None, None


def mx_linear(x, weight, bias, counter, cfg: MXConfig):
    """Y = X·Wᵀ + b in MXFP6 for bf16 2-D `x`; `counter` collects blocks outside the fold window."""
    return _MXLinear.apply(x, weight, bias, counter, cfg)


class _FP8Linear(torch.autograd.Function):
    """The FP8 baseline ("hybrid"): E4M3 activations and weights, E5M2 gradients, row-wise scales."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        xr, xrs, xc, xcs, _ = fp8_pack(x, True, weight.requires_grad, "e4m3", False)
        wr, wrs, wc, wcs, _ = fp8_pack(weight, True, x.requires_grad, "e4m3", False)
        y = scaled_gemm(xr, xrs, wr, wrs, bias, x.dtype)
        ctx.save_for_backward(xc, xcs, wc, wcs)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, xcs, wc, wcs = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dyr, dyrs, dyc, dycs, dbias = fp8_pack(dy.contiguous(), need_x, need_w, "e5m2",
                                               need_b and ctx.has_bias)
        dx = scaled_gemm(dyr, dyrs, wc, wcs, None, dy.dtype) if need_x else None
        dw = scaled_gemm(dyc, dycs, xc, xcs, None, dy.dtype) if need_w else None
        db = dbias.to(dy.dtype) if need_b and ctx.has_bias else None
        return dx, dw, db


def fp8_linear(x, weight, bias):
    return _FP8Linear.apply(x, weight, bias)


class _FusedMXMLP(torch.autograd.Function):
    """fc1 → GELU(tanh) → fc2 as one Function (DESIGN.md §4).

    The activation exists only inside the packer: it is computed from the pre-activation h by
    the "gelu_tanh" prologue and written straight out as FP8 operands, never as a bf16 tensor.
    In backward the pre-activation gradient likewise exists only inside the "gelu_tanh_grad"
    prologue, whose column sums are fc1's bias gradient. h (the fc1 output, bias included by
    the GEMM epilogue) is kept, exactly as the unfused module's GELU keeps it.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, counter, cfg: MXConfig):
        x_row, x_col, _ = _pack(x, cfg, counter)
        w1_row, w1_col, _ = _pack(w1, cfg, counter)
        w2_row, w2_col, _ = _pack(w2, cfg, counter)
        h = _gemm(x_row, w1_row, b1, x.dtype)
        act_row, act_col, _ = _pack(h, cfg, counter, prologue="gelu_tanh")
        y = _gemm(act_row, w2_row, b2, x.dtype)
        ctx.save_for_backward(h, *x_col, *w1_col, *act_col, *w2_col)
        ctx.cfg, ctx.counter = cfg, counter
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        h, xcd, xcs, w1cd, w1cs, acd, acs, w2cd, w2cs = ctx.saved_tensors
        cfg, counter = ctx.cfg, ctx.counter
        dy = dy.contiguous()
        dy_row, dy_col, db2 = _pack(dy, cfg, counter, colsum=ctx.has_b2)
        dact = _gemm(dy_row, Operand(w2cd, w2cs), None, dy.dtype)
        dw2 = _gemm(dy_col, Operand(acd, acs), None, dy.dtype)
        dh_row, dh_col, db1 = _pack(dact, cfg, counter, prologue="gelu_tanh_grad", aux=h,
                                    colsum=ctx.has_b1)
        dx = _gemm(dh_row, Operand(w1cd, w1cs), None, dy.dtype)
        dw1 = _gemm(dh_col, Operand(xcd, xcs), None, dy.dtype)
        db1 = db1.to(dy.dtype) if ctx.has_b1 else None
        db2 = db2.to(dy.dtype) if ctx.has_b2 else None
        return dx, dw1, db1, dw2, db2, None, None


def fused_mx_mlp(x, w1, b1, w2, b2, counter, cfg: MXConfig):
    return _FusedMXMLP.apply(x, w1, b1, w2, b2, counter, cfg)
