"""The FP8 fold (docs/design.md, "The exact FP8 fold and its window") and the reference MX GEMM."""

import pytest
import torch

from mxflux.mx import FoldGranularity as G
from mxflux.mx import fold_to_e4m3, mx_matmul, quantize, snr_db


def _expand(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.repeat_interleave(k // scale.shape[-1], dim=-1)


def wide_rows(gen, rows=16, k=512, spread=30):
    """Rows whose blocks span `spread` binades, so some blocks fall outside the fold window."""
    x = torch.randn(rows, k, generator=gen)
    per_block = torch.randint(-spread // 2, spread // 2 + 1, (rows, k // 32), generator=gen).float()
    return x * torch.exp2(per_block).repeat_interleave(32, dim=1)


@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("fmt", ["e2m3", "e3m2", "e2m1"])
def test_fold_is_bit_exact_inside_the_window_and_counts_the_rest(gen, granularity, fmt):
    x = wide_rows(gen)
    mx = quantize(x, fmt)
    data, scale, blocks_outside_window = fold_to_e4m3(mx, granularity)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    groups = {G.ROWWISE: 1, G.BLOCKWISE: 4, G.EXACT: 16}[granularity]
    assert scale.shape == (16, groups) and scale.dtype == torch.float32
    folded = data.float() * _expand(scale, 512)
    exact = mx.dequantize(unrotate=False)

    f = mx.format
    e_block = mx.scales.long() - 127
    live = (mx.codes.reshape(16, 16, 32) & (f.sign_mask - 1)).amax(-1) > 0
    bpg = 16 // groups  # blocks per group
    e_live = torch.where(live, e_block, torch.full_like(e_block, -10**6))
    e_ref = e_live.reshape(16, -1, bpg).amax(-1).repeat_interleave(bpg, dim=-1)
    inside = (e_block >= e_ref - f.fold_window) | ~live
    inside_el = inside.repeat_interleave(32, dim=1)

    assert torch.equal(folded[inside_el], exact[inside_el])
    assert int(blocks_outside_window) == int((~inside).sum())
    if granularity is G.EXACT:
        assert int(blocks_outside_window) == 0  # one block per group: always exact
    else:
        assert int(blocks_outside_window) > 0  # the test data must exercise the out-of-window path
        # Out-of-window blocks are still close: rounded to E4M3 at the group's reference.
        err = (folded[~inside_el] - exact[~inside_el]).abs()
        assert float(err.max()) <= float(_expand(scale, 512)[~inside_el].max()) * 2.0**-10


def test_fold_of_normal_data_has_nothing_outside_the_window(gen):
    x = torch.randn(256, 3072, generator=gen).bfloat16()
    mx = quantize(x)
    data, scale, n = fold_to_e4m3(mx)
    assert int(n) == 0
    assert torch.equal(data.float() * scale, mx.dequantize(unrotate=False))


def test_fold_keeps_nan_and_handles_zero_rows(gen):
    x = torch.randn(3, 64, generator=gen)
    x[0] = 0.0
    x[1, 5] = float("nan")
    data, scale, n = fold_to_e4m3(quantize(x))
    assert (data[0].float() == 0).all() and torch.isfinite(scale).all()
    assert data[1, :32].float().isnan().all() and not data[1, 32:].float().isnan().any()
    assert int(n) == 0


def test_fold_rejects_formats_that_do_not_fit_e4m3(gen):
    mx = quantize(torch.randn(2, 32, generator=gen), "e5m2", hadamard=False)
    with pytest.raises(ValueError, match="mx: elements of format 'e5m2' are not exactly representable"):
        fold_to_e4m3(mx)
    with pytest.raises(ValueError, match="granularity: expected a FoldGranularity, got 128"):
        fold_to_e4m3(quantize(torch.randn(2, 256, generator=gen)), 128)
    with pytest.raises(ValueError, match="granularity: blockwise needs the axis length to be a multiple of 128, got 96"):
        fold_to_e4m3(quantize(torch.randn(2, 96, generator=gen)), G.BLOCKWISE)


def test_fold_granularity_is_named_by_mx_gemm_in_one_place():
    assert [G.from_mx_gemm(n) for n in ("rowwise", "blockwise", "exact")] == [G.ROWWISE, G.BLOCKWISE, G.EXACT]
    assert [g.kernel_id for g in G] == [0, 128, 32]
    assert [g.groups(512) for g in G] == [1, 4, 16]
    assert [g.group_size(512) for g in G] == [512, 128, 32]
    assert [g.row_multiple for g in G] == [32, 128, 32]
    for bad in ("row", "Rowwise", 128, None):
        with pytest.raises(ValueError, match=r"mx_gemm: expected one of \['rowwise', 'blockwise', 'exact'\], got"):
            G.from_mx_gemm(bad)


@pytest.mark.parametrize("hadamard", [True, False])
def test_mx_matmul_matches_float64_before_rounding(gen, hadamard):
    a = quantize(torch.randn(64, 1024, generator=gen), hadamard=hadamard)
    b = quantize(torch.randn(48, 1024, generator=gen) * 0.02, hadamard=hadamard)
    bias = torch.randn(48, generator=gen)
    ref = a.dequantize(torch.float64, unrotate=False) @ b.dequantize(torch.float64, unrotate=False).t()
    ref = ref + bias.double()
    got = mx_matmul(a, b, bias, out_dtype=torch.float32)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    rounded = mx_matmul(a, b, bias)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, got.to(torch.bfloat16))  # one rounding of the fp32 result


def test_mx_matmul_approximates_the_unquantized_product(gen):
    x = torch.randn(512, 1024, generator=gen)
    w = torch.randn(256, 1024, generator=gen) * 0.02
    snr = snr_db(x.double() @ w.double().t(), mx_matmul(quantize(x), quantize(w), out_dtype=torch.float32))
    assert 26.0 < snr < 31.0  # the seed measures ~28 dB for MXFP6 GEMMs


def test_mx_matmul_batched_and_nan(gen):
    x = torch.randn(2, 8, 64, generator=gen)
    x[1, 3, 7] = float("inf")
    w = torch.randn(16, 64, generator=gen)
    out = mx_matmul(quantize(x), quantize(w), out_dtype=torch.float32)
    assert out.shape == (2, 8, 16)
    assert out[1, 3].isnan().all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :3]).all()


def test_mx_matmul_errors(gen):
    a = quantize(torch.randn(4, 64, generator=gen))
    with pytest.raises(ValueError, match="a, b: both operands must share the rotation setting"):
        mx_matmul(a, quantize(torch.randn(8, 64, generator=gen), hadamard=False))
    with pytest.raises(ValueError, match="a, b: contraction lengths differ"):
        mx_matmul(a, quantize(torch.randn(8, 96, generator=gen)))
    with pytest.raises(ValueError, match="b: must be quantized along its last"):
        mx_matmul(a, quantize(torch.randn(64, 64, generator=gen), axis=0))
    with pytest.raises(ValueError, match=r"bias: expected a tensor of shape \(8,\)"):
        mx_matmul(a, quantize(torch.randn(8, 64, generator=gen)), bias=torch.zeros(4))
