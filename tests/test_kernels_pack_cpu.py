"""The compiled CPU packer (numba) against the reference packer, bit for bit.

The training path on the CPU runs `pack_cpu` (mx_pack's CPU implementation), so it must equal
`pack_reference` exactly: E4M3 data and fp32 scales of both orientations, the out-of-window
count, and the column sums. Outputs are poisoned (0xFF) before the kernel writes.
"""

from __future__ import annotations

import pytest
import torch
from pack_inputs import DISTS, adversarial, assert_bits_equal, dev_gen, normal, ties

import mxflux.kernels.pack_numba as pack_numba
from mxflux.kernels.pack_numba import HAS_NUMBA, cpu_kernel_available, pack_cpu
from mxflux.ops import custom_ops
from mxflux.ops.pack_reference import pack_reference

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="pip install numba (a declared dependency)")

FIELDS = ("row_data", "row_scale", "col_data", "col_scale", "colsum")


def check(x, **kw):
    got = pack_cpu(x, _poison=True, **kw)
    want = pack_reference(x, **kw)
    for name in FIELDS:
        assert_bits_equal(name, getattr(got, name), getattr(want, name))
    assert got.n_inexact.dtype == torch.int64 and got.n_inexact.dim() == 0
    assert int(got.n_inexact) == int(want.n_inexact)
    return want


@pytest.mark.parametrize("dist", sorted(DISTS))
@pytest.mark.parametrize("granularity", ["row", 128, 32])
@pytest.mark.parametrize("shape", [(256, 384), (777, 128), (64, 3072)])  # 777: ragged rows
def test_pack_cpu_matches_reference(shape, granularity, dist, gen):
    x = DISTS[dist](*shape, gen)
    want = check(x, granularity=granularity, colsum=True)
    if dist == "adversarial" and granularity != 32:  # the fold's rounding branch is exercised
        assert int(want.n_inexact) > 0


@pytest.mark.parametrize("fmt", ["e2m3", "e3m2", "e2m1"])
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("granularity", ["row", 128])
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
    check(x, granularity=128)
    check(x[:128].bfloat16().t(), granularity="row")  # a transposed view: [256, 128]


def test_mx_pack_op_runs_the_cpu_kernel_unless_reference_is_forced(gen, monkeypatch):
    calls = []

    def counting(*args, **kw):
        calls.append(1)
        return pack_cpu(*args, **kw)

    monkeypatch.setattr(pack_numba, "pack_cpu", counting)
    x = adversarial(96, 128, gen)
    counter = torch.zeros(1, dtype=torch.int64)
    outs = torch.ops.mxflux.mx_pack(x, None, counter, True, True, 0, True, "none", True)
    want = pack_reference(x, colsum=True)
    assert calls == [1]
    for got, name in zip(outs, FIELDS):
        assert_bits_equal(name, got, getattr(want, name))
    assert int(counter) == int(want.n_inexact)
    monkeypatch.setenv("MXFLUX_REFERENCE", "1")
    assert not cpu_kernel_available()
    torch.ops.mxflux.mx_pack(x, None, counter, True, True, 0, True, "none", True)
    assert calls == [1]
    assert custom_ops.use_kernels(x) is False


def test_pack_cpu_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        pack_cpu(torch.zeros(2, 3, 32))
    with pytest.raises(ValueError, match="fmt: .*e5m2"):
        pack_cpu(torch.ones(4, 32), fmt="e5m2")
    with pytest.raises(ValueError, match="x: 48 columns"):
        pack_cpu(torch.ones(4, 48))
