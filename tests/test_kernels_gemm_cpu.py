"""The compiled CPU scaled GEMM (numba dequantization) against the reference, bit for bit.

The CPU training path runs `scaled_gemm_cpu` (the scaled_gemm op's CPU implementation), so its
dequantized operands must equal `dequantize_operand` exactly, for every E4M3 byte (NaNs, signed
zeros, subnormals) and for scales from fp32's subnormals to overflow, and the GEMM must equal
`scaled_gemm_reference`. Outputs are poisoned (NaN) before the kernel writes.
"""

from __future__ import annotations

import pytest
import torch
from pack_inputs import adversarial, assert_bits_equal, dev_gen

from mxflux.kernels.gemm_cpu import dequantize_operand_cpu, scaled_gemm_cpu
from mxflux.kernels.operands_cpu import HAS_NUMBA, mx_operands_cpu
from mxflux.mx import FoldGranularity as G
from mxflux.mx import dequantize_operand, scaled_gemm_reference
from mxflux.ops import custom_ops

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="pip install numba (a declared dependency)")


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


@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_gemm_cpu_matches_reference_on_packed_operands(granularity, out_dtype, gen):
    """The GEMM of real packer outputs (wide binade spreads, NaN and overflowing blocks)."""
    a = mx_operands_cpu(adversarial(200, 256, gen), col=False, granularity=granularity)
    b = mx_operands_cpu(adversarial(96, 256, gen), col=False, granularity=granularity)
    bias = torch.randn(96, generator=dev_gen(gen, "cpu"))
    args = (a.row_data, a.row_scale, b.row_data, b.row_scale)
    for bias_ in (None, bias):
        got = scaled_gemm_cpu(*args, bias_, out_dtype)
        assert_bits_equal("out", got, scaled_gemm_reference(*args, bias_, out_dtype))
        assert bool(got.isfinite().any())


def test_scaled_gemm_op_runs_the_cpu_kernel_unless_reference_is_forced(gen, monkeypatch, count_calls):
    calls = count_calls(custom_ops, "scaled_gemm_cpu")
    a_data, a_scale = _random_operand(64, 128, 1, gen)
    b_data, b_scale = _random_operand(32, 128, 1, gen)
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
