"""The MX GEMM as a unit-scaled FP8 GEMM with its power-of-two row and column scales applied
afterwards (`kernels.gemm.deferred_scale_gemm`): the same bits as the row-scaled GEMM's contract,
checked on the CPU, where torch's `_scaled_mm` runs both forms; and which GEMMs take it."""

from __future__ import annotations

import pytest
import torch

from mxflux.kernels.gemm import DEFER_BIAS_MAX_N, DEFER_MIN_DIM, DEFER_MIN_TOKENS, defers_scales, deferred_scale_gemm
from mxflux.mx import FoldGranularity as G
from mxflux.mx import mx_operands_reference, scaled_gemm_reference


def _operands(m, n, k, seed, a_gain=1.0, b_gain=0.02):
    g = torch.Generator().manual_seed(seed)
    # rows a few binades apart, so that each row (and each weight row) gets a scale of its own
    x = (a_gain * torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 7, (m, 1), generator=g)).bfloat16()
    w = (b_gain * torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-6, 7, (n, 1), generator=g)).bfloat16()
    a = mx_operands_reference(x, col=False, granularity=G.ROWWISE)
    b = mx_operands_reference(w, col=False, granularity=G.ROWWISE)
    return a.row_data, a.row_scale, b.row_data, b.row_scale


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,gains", [((64, 96, 256), (1.0, 0.02)),  # activations x weights
                                         ((48, 32, 512), (1e-6, 3.0)),  # small gradients x large activations
                                         ((32, 64, 128), (300.0, 1e-3))])
def test_deferred_scales_give_the_row_scaled_bits(out_dtype, shape, gains):
    a, sa, b, sb = _operands(*shape, seed=sum(shape), a_gain=gains[0], b_gain=gains[1])
    assert sa.unique().numel() > 1 and sb.unique().numel() > 1  # the scales really vary by row
    want = scaled_gemm_reference(a, sa, b, sb, None, out_dtype)
    got = deferred_scale_gemm(a, sa, b, sb, out_dtype)
    assert got.dtype == out_dtype
    # the CPU's _scaled_mm sums in another order than the reference's fp32 matmul: compare it
    # against its own row-scaled form for the bits, and against the reference to fp32 summation order
    rowwise = torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=out_dtype)
    assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                       rowwise.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_deferred_scales_with_a_bias_give_the_row_scaled_bits(out_dtype):
    """With a bias (MXFLUX_DEFER_SCALES=bias) the unit-scaled sums stay fp32, the scales and the bias
    are applied to them and the result is rounded once: the row-scaled GEMM's epilogue with its bias,
    bit for bit (where the CPU's `_scaled_mm` runs both forms). The bias added after the rounding
    ("bias-rounded") is the bias-free GEMM's bits plus the bias, which differs."""
    a, sa, b, sb = _operands(64, 96, 256, seed=3)
    bias = (torch.randn(96, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    rowwise = torch._scaled_mm(a, b.t(), sa, sb.t(), bias=bias, out_dtype=out_dtype)
    got = deferred_scale_gemm(a, sa, b, sb, out_dtype, bias)
    assert got.dtype == out_dtype and torch.equal(got, rowwise)
    rounded = deferred_scale_gemm(a, sa, b, sb, out_dtype, bias, bias_after_rounding=True)
    no_bias = torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=out_dtype)
    assert torch.equal(rounded, (no_bias.float() + bias.float()).to(out_dtype))
    if out_dtype == torch.bfloat16:
        assert not torch.equal(rounded, rowwise)


def test_deferred_scales_are_needed():
    """Guard: the unit-scaled GEMM without the scales is not the result (the test above would
    catch a deferred GEMM that dropped or misapplied them)."""
    a, sa, b, sb = _operands(64, 96, 256, seed=1)
    one = torch.ones(())
    unscaled = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
    only_rows = (unscaled.float() * sa).bfloat16()
    want = deferred_scale_gemm(a, sa, b, sb, torch.bfloat16)
    assert not torch.equal(unscaled, want) and not torch.equal(only_rows, want)


def test_deferred_scales_compile_to_the_same_bits():
    a, sa, b, sb = _operands(64, 96, 256, seed=2)
    compiled = torch.compile(deferred_scale_gemm, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(a, sa, b, sb, torch.bfloat16), deferred_scale_gemm(a, sa, b, sb, torch.bfloat16))


def test_which_gemms_defer_their_scales():
    big, small, tokens = DEFER_MIN_DIM, 3072, DEFER_MIN_TOKENS
    assert defers_scales(small, big, tokens, False, "auto") and defers_scales(big, small, tokens, False, "auto")
    assert not defers_scales(small, small, tokens, False, "auto")  # proj: row-scaled ties there
    assert not defers_scales(small, big, tokens // 2, False, "auto")  # few tokens: the scaling pass costs more
    assert not defers_scales(big, big, tokens, True, "auto")  # a bias is added before the one rounding
    assert not defers_scales(big, big, tokens, True, "all")
    for trial in ("bias", "bias-rounded"):
        assert defers_scales(big, small, tokens, True, trial) and defers_scales(small, big, tokens, False, trial)
        assert not defers_scales(small, small, tokens, True, trial)  # proj: the shape rule still holds
        assert not defers_scales(DEFER_BIAS_MAX_N + 32, small, tokens, True, trial)  # linear1: read in four parts
        assert defers_scales(DEFER_BIAS_MAX_N + 32, small, tokens, False, trial)
    assert defers_scales(small, small, tokens // 2, False, "all")
    assert not defers_scales(big, big, tokens, False, "none")
