"""What the MX GEMM tests accept of a scaled GEMM's output against the reference (`scaled_gemm_reference`):
shared by the GPU tests (tests/gpu/test_gemm_cuda.py) and their CPU check (tests/test_gemm_bounds.py)."""

from __future__ import annotations

import torch


def summation_bound(av: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
    """K·2^-24·Σ_k|a_k·b_k| per output element, in fp64: how far two fp32 summations of the same products in
    different orders can end apart (av [M, K], bv [N, K]: the dequantized operands)."""
    return av.shape[1] * 2.0**-24 * (av.double().abs() @ bv.double().abs().t())


def outside_bound(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> int:
    """How many elements of `got` are further from `want` than `bound`, plus, for a bf16 output, the two
    roundings (got's and the reference's: half an ulp each, at most 2^-8 of each value)."""
    slack = bound
    if got.dtype == torch.bfloat16:
        slack = bound + (got.double().abs() + want.double().abs()) * 2.0**-8
    return int(((got.double() - want.double()).abs() > slack).sum())
