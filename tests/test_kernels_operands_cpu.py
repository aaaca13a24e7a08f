"""The compiled CPU packer (numba) against the reference packer, bit for bit.

The training path on the CPU runs `mx_operands_cpu` (the mx_operands op's CPU implementation), so it must equal
`mx_operands_reference` exactly: E4M3 data and fp32 scales of both orientations, the out-of-window
count, and the column sums. Outputs are poisoned (0xFF) before the kernel writes.
"""

from __future__ import annotations

import pytest
import torch
from pack_inputs import DISTS, adversarial, assert_bits_equal, dev_gen, normal, ties

from mxflux.kernels.operands_cpu import HAS_NUMBA, mx_operands_cpu
from mxflux.mx import FoldGranularity as G
from mxflux.mx import mx_operands_reference
from mxflux.ops import custom_ops

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="pip install numba (a declared dependency)")

FIELDS = ("row_data", "row_scale", "col_data", "col_scale", "colsum")


def check(x, **kw):
    got = mx_operands_cpu(x, _poison=True, **kw)
    want = mx_operands_reference(x, **kw)
    for name in FIELDS:
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert got.blocks_outside_window.dtype == torch.int64 and got.blocks_outside_window.dim() == 0
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window)
    return want


@pytest.mark.parametrize("dist", sorted(DISTS))
@pytest.mark.parametrize("granularity", list(G))
@pytest.mark.parametrize("shape", [(256, 384), (777, 128), (64, 3072)])  # 777: ragged rows
def test_pack_cpu_matches_reference(shape, granularity, dist, gen):
    x = DISTS[dist](*shape, gen)
    want = check(x, granularity=granularity, colsum=True)
    if dist == "adversarial" and granularity is not G.EXACT:  # the fold's rounding branch is exercised
        assert int(want.blocks_outside_window) > 0


@pytest.mark.parametrize("fmt", ["e2m3", "e3m2", "e2m1"])
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("granularity", [G.ROWWISE, G.BLOCKWISE])
def test_pack_cpu_formats_and_rotation(fmt, hadamard, granularity, gen):
    check(adversarial(200, 256, gen), fmt=fmt, hadamard=hadamard, granularity=granularity)
    check(ties(128, 256, gen), fmt=fmt, hadamard=hadamard, granularity=granularity)


@pytest.mark.parametrize("row,col,colsum", [(True, False, False), (False, True, True), (False, False, True)])
def test_pack_cpu_single_orientation(row, col, colsum, gen):
    check(normal(100, 160, gen), row=row, col=col, colsum=colsum)


@pytest.mark.parametrize("prologue", ["gelu_tanh", "gelu_tanh_grad"])
def test_pack_cpu_prologues(prologue, gen):
    x = (3.0 * torch.randn(300, 640, generator=dev_gen(gen, "cpu"))).bfloat16()
    aux = (3.0 * torch.randn(300, 640, generator=dev_gen(gen, "cpu"))).bfloat16()
    check(x, prologue=prologue, aux=aux if prologue == "gelu_tanh_grad" else None, colsum=True)


def test_pack_cpu_float32_and_strided_input(gen):
    x = torch.randn(130, 256, generator=dev_gen(gen, "cpu")) * 1e3
    check(x, granularity=G.BLOCKWISE)
    check(x[:128].bfloat16().t(), granularity=G.ROWWISE)  # a transposed view: [256, 128]


def test_mx_operands_op_runs_the_cpu_kernel_unless_reference_is_forced(gen, monkeypatch, count_calls):
    calls = count_calls(custom_ops, "mx_operands_cpu")
    x = adversarial(96, 128, gen)
    outside = torch.zeros(1, dtype=torch.int64)
    outs = torch.ops.mxflux.mx_operands(x, None, outside, True, True, "rowwise", True, "none", True)
    want = mx_operands_reference(x, colsum=True)
    assert calls == [1]
    for got, name in zip(outs, FIELDS):
        assert_bits_equal(name, got, getattr(want, name))
    assert int(outside) == int(want.blocks_outside_window) > 0
    monkeypatch.setattr(custom_ops, "FORCE_REFERENCE", True)  # what MXFLUX_REFERENCE=1 sets at import
    torch.ops.mxflux.mx_operands(x, None, outside, True, True, "rowwise", True, "none", True)
    assert calls == [1]
    assert int(outside) == 2 * int(want.blocks_outside_window)
    assert custom_ops.use_kernels(x) is False


def test_mx_operands_op_rejects_an_unknown_granularity():
    x = torch.ones(32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"mx_gemm: expected one of \['rowwise', 'blockwise', 'exact'\], got 'row'"):
        torch.ops.mxflux.mx_operands(x, None, torch.zeros(1, dtype=torch.int64), True, True, "row", True,
                                     "none", False)


def test_mxflux_reference_env_is_read_once_at_import():
    """MXFLUX_REFERENCE=1 makes the ops use the reference (checked in a fresh interpreter)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from mxflux.ops import custom_ops as c; "
            "print(c.FORCE_REFERENCE, c.use_kernels(torch.zeros(1)))")
    env = {**os.environ, "MXFLUX_REFERENCE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_pack_cpu_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        mx_operands_cpu(torch.zeros(2, 3, 32))
    with pytest.raises(ValueError, match="fmt: .*e5m2"):
        mx_operands_cpu(torch.ones(4, 32), fmt="e5m2")
    with pytest.raises(ValueError, match="x: 48 columns"):
        mx_operands_cpu(torch.ones(4, 48))
    with pytest.raises(ValueError, match="x: 96 columns .* blockwise"):
        mx_operands_cpu(torch.ones(4, 96), granularity=G.BLOCKWISE)
    with pytest.raises(ValueError, match="granularity: expected a FoldGranularity, got 'row'"):
        mx_operands_cpu(torch.ones(4, 32), granularity="row")


def test_pack_cpu_leaves_the_input_storage_resizable(gen):
    """The kernel reads its input in place, but FSDP2 resizes the storage of the bf16 parameters it
    all-gathers after the packer has read them: reading must not pin the storage (as
    `Tensor.numpy()` would: "Trying to resize storage that is not resizable")."""
    for x in (normal(64, 96, gen), normal(64, 96, gen).float()):
        mx_operands_cpu(x.t())
        x.untyped_storage().resize_(0)
