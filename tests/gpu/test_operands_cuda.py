"""The Triton MX operand packers against the reference packer, bit for bit (CUDA only; skipped
elsewhere; test_operands_interpreted.py runs small cases under Triton's CPU interpreter).

Every comparison runs `mx_operands_reference` on the same CUDA device. Outputs are poisoned (0xFF bytes:
NaN in fp32 and in E4M3) before the kernels write, so an element no kernel wrote fails the exact
comparison. colsum is compared to fp32 summation-order tolerance; the tanh-GELU prologues to the
kernel's own bf16 activation (bit for bit) and to torch's (fraction of differing activations).
"""

from __future__ import annotations

import math

import pytest
import torch

from pack_inputs import DISTS, adversarial, assert_bits_equal, assert_colsum_close, dev_gen, normal, ties

from mxflux.kernels import cuda_kernel_available, mx_operands_cuda, prologue_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import apply_prologue, mx_operands_reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not cuda_kernel_available(), reason="needs Triton and a CUDA device")

FLUX_SHAPES = [(4096, 3072), (4096, 12288), (4096, 15360)]
RAGGED_SHAPES = [(1000, 3072), (4100, 3072), (777, 3104)]  # R not /32 or /128; C /32 but not /128


def check(x, **kw):
    """mx_operands_cuda (poisoned outputs) against mx_operands_reference on the same device."""
    got = mx_operands_cuda(x, _poison=True, **kw)
    want = mx_operands_reference(x, **kw)
    for name in ("row_data", "row_scale", "col_data", "col_scale"):
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert got.blocks_outside_window.dtype == torch.int64 and got.blocks_outside_window.dim() == 0
    assert got.blocks_outside_window.device == x.device
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)
    if kw.get("colsum"):
        assert_colsum_close(got.colsum, want.colsum, apply_prologue(x, kw.get("prologue", "none"), kw.get("aux")))
    else:
        assert got.colsum is None
    return got, want


# ------------------------------------------------------------------ packer vs reference
@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("pairs", [True, False], ids=["lane-pair-stores", "own-block-stores"])
@pytest.mark.parametrize("prologue", ["none", "gelu_tanh"])
@pytest.mark.parametrize("granularity", list(G))
def test_pack_store_variants(granularity, prologue, pairs, gen, monkeypatch):
    """Both ways pass 2 stores its blocks, bit for bit, at an odd row count (the last row has
    no partner lane); launches on this GPU must get the lane-pair stores (PAIRS), the fast ones."""
    from mxflux.kernels import operands_cuda, operands_plan

    operands_cuda.clear_launch_plans()
    if not pairs:
        monkeypatch.setattr(operands_cuda, "_paired_stores_hold", lambda plan, args: False)
    x = DISTS["adversarial"](1001, 3072, gen, "cuda")
    check(x, granularity=granularity, prologue=prologue, colsum=True)
    check(x, granularity=granularity, prologue=prologue, row=False)
    if granularity is not G.BLOCKWISE:  # 2976 columns: a partial column tile (1x128 groups must tile C)
        check(x[:, 96:], granularity=granularity, prologue=prologue, col=False)
    plans = list(operands_plan._PLANS.values())
    assert plans and all(p.pairs_checked and p.meta["PAIRS"] is pairs for p in plans)
    operands_cuda.clear_launch_plans()


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("shape", FLUX_SHAPES + RAGGED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("dist", list(DISTS))
def test_pack_matches_reference(shape, granularity, dist, gen):
    r, c = shape
    x = DISTS[dist](r, c, gen, "cuda")
    if granularity is G.BLOCKWISE and c % 128:  # the row orientation's 1x128 groups must tile C
        with pytest.raises(ValueError):
            mx_operands_reference(x, granularity=G.BLOCKWISE)
        with pytest.raises(ValueError, match="granularity"):
            mx_operands_cuda(x, granularity=G.BLOCKWISE)
        return
    _, want = check(x, granularity=granularity, colsum=True)
    if dist == "adversarial" and granularity is not G.EXACT:  # (per-block scales are always exact)
        assert int(want.blocks_outside_window) > 0  # the out-of-window path was exercised


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("dist", ["ties", "adversarial"])
def test_pack_without_rotation_and_ties(granularity, hadamard, dist, gen):
    x = (ties if dist == "ties" else adversarial)(512, 1024, gen, "cuda")
    check(x, granularity=granularity, hadamard=hadamard, colsum=True)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("row,col,colsum", [(True, False, False), (False, True, False), (False, False, True),
                                            (True, False, True), (False, True, True)])
@pytest.mark.parametrize("granularity", [G.ROWWISE, G.EXACT])
def test_pack_single_orientation(row, col, colsum, granularity, gen):
    x = adversarial(300, 640, gen, "cuda")
    check(x, row=row, col=col, colsum=colsum, granularity=granularity)


@gpu
@needs_cuda
@needs_triton
def test_pack_strided_input(gen):
    base = normal(640, 4096, gen, "cuda")
    x = base[::2, 1024:3072]  # row stride 4096, contiguous along C
    check(x, granularity=G.ROWWISE, colsum=True)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("io", ["coalesced", "blocks"])
@pytest.mark.parametrize("granularity", list(G))
def test_pack_both_io_variants(io, granularity, gen, monkeypatch):
    """Both ways of reading a tile (MXFLUX_PACK_IO) give the same bits, with and without a prologue."""
    monkeypatch.setenv("MXFLUX_PACK_IO", io)
    x = adversarial(300, 640, gen, "cuda")
    check(x, granularity=granularity, colsum=True)
    y = (3.0 * torch.randn(300, 640, generator=dev_gen(gen, "cuda"), device="cuda")).bfloat16()
    aux = (3.0 * torch.randn(300, 640, generator=dev_gen(gen, "cuda"), device="cuda")).bfloat16()
    v = prologue_cuda(y, "gelu_tanh_grad", aux)
    got = mx_operands_cuda(y, granularity=granularity, prologue="gelu_tanh_grad", aux=aux, colsum=True, _poison=True)
    want = mx_operands_reference(v, granularity=granularity, colsum=True)
    for name in ("row_data", "row_scale", "col_data", "col_scale"):
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)


# ------------------------------------------------------------------ prologues
GELU_MISMATCH_BOUND = 1e-3  # measured fraction is recorded in benchmarks/RESULTS.md


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("shape", [(3072, 9216), (12288, 3072), (1000, 3104)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_pack_fp32_master_weights(shape, gen):
    """fp32 weights are packed as their bf16 rounding, bit for bit, at Flux weight shapes."""
    g = dev_gen(gen, "cuda")
    w = torch.randn(shape, generator=g, device="cuda") * 0.02
    w[::7] *= 2.0**-20  # rows far below the others: the fold window is exercised
    w.view(torch.int32)[:, 1::5] |= 0x8000  # bf16 ties and above-half low bits
    got = mx_operands_cuda(w, colsum=True, _poison=True)
    want = mx_operands_reference(w.to(torch.bfloat16), colsum=True)
    for name in ("row_data", "row_scale", "col_data", "col_scale"):
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("prologue", ["gelu_tanh", "gelu_tanh_grad"])
@pytest.mark.parametrize("granularity", list(G))
def test_pack_prologues(prologue, granularity, gen):
    r, c = 1024, 3072
    x = (3.0 * torch.randn(r, c, generator=gen)).bfloat16().cuda()
    aux = (3.0 * torch.randn(r, c, generator=gen)).bfloat16().cuda() if prologue == "gelu_tanh_grad" else None
    v_kernel = prologue_cuda(x, prologue, aux)
    v_torch = apply_prologue(x, prologue, aux)
    differ = float((v_kernel.view(torch.int16) != v_torch.view(torch.int16)).float().mean())
    print(f"{prologue}: {differ:.2e} of bf16 activations differ from torch's")
    assert differ <= GELU_MISMATCH_BOUND
    # the fused packer == the reference packer applied to the kernel's own activation, bit for bit
    got = mx_operands_cuda(x, granularity=granularity, prologue=prologue, aux=aux, colsum=True, _poison=True)
    want = mx_operands_reference(v_kernel, granularity=granularity, colsum=True)
    for name in ("row_data", "row_scale", "col_data", "col_scale"):
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)
    assert_colsum_close(got.colsum, want.colsum, v_kernel)
    # ... and == the reference with torch's prologue wherever a row's / column's activations agree
    ref = mx_operands_reference(x, granularity=granularity, prologue=prologue, aux=aux)
    same = v_kernel.view(torch.int16) == v_torch.view(torch.int16)
    rows_ok = same.all(dim=1)
    cols_ok = same.all(dim=0)
    assert torch.equal(got.row_data.view(torch.uint8)[rows_ok], ref.row_data.view(torch.uint8)[rows_ok])
    assert torch.equal(got.col_data.view(torch.uint8)[cols_ok], ref.col_data.view(torch.uint8)[cols_ok])


@gpu
@needs_cuda
@needs_triton
def test_prologue_padding_and_ragged_rows(gen):
    x = (2.0 * torch.randn(1001, 640, generator=gen)).bfloat16().cuda()
    aux = torch.randn(1001, 640, generator=gen).bfloat16().cuda()
    v = prologue_cuda(x, "gelu_tanh_grad", aux)
    got = mx_operands_cuda(x, prologue="gelu_tanh_grad", aux=aux, colsum=True, _poison=True)
    want = mx_operands_reference(v, colsum=True)
    for name in ("row_data", "row_scale", "col_data", "col_scale"):
        assert_bits_equal(name, getattr(got, name), getattr(want, name))


# ------------------------------------------------------------------ hardware conversions
def _primitive_kernel():
    import triton
    import triton.language as tl

    from mxflux.kernels import operands_device as P
    from mxflux.kernels.triton_common import f32_to_e4m3

    @triton.jit
    def kern(x_ptr, f_ptr, o1h, o1s, o2h, o2s, n, BLOCK: tl.constexpr):
        """Per word w: x[4w .. 4w+3] (y·2^-e, byte order) and the f16 bits of F: the E4M3 casts of
        x[4w] both ways, and the folded word both ways: `_ENCODE4` (the GPU's inline asm) and the
        emulation `_encode_words` runs under the interpreter (`f32_to_e4m3` + `_refold`)."""
        w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = w < n
        v0 = tl.load(x_ptr + 4 * w, mask=m, other=0.0)
        v1 = tl.load(x_ptr + 4 * w + 1, mask=m, other=0.0)
        v2 = tl.load(x_ptr + 4 * w + 2, mask=m, other=0.0)
        v3 = tl.load(x_ptr + 4 * w + 3, mask=m, other=0.0)
        tl.store(o1h + w, f32_to_e4m3(v0, True), mask=m)
        tl.store(o1s + w, f32_to_e4m3(v0, False), mask=m)
        fb = tl.load(f_ptr + w, mask=m, other=0)
        word_hw = tl.inline_asm_elementwise(P._ENCODE4, "=r,r,r,r,r,r", [v0, v1, v2, v3, fb | (fb << 16)],
                                            dtype=tl.int32, is_pure=True, pack=1)
        fb2 = tl.join(fb, fb)
        lo0, hi0 = tl.split(P._refold(f32_to_e4m3(tl.join(v0, v1), False), fb2))
        lo1, hi1 = tl.split(P._refold(f32_to_e4m3(tl.join(v2, v3), False), fb2))
        word_emu = ((lo0.to(tl.int32) | (hi0.to(tl.int32) << 8))
                    | ((lo1.to(tl.int32) | (hi1.to(tl.int32) << 8)) << 16))
        tl.store(o2h + w, word_hw, mask=m)
        tl.store(o2s + w, word_emu, mask=m)

    return kern


@gpu
@needs_cuda
@needs_triton
def test_hardware_conversions_equal_their_emulation(gen):
    """The GPU path's E4M3 casts and its word encoding (`_ENCODE4`: E2M3 rounding, f16x2 saturate
    and re-scale, E4M3 again, bytes merged) against the integer emulation the interpreter runs."""
    g = dev_gen(gen, "cuda")
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 22,), generator=g, device="cuda", dtype=torch.int64).to(torch.int32)
    every_e4m3 = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    x = torch.cat([bits.view(torch.float32),
                   torch.linspace(-0.2, 0.2, 1 << 20, device="cuda"),
                   torch.linspace(-500.0, 500.0, 1 << 16, device="cuda"),
                   every_e4m3 * 2.0**-6, (every_e4m3 * 2.0**-6).roll(1),  # every code of the E2M3 grid
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, 448.0, 464.0, 480.0, 2.0**-10, -2.0**-10,
                                 3 * 2.0**-11, 2.0**-130], device="cuda")])
    x = x[~x.isnan()]
    x = torch.cat([x, torch.zeros(-x.numel() % 4, device="cuda")])
    n = x.numel() // 4
    k = torch.arange(n, device="cuda", dtype=torch.int32) % 64 - 50  # F = 2^k, k in [-50, 13]
    fb = torch.where(k >= -14, (k + 15) << 10, torch.where(k >= -24, 1 << (k + 24).clamp(min=0), 0))
    fb = torch.where(k == 13, 0x7E00, fb)  # NaN factor (NaN blocks)
    outs = [torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    outs += [torch.full((n,), -1, dtype=torch.int32, device="cuda") for _ in range(2)]  # poisoned
    _primitive_kernel()[(-(-n // 1024),)](x, fb, *outs, n, BLOCK=1024)
    assert torch.equal(outs[0], outs[1]), "f32 -> e4m3"
    assert torch.equal(outs[2], outs[3]), "word encoding (_ENCODE4) against its emulation"
    # and the cast agrees with torch's (round to nearest even) where torch does not overflow
    x0 = x[0::4]
    fin = x0.abs() <= 448
    assert torch.equal(outs[0][fin], x0[fin].to(torch.float8_e4m3fn).view(torch.uint8))


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("granularity", [G.ROWWISE, G.EXACT])
def test_emulated_path_on_gpu_matches(granularity, gen):
    """The integer-emulation kernels (what the CPU interpreter runs) also match on the GPU."""
    x = adversarial(300, 640, gen, "cuda")
    got = mx_operands_cuda(x, granularity=granularity, _hw=False, _poison=True)
    want = mx_operands_reference(x, granularity=granularity)
    for name in ("row_data", "row_scale", "col_data", "col_scale"):
        assert_bits_equal(name, getattr(got, name), getattr(want, name))


# ------------------------------------------------------------------ errors and CPU behaviour
@gpu
@needs_cuda
@needs_triton
def test_pack_errors_name_the_argument():
    x = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="fmt"):
        mx_operands_cuda(x, fmt="e3m2")
    with pytest.raises(ValueError, match="granularity"):
        mx_operands_cuda(x, granularity=128)
    with pytest.raises(ValueError, match="x: mx_operands_cuda reads torch.bfloat16 or torch.float32, got torch.float16"):
        mx_operands_cuda(x.half())
    with pytest.raises(ValueError, match="x: mx_operands_cuda reads torch.bfloat16, got torch.float32"):
        mx_operands_cuda(x.float(), prologue="gelu_tanh")
    with pytest.raises(ValueError, match="x"):
        mx_operands_cuda(torch.zeros(64, 48, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="aux"):
        mx_operands_cuda(x, prologue="gelu_tanh_grad")
    with pytest.raises(ValueError, match="prologue"):
        mx_operands_cuda(x, prologue="relu")
    with pytest.raises(ValueError, match="x"):
        mx_operands_cuda(x.cpu())


def test_import_without_cuda_is_clean():
    import mxflux.kernels as k

    if not k.cuda_kernel_available():
        with pytest.raises(RuntimeError, match="mx_operands_cuda"):
            k.mx_operands_cuda(torch.zeros(32, 32, dtype=torch.bfloat16))
