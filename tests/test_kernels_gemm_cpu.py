"""The compiled CPU scaled GEMM (numba dequantization, MKL's bf16 GEMM) against the reference.

The CPU training path runs `scaled_gemm_cpu` (the scaled_gemm op's CPU implementation), so its
dequantized operands must equal `dequantize_operand` exactly, for every E4M3 byte (NaNs, signed
zeros, subnormals) and for scales from fp32's subnormals to overflow, in fp32 and, where the
scales keep them exact, in bf16. The GEMM on bf16 values sums in MKL's order: its outputs are
NaN/inf where the reference's are and within the fp32 summation-order bound of them elsewhere; on
other scales (or without MKL's GEMM) it is the reference bit for bit. Outputs are poisoned (NaN)
before the kernels write.
"""

from __future__ import annotations

import pytest
import torch
from pack_inputs import adversarial, assert_bits_equal, dev_gen

from mxflux.kernels import cpu_blas, gemm_cpu
from mxflux.kernels.gemm_cpu import dequantize_operand_bf16_cpu, dequantize_operand_cpu, scaled_gemm_cpu
from mxflux.kernels.operands_cpu import HAS_NUMBA, mx_operands_cpu
from mxflux.mx import FoldGranularity as G
from mxflux.mx import dequantize_operand, scaled_gemm_reference
from mxflux.ops import custom_ops

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="pip install numba (a declared dependency)")
needs_mkl_bf16 = pytest.mark.skipif(not cpu_blas.bf16_gemm_available(), reason="this PyTorch exports no MKL bf16 GEMM")


def _random_operand(r, k, groups, gen):
    """Every E4M3 byte drawn uniformly (NaNs and ±0 included), scales 2^-149 (fp32's smallest
    subnormal) to 2^127 (products overflow to inf)."""
    g = dev_gen(gen, "cpu")
    data = torch.randint(0, 256, (r, k), generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-149, 128, (r, groups), generator=g).float())
    return data, scale


@pytest.mark.parametrize("groups", [1, 4, 16])  # rowwise, blockwise (K/128), exact (K/32) scales of K = 512
def test_dequantize_cpu_matches_reference_for_every_byte(groups, gen):
    data, scale = _random_operand(300, 512, groups, gen)
    data[0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    got = dequantize_operand_cpu(data, scale, _poison=True)
    assert_bits_equal("dequantized", got, dequantize_operand(data, scale))
    assert bool(got.isnan().any()) and bool(got.isinf().any()) and bool((got == 0).any())  # the edge cases ran


def test_dequantize_cpu_reads_strided_operands(gen):
    data, scale = _random_operand(256, 96, 3, gen)
    t = data.t()  # [96, 256], a view
    s = torch.exp2(torch.randint(-20, 20, (96, 2), generator=dev_gen(gen, "cpu")).float())
    assert_bits_equal("dequantized", dequantize_operand_cpu(t, s, _poison=True), dequantize_operand(t, s))


def test_dequantize_cpu_rejects_bad_operands():
    with pytest.raises(ValueError, match="data: expected a 2-D float8_e4m3fn"):
        dequantize_operand_cpu(torch.zeros(4, 32), torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"scale: expected \[4, groups\] with groups dividing K=32"):
        dequantize_operand_cpu(torch.zeros(4, 32).to(torch.float8_e4m3fn), torch.ones(4, 3))


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_bf16_dequantize_equals_fp32_for_every_byte_where_the_scales_keep_it_exact(groups, gen):
    """Scales zero, ±inf or powers of two from 2^-117 (the smallest that keeps E4M3's subnormals
    fp32-normal) to 2^127: the bf16 values are the fp32 ones. A scale that makes any value a non-bf16
    (an fp32 subnormal below bf16's, or more than 8 significant bits) gives None."""
    data, _ = _random_operand(300, 512, groups, gen)
    data[0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    g = dev_gen(gen, "cpu")
    scale = torch.exp2(torch.randint(-117, 128, (300, groups), generator=g).float())
    scale[1, 0], scale[2, 0], scale[3, 0] = 0.0, float("inf"), -(2.0**-117)
    got = dequantize_operand_bf16_cpu(data, scale, _poison=True)
    assert got.dtype == torch.bfloat16
    assert_bits_equal("dequantized", got.float(), dequantize_operand(data, scale))
    for bad in (2.0**-140, 1 + 2.0**-10):
        scale[5, groups - 1] = bad
        assert dequantize_operand_bf16_cpu(data, scale) is None
    scale[5, groups - 1] = 3.0  # not a power of two, but 4 + 2 significant bits fit in bf16's 8
    assert_bits_equal("dequantized", dequantize_operand_bf16_cpu(data, scale).float(), dequantize_operand(data, scale))


def _assert_same_gemm(got, want, av, bv):
    """NaN and ±inf where the reference has them; elsewhere within twice the fp32 summation-order
    bound K·2^-24·Σ|a·b| (each sum is that close to the exact one; + K·2^-126 for products below
    fp32's normals, which MKL may flush) plus one ulp of the output dtype (both sums are rounded)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()), "NaNs differ"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), "infinities differ"
    k = av.shape[1]
    with torch.autocast("cpu", enabled=False):
        sab = av.double().abs().nan_to_num(posinf=0.0) @ bv.double().abs().nan_to_num(posinf=0.0).t()
    ulp = want.double().abs() * (2.0**-7 if want.dtype == torch.bfloat16 else 2.0**-23)
    bound = 2 * (k * 2.0**-24 * sab + k * 2.0**-126) + ulp
    fin = want.isfinite()
    err = (got.double() - want.double()).abs()[fin]
    assert bool((err <= bound[fin]).all()), f"max error / bound {float((err / bound[fin]).max()):.3g}"


@needs_mkl_bf16
@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_gemm_cpu_on_packed_operands_runs_mkl_within_the_summation_bound(granularity, out_dtype, gen,
                                                                               count_calls):
    """The GEMM of real packer outputs (wide binade spreads, NaN and overflowing blocks): their
    scales are powers of two, so the bf16 GEMM runs."""
    calls = count_calls(gemm_cpu, "gemm_bf16_f32")
    a = mx_operands_cpu(adversarial(200, 256, gen), col=False, granularity=granularity)
    b = mx_operands_cpu(adversarial(96, 256, gen), col=False, granularity=granularity)
    bias = torch.randn(96, generator=dev_gen(gen, "cpu"))
    args = (a.row_data, a.row_scale, b.row_data, b.row_scale)
    av, bv = dequantize_operand(a.row_data, a.row_scale), dequantize_operand(b.row_data, b.row_scale)
    for bias_ in (None, bias):
        got = scaled_gemm_cpu(*args, bias_, out_dtype)
        _assert_same_gemm(got, scaled_gemm_reference(*args, bias_, out_dtype), av, bv)
        assert bool(got.isfinite().any()) and bool(got.isnan().any())
    assert len(calls) == 2


@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("why", ["no MKL GEMM", "too large for it"])
def test_scaled_gemm_cpu_without_mkl_is_the_reference_bit_for_bit(granularity, why, gen, monkeypatch):
    monkeypatch.setattr(gemm_cpu, "bf16_gemm_available" if why == "no MKL GEMM" else "bf16_gemm_fits",
                        lambda *shape: False)
    a = mx_operands_cpu(adversarial(200, 256, gen), col=False, granularity=granularity)
    b = mx_operands_cpu(adversarial(96, 256, gen), col=False, granularity=granularity)
    bias = torch.randn(96, generator=dev_gen(gen, "cpu"))
    args = (a.row_data, a.row_scale, b.row_data, b.row_scale)
    for out_dtype in (torch.bfloat16, torch.float32):
        assert_bits_equal("out", scaled_gemm_cpu(*args, bias, out_dtype), scaled_gemm_reference(*args, bias, out_dtype))


def test_scaled_gemm_cpu_on_inexact_scales_is_the_reference_bit_for_bit(gen, count_calls):
    """Scales from fp32's subnormals up (some values not bf16s): the fp32 path, bit for bit."""
    calls = count_calls(gemm_cpu, "gemm_bf16_f32")
    a_data, a_scale = _random_operand(64, 128, 4, gen)
    b_data, b_scale = _random_operand(32, 128, 4, gen)
    a_scale[0, 0] = 2.0**-140  # at least one, whatever the draw
    args = (a_data, a_scale, b_data, b_scale)
    assert_bits_equal("out", scaled_gemm_cpu(*args, None, torch.float32),
                      scaled_gemm_reference(*args, None, torch.float32))
    assert calls == []


def test_scaled_gemm_op_runs_the_cpu_kernel_unless_reference_is_forced(gen, monkeypatch, count_calls):
    calls = count_calls(custom_ops, "scaled_gemm_cpu")
    a_data, a_scale = _random_operand(64, 128, 1, gen)
    b_data, b_scale = _random_operand(32, 128, 1, gen)
    a_scale[0, 0] = 2.0**-140  # the fp32 path: bit for bit
    want = scaled_gemm_reference(a_data, a_scale, b_data, b_scale, None, torch.bfloat16)
    got = torch.ops.mxflux.scaled_gemm(a_data, a_scale, b_data, b_scale, "rowwise", None, torch.bfloat16)
    assert calls == [1]
    assert_bits_equal("out", got, want)
    monkeypatch.setattr(custom_ops, "FORCE_REFERENCE", True)  # what MXFLUX_REFERENCE=1 sets at import
    torch.ops.mxflux.scaled_gemm(a_data, a_scale, b_data, b_scale, "rowwise", None, torch.bfloat16)
    assert calls == [1]


def test_dequantize_cpu_leaves_the_operand_storages_resizable(gen):
    data, scale = _random_operand(32, 64, 2, gen)
    dequantize_operand_cpu(data, scale)
    data.untyped_storage().resize_(0)
    scale.untyped_storage().resize_(0)

