"""The Triton MX operand packer against the reference packer, bit for bit, on small shapes.

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`),
where the FP8 and bf16 conversions are the kernel's integer emulation (HW=False). Outputs are
poisoned (0xFF: NaN in fp32 and E4M3) before the kernel writes, so an element it missed fails.
The large-shape CUDA tests are in test_operands_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, TRITON_DEVICE, assert_bits_equal, assert_colsum_close, dev_gen, triton_marks

from mxflux.kernels import mx_operands_cuda, prologue_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import apply_prologue, mx_operands_reference

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
FIELDS = ("row_data", "row_scale", "col_data", "col_scale")


def check(x, **kw):
    got = mx_operands_cuda(x, _poison=True, **kw)
    want = mx_operands_reference(x, **kw)
    for name in FIELDS:
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert got.blocks_outside_window.dtype == torch.int64 and got.blocks_outside_window.dim() == 0
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)
    if kw.get("colsum"):
        assert_colsum_close(got.colsum, want.colsum, x)
    return want


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("dist", ["normal", "adversarial"])
def test_packer_matches_reference(granularity, dist, gen):
    x = DISTS[dist](200, 256, gen, DEVICE)  # 200 rows: the col orientation is zero-padded
    want = check(x, granularity=granularity, colsum=True)
    if dist == "adversarial" and granularity is not G.EXACT:
        assert int(want.blocks_outside_window) > 0  # the out-of-window rounding was exercised


@pytest.mark.parametrize("hadamard", [True, False])
def test_packer_single_orientation_and_rotation(hadamard, gen):
    x = DISTS["adversarial"](96, 160, gen, DEVICE)
    check(x, row=True, col=False, hadamard=hadamard)
    check(x, row=False, col=True, hadamard=hadamard, granularity=G.EXACT)


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("io", ["coalesced", "blocks"])
def test_packer_odd_row_count(granularity, io, gen, monkeypatch):
    """Blocks are stored by pairs of rows (and of columns): an odd row count leaves the last
    row without a partner, whose half of the paired store must write nothing."""
    monkeypatch.setenv("MXFLUX_PACK_IO", io)
    x = DISTS["adversarial"](33, 256 if granularity is G.BLOCKWISE else 160, gen, DEVICE)  # a partial column tile
    check(x, granularity=granularity, colsum=True)
    check(x[1:], granularity=granularity, row=True, col=False)  # 32 rows: every pair whole


@pytest.mark.parametrize("granularity", [G.ROWWISE, G.BLOCKWISE], ids=lambda g: g.value)
def test_packer_own_block_stores(granularity, gen, monkeypatch):
    """The store variant a plan falls back to when the compiled layout cannot pair lanes."""
    from mxflux.kernels import operands_cuda, operands_plan

    operands_cuda.clear_launch_plans()
    monkeypatch.setattr(operands_cuda, "_paired_stores_hold", lambda plan, args: False)
    check(DISTS["adversarial"](33, 256, gen, DEVICE), granularity=granularity, colsum=True)
    assert all(p.meta["PAIRS"] is False for p in operands_plan._PLANS.values())
    operands_cuda.clear_launch_plans()


def fp32_weights(r, c, gen, device):
    """fp32 values whose bf16 rounding is the adversarial packer input, plus what only fp32 has:
    low mantissa bits (ties to even included), values that round up to bf16's Inf, fp32-only
    subnormals, NaN and -0."""
    g = dev_gen(gen, device)
    x = DISTS["adversarial"](r, c, gen, device).float()
    low = torch.randint(0, 1 << 16, x.shape, generator=g, device=device, dtype=torch.int32)
    low = torch.where(torch.rand(x.shape, generator=g, device=device) < 0.1, torch.full_like(low, 0x8000), low)
    x = (x.view(torch.int32) | low).view(torch.float32)  # NaN/Inf stay NaN/Inf-or-NaN
    x[0, :8] = torch.tensor([3.4e38, -3.4e38, 1e-41, -1e-41, -0.0, float("nan"), float("inf"), 2.0**-133])
    return x


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("io", ["coalesced", "blocks"])
def test_packer_reads_fp32_as_its_bf16_rounding(granularity, io, gen, monkeypatch):
    """fp32 master weights go into the packer directly: the operands equal packing
    x.to(torch.bfloat16), bit for bit, on either tile-reading variant."""
    monkeypatch.setenv("MXFLUX_PACK_IO", io)
    x = fp32_weights(96, 256, gen, DEVICE)
    got = mx_operands_cuda(x, granularity=granularity, colsum=True, _poison=True)
    want = mx_operands_reference(x.to(torch.bfloat16), granularity=granularity, colsum=True)
    for name in FIELDS:
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)
    assert_colsum_close(got.colsum, want.colsum, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="x: mx_operands_cuda reads torch.bfloat16, got torch.float32"):
        mx_operands_cuda(x, prologue="gelu_tanh")


@pytest.mark.parametrize("prologue", ["gelu_tanh", "gelu_tanh_grad"])
def test_packer_prologue_equals_packing_the_kernels_activation(prologue, gen):
    g = dev_gen(gen, DEVICE)
    x = (3.0 * torch.randn(64, 128, generator=g, device=DEVICE)).bfloat16()
    aux = (3.0 * torch.randn(64, 128, generator=g, device=DEVICE)).bfloat16() if prologue == "gelu_tanh_grad" else None
    v = prologue_cuda(x, prologue, aux)
    # torch's tanh may differ from the kernel's by an ulp now and then (test_operands_cuda.py
    # counts how often on the GPU); the packer must equal packing the kernel's own activation
    err = (v.float() - apply_prologue(x, prologue, aux).float()).abs()
    assert float(err.max()) <= 2.0**-6 * float(v.float().abs().max())
    got = mx_operands_cuda(x, prologue=prologue, aux=aux, colsum=True, _poison=True)
    want = mx_operands_reference(v, colsum=True)
    for name in FIELDS:
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)
    assert_colsum_close(got.colsum, want.colsum, v)

