"""MKL's bf16 x bf16 -> fp32 GEMM as PyTorch's CPU library exports it (`mxflux.kernels.cpu_blas`):
exact products summed in fp32, clear errors for operands it cannot take."""

from __future__ import annotations

import pytest
import torch
from pack_inputs import dev_gen

from mxflux.kernels import cpu_blas

pytestmark = pytest.mark.skipif(not cpu_blas.bf16_gemm_available(), reason="this PyTorch exports no MKL bf16 GEMM")


def test_mkl_bf16_gemm_sums_exact_products_in_fp32(gen):
    """Within the fp32 summation bound of the exact (fp64) product, and not rounded to bf16."""
    g = dev_gen(gen, "cpu")
    a, b = torch.randn(70, 300, generator=g).bfloat16(), torch.randn(45, 300, generator=g).bfloat16()
    got = cpu_blas.gemm_bf16_f32(a, b)
    assert got.dtype == torch.float32 and got.shape == (70, 45)
    exact = a.double() @ b.double().t()
    bound = 300 * 2.0**-24 * (a.double().abs() @ b.double().abs().t())
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert float((got != got.bfloat16().float()).float().mean()) > 0.9
    empty_k = cpu_blas.gemm_bf16_f32(a[:, :0].contiguous(), b[:, :0].contiguous())
    assert torch.equal(empty_k, torch.zeros(70, 45))
    assert cpu_blas.gemm_bf16_f32(a[:0], b).shape == (0, 45)


def test_mkl_bf16_gemm_rejects_bad_operands():
    a, b = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a: expected a contiguous 2-D bf16 CPU tensor, got torch.float32"):
        cpu_blas.gemm_bf16_f32(a.float(), b)
    with pytest.raises(ValueError, match=r"b: expected a contiguous 2-D bf16 CPU tensor.*contiguous: False"):
        cpu_blas.gemm_bf16_f32(a, torch.zeros(32, 8, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"b: expected K=32 columns like a, got \(8, 16\)"):
        cpu_blas.gemm_bf16_f32(a, b[:, :16].contiguous())
    assert cpu_blas.bf16_gemm_fits(2**16, 2**15 - 1, 2**15 - 1)  # every product of sizes below 2^31
    assert not cpu_blas.bf16_gemm_fits(2**16, 2**15, 1) and not cpu_blas.bf16_gemm_fits(1, 2**16, 2**15)
