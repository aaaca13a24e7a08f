"""cuBLAS scaled GEMMs against the reference GEMM on the same packed operands (CUDA only).

The reference accumulates the exact operand values in true fp32 (no TF32); cuBLAS sums in
another order (and, for FP8, promotes Hopper's tensor-core accumulator to fp32 every few
k-steps), so the bf16 outputs are compared by bf16 ulps, with any element further than one ulp
bounded by the fp32 summation-order error K·2^-24·Σ_k|a_k·b_k| (plus half an ulp of rounding).
"""

from __future__ import annotations

import pytest
import torch

from gemm_bounds import FAST_ACCUMULATION_SNR_DB, outside_bound, snr_db, summation_bound
from mxflux.kernels import cuda_kernel_available, gemm_cute, gemm_quack, mx_operands_cuda, scaled_gemm_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import dequantize_operand, mx_matmul, quantize, scaled_gemm_reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not cuda_kernel_available(), reason="needs Triton and a CUDA device")

SHAPES = [(1024, 3072, 3072), (512, 9216, 3072), (256, 3072, 12288), (1000, 3072, 15360)]


def _gen(gen):
    return torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))


def operands(m, n, k, granularity, gen):
    g = _gen(gen)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (0.02 * torch.randn(n, k, generator=g, device="cuda")).bfloat16()
    bias = (0.1 * torch.randn(n, generator=g, device="cuda")).bfloat16()
    a = mx_operands_cuda(x, col=False, granularity=granularity)
    b = mx_operands_cuda(w, col=False, granularity=granularity)
    return a, b, bias


def ulp_stats(got, want, bound):
    """bf16 ulp distance (ordinal), and whether every element > 1 ulp is within `bound`."""
    gi, wi = got.view(torch.int16).int(), want.view(torch.int16).int()
    ordinal = lambda i: torch.where(i < 0, -(i & 0x7FFF), i)  # noqa: E731 - sign-magnitude -> ordinal
    ulps = (ordinal(gi) - ordinal(wi)).abs()
    far = ulps > 1
    half_ulp = want.float().abs() * 2.0**-8
    within = (got.float() - want.float()).abs() <= bound + half_ulp
    return {
        "equal": float((ulps == 0).float().mean()),
        "le1ulp": float((ulps <= 1).float().mean()),
        "max_ulp": int(ulps.max()),
        "far_unexplained": int((far & ~within).sum()),
    }


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_reference(granularity, shape, gen):
    m, n, k = shape
    a, b, bias = operands(m, n, k, granularity, gen)
    assert a.row_scale.shape == (m, granularity.groups(k))
    # poison the allocator's free memory so an unwritten output element would show as NaN
    junk = torch.full((m * n * 2,), float("nan"), device="cuda")
    del junk
    got = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, granularity, bias, torch.bfloat16)
    want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, torch.bfloat16)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert not got.isnan().any()
    av = dequantize_operand(a.row_data, a.row_scale)
    bv = dequantize_operand(b.row_data, b.row_scale)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        bound = k * 2.0**-24 * (av.abs() @ bv.abs().t())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    st = ulp_stats(got, want, bound)
    print(f"{granularity.value} {shape}: equal {st['equal']:.4f}, <=1 ulp {st['le1ulp']:.6f}, max {st['max_ulp']} ulp")
    assert st["far_unexplained"] == 0, st


@gpu
@needs_cuda
@needs_triton
def test_rowwise_equals_mx_matmul_on_exact_folds(gen):
    """Fold + cuBLAS row-wise == the MX GEMM of the quantized operands (docs/design.md, "The exact
    FP8 fold and its window")."""
    m, n, k = 512, 3072, 3072
    g = _gen(gen)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (0.02 * torch.randn(n, k, generator=g, device="cuda")).bfloat16()
    bias = (0.1 * torch.randn(n, generator=g, device="cuda")).bfloat16()
    a = mx_operands_cuda(x, col=False)
    b = mx_operands_cuda(w, col=False)
    assert int(a.blocks_outside_window) == 0 and int(b.blocks_outside_window) == 0
    got = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.ROWWISE, bias)
    want = mx_matmul(quantize(x, axis=1), quantize(w, axis=1), bias)
    ref = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias)
    assert torch.equal(ref, want)  # the fold is exact: same values, same fp32 GEMM
    st = ulp_stats(got, want, torch.zeros_like(got, dtype=torch.float32) + float("inf"))
    assert st["le1ulp"] > 0.99, st


@gpu
@needs_cuda
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_fp32_bias_and_output(out_dtype, gen):
    g = _gen(gen)
    m, n, k = 256, 512, 1024
    a = torch.randn(m, k, generator=g, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=g, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.full((m, 1), 0.5, device="cuda")
    sb = torch.full((n, 1), 0.25, device="cuda")
    bias = torch.randn(n, generator=g, device="cuda")  # fp32 bias: added in fp32, one rounding
    got = scaled_gemm_cuda(a, sa, b, sb, G.ROWWISE, bias, out_dtype)
    want = scaled_gemm_reference(a, sa, b, sb, bias, torch.float32)
    assert got.dtype == out_dtype
    # Hopper's FP8 accumulation is not IEEE fp32: bound by the fp32-order error, plus the rounding
    bound = k * 2.0**-24 * (a.float().abs() @ b.float().abs().t()) * 0.125 + want.abs() * 2.0**-8
    assert bool(((got.float() - want).abs() <= bound).all())


@gpu
@needs_cuda
def test_gemm_errors_name_the_argument():
    a = torch.zeros(64, 256, device="cuda").to(torch.float8_e4m3fn)
    s = torch.ones(64, 1, device="cuda")
    with pytest.raises(ValueError, match="a_data"):
        scaled_gemm_cuda(a.float(), s, a, s, G.ROWWISE)
    with pytest.raises(ValueError, match="a_scale"):
        scaled_gemm_cuda(a, torch.ones(64, 3, device="cuda"), a, s, G.ROWWISE)
    with pytest.raises(ValueError, match="b_scale"):
        scaled_gemm_cuda(a, s, a, s.double(), G.ROWWISE)
    with pytest.raises(ValueError, match="bias"):
        scaled_gemm_cuda(a, s, a, s, G.ROWWISE, bias=torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match="K and N"):
        b = torch.zeros(40, 256, device="cuda").to(torch.float8_e4m3fn)
        scaled_gemm_cuda(a, s, b, torch.ones(40, 1, device="cuda"), G.ROWWISE)
    with pytest.raises(ValueError, match=r"a_scale, b_scale: a blockwise GEMM .* takes scales \[64, 2\]"):
        scaled_gemm_cuda(a, s, a, s, G.BLOCKWISE)  # row-wise scales passed as block-wise
    with pytest.raises(ValueError, match="granularity: expected a FoldGranularity"):
        scaled_gemm_cuda(a, s, a, s, "rowwise")


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("mm_out_dtype", [True, False], ids=["mm_out_dtype", "fp32_fallback"])
def test_exact_mode_accumulates_in_fp32_under_autocast(mm_out_dtype, gen, monkeypatch):
    """A training step's bf16 autocast must not turn the exact mode's fp32 GEMM into a bf16 one
    (that would round the product once before the fp32 bias and again after it)."""
    import mxflux.kernels.gemm as gemm

    caps = dict(gemm._caps(torch.empty(0, device="cuda")), mm_out_dtype=mm_out_dtype)
    monkeypatch.setattr(gemm, "_caps", lambda t: caps)
    a, b, _ = operands(512, 1024, 3072, G.EXACT, gen)
    bias = 0.1 * torch.randn(1024, generator=_gen(gen), device="cuda")  # fp32 bias: the fp32 branch
    want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.EXACT, bias, torch.bfloat16)
    st = ulp_stats(got, want, torch.zeros_like(got, dtype=torch.float32))
    assert st["equal"] > 0.99 and st["far_unexplained"] == 0, st  # double rounding: ~1/3 differ


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_deferred_scales_equal_the_row_scaled_gemm_bit_for_bit(shape, out_dtype, gen):
    """cuBLAS's unit-scaled (tensor-wise) FP8 GEMM with the power-of-two scales applied afterwards
    gives the row-scaled GEMM's bits (`kernels.gemm.deferred_scale_gemm`)."""
    from mxflux.kernels.gemm import deferred_scale_gemm

    a, b, _ = operands(*shape, G.ROWWISE, gen)
    want = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.ROWWISE, None, out_dtype)
    got = deferred_scale_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, out_dtype)
    assert torch.equal(got, want)
    want = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.ROWWISE, None, out_dtype)
    got = deferred_scale_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, out_dtype)
    assert torch.equal(got, want)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_deferred_scales_with_a_bias_equal_the_row_scaled_gemm_bit_for_bit(shape, gen):
    """With a bias (MXFLUX_DEFER_SCALES=bias): the unit-scaled sums in fp32, scaled, the bias added and
    rounded once give the row-scaled GEMM's bias epilogue bit for bit."""
    from mxflux.kernels.gemm import deferred_scale_gemm

    a, b, _ = operands(*shape, G.ROWWISE, gen)
    bias = (torch.randn(shape[1], generator=gen) * 2).to("cuda", torch.bfloat16)
    want = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.ROWWISE, bias, torch.bfloat16)
    got = deferred_scale_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, torch.bfloat16, bias)
    assert torch.equal(got, want)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.skipif(not gemm_cute.available(), reason="needs CuTe DSL (nvidia-cutlass-dsl) and a Hopper GPU")
@pytest.mark.parametrize("accumulation", ["fp32", "fp32h", "fast"])
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
@pytest.mark.parametrize("shape", [*SHAPES[:3], (512, 12288, 3072), (256, 3328, 3072)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cute_gemm_is_within_its_accumulations_bound(shape, out_dtype, with_bias, accumulation, gen):
    """The CuTe-DSL row-scaled GEMM: every element written; with the contract's accumulation (fp32) its fp32
    result within the fp32 summation-order bound K·2^-24·Σ|a·b| of the reference, and a bf16 result within
    that bound plus its own and the reference's rounding (half an ulp each, ≤ 2^-8 of each value); with fast
    accumulation, which left that bound at K = 3072 on the H100 (4 of 5 shapes, fp32 out), at least
    FAST_ACCUMULATION_SNR_DB against the reference. A wrong row's or column's scale (a factor of 2) or
    bias (0.1 against outputs near 1) fails either (tests/test_gemm_bounds.py checks both criteria)."""
    m, n, k = shape
    if n % gemm_cute.CONFIGS[accumulation][0][1]:
        pytest.skip(f"N = {n} is no whole number of {accumulation} tiles")
    a, b, bias = operands(m, n, k, G.ROWWISE, gen)
    bias = bias if with_bias else None
    junk = torch.full((m * n * 2,), float("nan"), device="cuda")  # an unwritten element would show as NaN
    del junk
    got = gemm_cute.cute_scaled_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, out_dtype, accumulation)
    want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype and not got.isnan().any()
    if accumulation == "fast":
        assert snr_db(got, want) > FAST_ACCUMULATION_SNR_DB
    else:
        av, bv = dequantize_operand(a.row_data, a.row_scale), dequantize_operand(b.row_data, b.row_scale)
        assert outside_bound(got, want, summation_bound(av, bv)) == 0


@gpu
@needs_cuda
@needs_triton
@pytest.mark.skipif(not gemm_cute.available(), reason="needs CuTe DSL (nvidia-cutlass-dsl) and a Hopper GPU")
@pytest.mark.parametrize("accumulation", [
    pytest.param("fast", marks=pytest.mark.xfail(
        strict=True, reason="fast accumulation sums all of K in the tensor cores' FP8 accumulator, which keeps fewer "
        "bits than fp32 (cuBLAS's use_fast_accum)")),
    "fp32", "fp32h", "fp32p3", "fp32p4"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_cute_gemm_gives_the_row_scaled_gemms_bits(shape, accumulation, gen, monkeypatch):
    """The GEMM contract (fp32 accumulation, one rounding), measured as cuBLAS's row-scaled GEMM meets it (the
    fp32 accumulation must; fast accumulation is expected not to): the
    products of MX operands are short (8 significant bits), so fp32 sums of them in any order are mostly
    exact and give the reference's bits; the CuTe kernel's must match the reference as often as cuBLAS's do
    (fp32 out, and bf16 with a bias), not less often by more than 0.1 % of the elements; and promoted, its
    output is cuBLAS's row-scaled one bit for bit (the default's claim)."""
    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("off"))  # scaled_gemm_cuda: cuBLAS's
    m, n, k = shape
    a, b, bias = operands(m, n, k, G.ROWWISE, gen)
    for out_dtype, bias_ in ((torch.float32, None), (torch.bfloat16, bias)):
        ours = gemm_cute.cute_scaled_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, bias_, out_dtype,
                                          accumulation)
        cublas = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.ROWWISE, bias_, out_dtype)
        want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias_, out_dtype)
        equal_ours, equal_cublas = (float((t == want).float().mean()) for t in (ours, cublas))
        print(f"{shape} {out_dtype}: equal to the reference: CuTe {equal_ours:.5f}, cuBLAS {equal_cublas:.5f}")
        assert equal_ours >= equal_cublas - 1e-3
        if accumulation != "fast":  # promoted every k-tile of K 128, as cuBLAS: its bits (the probe's 18 GEMMs too)
            assert torch.equal(ours, cublas)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.skipif(not gemm_cute.available(), reason="needs CuTe DSL (nvidia-cutlass-dsl) and a Hopper GPU")
@pytest.mark.parametrize("accumulation", list(gemm_cute.BLOCK_SCALES))
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_block_scales_the_same_in_every_k_tile_give_the_row_scaled_kernels_bits(shape, accumulation, gen):
    """The kernel with block scales at the promotion (`block_scale_columns`), its scales each row's and column
    group's row-scaled ones in every k-tile: the row-scaled kernel's output bit for bit, fp32 out and bf16 with a
    bias (a power of two commutes with fp32 rounding, at each promotion or once in the epilogue). A register given
    another row's or group's scale, or a k-tile's scale read for the wrong k-tile, breaks it."""
    m, n, k = shape
    group = gemm_cute.BLOCK_SCALES[accumulation]
    a, b, bias = operands(m, n, k, G.ROWWISE, gen)
    g = _gen(gen)
    b_group = torch.exp2(torch.randint(-4, 4, (n // group, 1), generator=g, device="cuda").float())
    for out_dtype, bias_ in ((torch.float32, None), (torch.bfloat16, bias)):
        outs = []
        for acc, sa, sb in ((accumulation, a.row_scale.expand(m, k // 128), b_group.expand(n // group, k // 128)),
                            ("fp32", a.row_scale, b_group.repeat_interleave(group, 0))):
            out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
            gemm_cute.prepared_gemm(a.row_data, sa, b.row_data, sb, bias_, out, accumulation=acc)()
            outs.append(out)
        assert not outs[0].isnan().any() and torch.equal(*outs), (out_dtype, bias_ is not None)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.skipif(not gemm_cute.available(), reason="needs CuTe DSL (nvidia-cutlass-dsl) and a Hopper GPU")
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_the_blockwise_gemm_on_the_cute_kernel_is_within_the_fp32_bound(shape, out_dtype, with_bias, gen):
    """`mx_gemm: blockwise`'s GEMM on the per-column block-scaled kernel (MXFLUX_CUTE_BLOCKWISE=on's), on the
    one-pass packers' operands (1x128 scales on both): every element written and within the fp32 summation bound
    of the reference; how often it equals cuBLAS's 1x128 GEMM is printed (its promotion order is cuBLAS's own)."""
    m, n, k = shape
    a, b, bias = operands(m, n, k, G.BLOCKWISE, gen)
    bias = bias if with_bias else None
    junk = torch.full((m * n * 2,), float("nan"), device="cuda")  # an unwritten element would show as NaN
    del junk
    got = gemm_cute.cute_scaled_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, out_dtype, "fp32-bscol")
    want = scaled_gemm_reference(a.row_data, a.row_scale, b.row_data, b.row_scale, bias, out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype and not got.isnan().any()
    av, bv = dequantize_operand(a.row_data, a.row_scale), dequantize_operand(b.row_data, b.row_scale)
    assert outside_bound(got, want, summation_bound(av, bv)) == 0
    cublas = scaled_gemm_cuda(a.row_data, a.row_scale, b.row_data, b.row_scale, G.BLOCKWISE, bias, out_dtype)
    print(f"{shape} {out_dtype}: equal to cuBLAS's 1x128 GEMM {float((got == cublas).float().mean()):.5f}, to the "
          f"reference {float((got == want).float().mean()):.5f} (cuBLAS {float((cublas == want).float().mean()):.5f})")


@gpu
@needs_cuda
@needs_triton
@pytest.mark.skipif(not (gemm_cute.available() and gemm_quack.installed()),
                    reason="needs quack-kernels, CuTe DSL and a Hopper GPU")
@pytest.mark.parametrize("config", list(gemm_quack.CONFIGS))
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_quack_gemm_gives_the_row_scaled_gemms_bits(shape, config, gen):
    """MXFLUX_CUTE_KERNEL's quack schedules (our contract's epilogue on quack's GEMM with promoted sums): every
    element written, and cuBLAS's row-scaled output bit for bit, fp32 out and bf16 with a bias (what our CuTe
    kernel gives; a scale left out or the bias rounded first would differ)."""
    m, n, k = shape
    a, b, bias = operands(m, n, k, G.ROWWISE, gen)
    for out_dtype, bias_ in ((torch.float32, None), (torch.bfloat16, bias)):
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        gemm_quack.prepared_gemm(config, a.row_data, a.row_scale, b.row_data, b.row_scale, bias_, out)()
        cublas = torch._scaled_mm(a.row_data, b.row_data.t(), a.row_scale, b.row_scale.t(), bias=bias_,
                                  out_dtype=out_dtype)
        assert not out.isnan().any() and torch.equal(out, cublas)


@pytest.mark.skipif(not (gemm_cute.available() and gemm_cute.tvm_ffi_present()),
                    reason="needs CuTe DSL, apache-tvm-ffi and a Hopper GPU")
def test_both_calling_conventions_write_the_same_bits(gen):
    """The kernel called through TVM-FFI (the default where apache-tvm-ffi is installed: the torch tensors as
    they are) and through the DSL's own convention (the tensors wrapped for it): the same output, bit for bit,
    with and without a bias, bf16 and fp32 out."""
    m, n, k = SHAPES[0]
    a, b, bias = operands(m, n, k, G.ROWWISE, gen)
    for out_dtype, bias_ in ((torch.float32, None), (torch.bfloat16, bias), (torch.bfloat16, None)):
        outs = []
        for tvm_ffi in (False, True):
            out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
            gemm_cute.prepared_gemm(a.row_data, a.row_scale, b.row_data, b.row_scale, bias_, out, tvm_ffi=tvm_ffi)()
            outs.append(out)
        assert not outs[0].isnan().any() and torch.equal(*outs), (out_dtype, bias_ is not None)


def test_the_cute_gemm_takes_only_whole_clusters_of_the_kinds_named(monkeypatch):
    """Its epilogue reads each row's and column's scale unguarded: M and N must be whole clusters of tiles
    (2x1 of 128x192, or 128x256 with fast accumulation); it takes only the kinds MXFLUX_CUTE_GEMM names (bias:
    bf16 with a bias; bf16; fp32 out), and by default (auto) only GEMMs of its floor in tokens or more."""
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("all"))
    monkeypatch.setattr(gemm_cute, "available", lambda: True)
    monkeypatch.setattr(gemm_cute, "_UNUSABLE", None)
    (tm, tn), (cm, cn) = gemm_cute.CONFIG
    tm, tn = tm * cm, tn * cn  # whole clusters
    a = torch.empty(tm * 2, 64, dtype=torch.float8_e4m3fn, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # meta tensors stand in for CUDA ones
    assert gemm_cute.takes(a, torch.empty(tn, 64, device="meta"), False, bf16)
    assert not gemm_cute.takes(a, torch.empty(tn + 32, 64, device="meta"), False, bf16)
    assert not gemm_cute.takes(torch.empty(tm + 8, 64, device="meta"), torch.empty(tn, 64, device="meta"), False, bf16)
    assert not gemm_cute.takes(torch.empty(tm * 3 // 2, 64, device="meta"), torch.empty(tn, 64, device="meta"), False,
                               bf16) or cm == 1  # half a cluster
    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("bias,fp32"))
    b = torch.empty(tn, 64, device="meta")
    assert gemm_cute.takes(a, b, True, bf16) and gemm_cute.takes(a, b, False, fp32)
    assert not gemm_cute.takes(a, b, False, bf16)
    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("off"))
    assert not gemm_cute.takes(a, b, True, bf16)
    # auto (the default): every kind, from its floor in tokens: M, or the weight gradient's K
    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("auto"))
    floor = gemm_cute.CUTE_GEMM.min_tokens
    few, enough = tm * (floor // tm // 2), tm * -(-floor // tm)
    for has_bias, out_dtype in ((True, bf16), (False, bf16)):
        assert gemm_cute.takes(torch.empty(enough, 64, device="meta"), b, has_bias, out_dtype)
        assert not gemm_cute.takes(torch.empty(few, 64, device="meta"), b, has_bias, out_dtype)
    assert gemm_cute.takes(torch.empty(tm, enough, device="meta"), b, False, fp32)
    assert not gemm_cute.takes(torch.empty(enough, few, device="meta"), b, False, fp32)


def test_the_cute_gemm_refuses_a_k_its_paired_promotion_would_cut_short():
    """`fp32k2` sums K in pairs of 128-wide k-tiles; a K with a tile left over would lose its last products
    (and leave the producer a stage ahead): refused before anything is built or launched."""
    a = torch.empty(256, 384, dtype=torch.float8_e4m3fn)
    b = torch.empty(256, 384, dtype=torch.float8_e4m3fn)
    scale = torch.ones(256, 1)
    with pytest.raises(ValueError, match="fp32k2 accumulation needs K a multiple of 256, got 384"):
        gemm_cute.prepared_gemm(a, scale, b, scale, None, torch.empty(256, 256), accumulation="fp32k2")


def test_the_cute_gemm_bands_divide_the_tile_columns():
    """A band past the last tile column would read column scales past the end: the band width divides."""
    from mxflux.kernels.gemm_cute import swizzle_for

    assert [swizzle_for(n, 8) for n in (12, 36, 48, 84, 60, 7, 16)] == [4, 4, 8, 4, 4, 1, 8]
    assert swizzle_for(48, 1) == 1 and swizzle_for(48, 2) == 2
