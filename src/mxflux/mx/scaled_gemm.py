"""Reference semantics of the scaled FP8 GEMM that runs every MX linear.

out = (A ⊙ scale_a) · (B ⊙ scale_b)ᵀ + bias, accumulated in fp32, bias added in fp32, one
rounding to `out_dtype`. A is [M, K], B is [N, K] (FP8 data, both contiguous along K); a scale
has one column per fold group of K (`FoldGranularity.groups(K)`): [M, 1] is ROWWISE,
[M, K/128] BLOCKWISE, [M, K/32] EXACT. Because the FP8 data and power-of-two scales are the MX
values exactly (docs/design.md, "The exact FP8 fold and its window"), this equals `mx_matmul`
on the same operands.
"""

from __future__ import annotations

import torch

from .matmul import true_fp32

__all__ = ["add_bias_and_round", "dequantize_operand", "dequantized_gemm", "scaled_gemm_reference"]


def dequantize_operand(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of a scaled FP8 operand [R, K] with scale [R, K/g]."""
    k, groups = data.shape[-1], scale.shape[-1]
    if k % groups:
        raise ValueError(f"scale: {groups} groups do not divide the operand's K={k}")
    return data.float() * scale.float().repeat_interleave(k // groups, dim=-1)


def scaled_gemm_reference(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """out[M, N] = (A ⊙ scale_a)(B ⊙ scale_b)ᵀ + bias in true fp32, rounded once to `out_dtype`."""
    return dequantized_gemm(dequantize_operand(a_data, a_scale), dequantize_operand(b_data, b_scale), bias, out_dtype)


def dequantized_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a · bᵀ + bias for fp32 a [M, K], b [N, K] in true fp32, rounded once to `out_dtype`: the
    scaled GEMM after dequantization (shared with the CPU kernel, which dequantizes faster)."""
    with true_fp32(a.device.type):
        out = a @ b.t()
    return add_bias_and_round(out, bias, out_dtype)


def add_bias_and_round(out: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM's epilogue on its fp32 sums `out` (a temporary: the bias is added in place), bias
    added in fp32, then the one rounding to `out_dtype`."""
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)
