"""The CuTe GEMM's GPU tests' criteria, checked on the CPU (tests/gpu/test_gemm_cuda.py runs them on the device):
GEMMs that differ from the reference only as fp32 summation in another order, or as an accumulator that keeps
16 bits per WGMMA of K 32 (a model of Hopper's FP8 tensor cores under fast accumulation, whose fp32 outputs met
the bound on the H100 while its bf16 ones left the reference's bits), pass the bound; a wrong bias, row scale or
column scale fails it. And MX products summed in fp32 in any order give the reference's bits, while that
accumulator does not: why the bits test expects fast accumulation to fail and the promoted one to pass."""

import pytest
import torch

from gemm_bounds import FAST_ACCUMULATION_SNR_DB, outside_bound, snr_db, summation_bound
from mxflux.kernels import mx_operands_cpu
from mxflux.mx import dequantize_operand, scaled_gemm_reference


def _chop(t: torch.Tensor, bits: int) -> torch.Tensor:
    """`t` with `bits` significant bits (the rest cut off), as an accumulator of `bits` bits keeps a sum."""
    m, e = torch.frexp(t)
    return torch.ldexp(torch.trunc(m * 2.0**bits) / 2.0**bits, e)


@pytest.fixture(scope="module")
def gemm():
    """Flux-like operands (activations ~N(0, 1), weights 0.02·N(0, 1), a bias 0.1·N(0, 1)) packed at the row
    granularity, K = 3072 (where the first GPU run's bound failed), and their reference GEMM's fp32 sums."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 256, 512, 3072
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (0.02 * torch.randn(n, k, generator=g)).bfloat16()
    bias = (0.1 * torch.randn(n, generator=g)).bfloat16()
    a, b = mx_operands_cpu(x, col=False), mx_operands_cpu(w, col=False)
    av, bv = dequantize_operand(a.row_data, a.row_scale), dequantize_operand(b.row_data, b.row_scale)
    return a, b, av, bv, bias


def _summed(av, bv, chunk, bits=None):
    """A·Bᵀ summed `chunk` products at a time into an fp32 accumulator, or one of `bits` bits."""
    acc = torch.zeros(av.shape[0], bv.shape[0])
    for c in range(0, av.shape[1], chunk):
        acc = acc + av[:, c:c + chunk] @ bv[:, c:c + chunk].t()
        acc = acc if bits is None else _chop(acc, bits)
    return acc


def test_another_order_and_fewer_accumulator_bits_pass_the_bound_and_wrong_scales_do_not(gemm):
    a, b, av, bv, bias = gemm
    bound = summation_bound(av, bv)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, out_dtype)
        for acc in (_summed(av, bv, 96), _summed(av, bv, 32, bits=16)):
            got = (acc + bias.float()).to(out_dtype)
            assert outside_bound(got, want, bound) == 0
            wrong_bias = (acc + bias.roll(1).float()).to(out_dtype)
            row_doubled, col_halved = got.clone(), got.clone()
            row_doubled[5] *= 2
            col_halved[:, 7] *= 0.5
            assert outside_bound(wrong_bias, want, bound) > 1000
            assert outside_bound(row_doubled, want, bound) > 100
            assert outside_bound(col_halved, want, bound) > 50


def test_fp32_accumulation_gives_the_references_bits_and_16_bits_do_not(gemm):
    a, b, av, bv, bias = gemm
    want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, None, torch.float32)
    equal = lambda acc: float((acc == want).float().mean())  # noqa: E731
    assert equal(_summed(av, bv, 96)) > 0.999  # promoted every k-tile: fp32 sums, in another order
    assert equal(_summed(av, bv, 32, bits=16)) < 0.99  # fast accumulation's fewer bits: the bits test fails


def test_fast_accumulations_criterion_passes_fewer_accumulator_bits_and_not_a_wrong_scale_or_bias(gemm):
    """Fast accumulation is held to FAST_ACCUMULATION_SNR_DB against the reference (tests/gpu/test_gemm_cuda.py):
    an accumulator cut to 14 bits per WGMMA of K 32 (its errors a little larger than the H100's) passes it, in
    fp32 and bf16 out (58 and 52 dB); a wrong bias (18 dB), one row's scale doubled (24) or one column's halved
    (33) of this 256 x 512 output fails it."""
    a, b, av, bv, bias = gemm
    for out_dtype in (torch.float32, torch.bfloat16):
        want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, out_dtype)
        acc = _summed(av, bv, 32, bits=14)
        got = (acc + bias.float()).to(out_dtype)
        assert snr_db(got, want) > FAST_ACCUMULATION_SNR_DB
        row_doubled, col_halved = got.clone(), got.clone()
        row_doubled[5] *= 2
        col_halved[:, 7] *= 0.5
        for wrong in ((acc + bias.roll(1).float()).to(out_dtype), row_doubled, col_halved):
            assert snr_db(wrong, want) < FAST_ACCUMULATION_SNR_DB
