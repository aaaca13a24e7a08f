"""The compact / expand kernels on an H200-sized operand: hardware conversions against the
reference and against the kernels' own integer emulation (the form the interpreter tests run),
and the round trip on a Flux-width activation. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, assert_bits_equal

from mxflux.kernels import compact_operand_cuda, expand_operand_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import compact_operand, expand_operand, mx_operands_reference
from mxflux.ops import compact_operand as compact_op
from mxflux.ops import expand_operand as expand_op
from mxflux.ops import mx_operands

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("dist", ["normal", "adversarial"])
def test_hardware_equals_reference_and_emulation(granularity, dist, gen):
    x = DISTS[dist](4000, 1024, gen, "cuda")
    data = mx_operands_reference(x, row=False, granularity=granularity).col_data
    want_packed, want_shifts = compact_operand(data)
    for hw in (True, False):
        packed, shifts = compact_operand_cuda(data, _hw=hw, _poison=True)
        assert_bits_equal(f"packed hw={hw}", packed, want_packed)
        assert_bits_equal(f"shifts hw={hw}", shifts, want_shifts)
        out = expand_operand_cuda(want_packed, want_shifts, _hw=hw, _poison=True)
        assert_bits_equal(f"expanded hw={hw}", out, data)
    assert_bits_equal("reference expand", expand_operand(want_packed, want_shifts), data)


def test_arbitrary_bytes_hardware_equals_reference(gen):
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    b = torch.randint(0, 256, (3000, 512), dtype=torch.uint8, generator=g, device="cuda")
    b.view(3000, 16, 32)[:, ::2] &= 0x83
    data = b.view(torch.float8_e4m3fn)
    want = compact_operand(data)
    got = compact_operand_cuda(data, _poison=True)
    assert_bits_equal("packed", got[0], want[0])
    assert_bits_equal("shifts", got[1], want[1])
    assert_bits_equal("expanded", expand_operand_cuda(*want, _poison=True), expand_operand(*want))


def test_custom_ops_round_trip_under_compile(gen):
    x = DISTS["adversarial"](8192, 3072, gen, "cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")

    def f(x):
        _, _, cd, cs, _ = mx_operands(x, None, counter, False, True, "rowwise", True, "none", False)
        packed, shifts = compact_op(cd)
        return cd, expand_op(packed, shifts)

    cd, back = torch.compile(f, fullgraph=True)(x)
    assert_bits_equal("round trip", back, cd)
