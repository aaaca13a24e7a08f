"""What the MX GEMM tests accept of a scaled GEMM's output against the reference (`scaled_gemm_reference`):
shared by the GPU tests (tests/gpu/test_gemm_cuda.py) and their CPU check (tests/test_gemm_bounds.py). The GEMM
contract's accumulation (fp32) stays within the fp32 summation-order bound; fast accumulation (the tensor
cores' FP8 accumulator) does not, and is held to a signal-to-noise ratio instead."""

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


# What fast accumulation is held to. Its errors on the H100 were a few 1e-4 of each value (~65-70 dB); a
# wrong scale of one row of R doubled gives ~10·log10(R) dB, of one column of C halved ~10·log10(4C): at the
# GPU tests' shapes (R ≤ 1024, C ≤ 12288) at most 47 dB.
FAST_ACCUMULATION_SNR_DB = 50.0


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    """10·log10(Σ want² / Σ (got - want)²), in fp64: the criterion for a GEMM outside the fp32 bound (fast
    accumulation)."""
    want = want.double()
    return float(10 * torch.log10(want.square().sum() / (got.double() - want).square().sum().clamp_min(1e-300)))
