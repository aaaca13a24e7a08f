"""The Triton compact / expand kernels against `mxflux.mx.compact`, bit for bit, on small shapes.

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`), where
the FP8 conversions are the kernels' integer emulation (HW=False). Outputs are poisoned before the
kernels write, so a byte they missed fails. Large shapes and the hardware-vs-emulation check are in
test_compact_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, TRITON_DEVICE, assert_bits_equal, dev_gen, triton_marks

from mxflux.kernels import compact_operand_cuda, expand_operand_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import compact_operand, expand_operand, mx_operands_reference

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE


def check(data):
    packed, shifts = compact_operand_cuda(data, _poison=True)
    want_packed, want_shifts = compact_operand(data)
    assert_bits_equal("packed", packed, want_packed)
    assert_bits_equal("shifts", shifts, want_shifts)
    assert_bits_equal("expanded", expand_operand_cuda(want_packed, want_shifts, _poison=True),
                      expand_operand(want_packed, want_shifts))


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
def test_kernels_match_reference_on_packer_outputs(granularity, gen):
    x = DISTS["adversarial"](200, 96, gen, DEVICE)  # col operand [96, 224]: 7 blocks a row
    data = mx_operands_reference(x, row=False, granularity=granularity).col_data
    check(data)
    packed, shifts = compact_operand_cuda(data)
    assert_bits_equal("round trip", expand_operand_cuda(packed, shifts), data)


def test_kernels_match_reference_on_arbitrary_bytes(gen):
    """Unrepresentable blocks, NaN bytes among numbers, and representable ones side by side; 45
    rows of 3 blocks: the last program is partly masked."""
    g = dev_gen(gen, DEVICE)
    b = torch.randint(0, 256, (45, 96), dtype=torch.uint8, generator=g, device=DEVICE)
    b.view(45, 3, 32)[:, 1] &= 0x83
    b.view(45, 3, 32)[::3, 2] = 0x7F
    check(b.view(torch.float8_e4m3fn))


def test_bad_input_names_the_tensor():
    with pytest.raises(ValueError, match="data: expected a float8_e4m3fn"):
        compact_operand_cuda(torch.zeros(4, 32, device=DEVICE))
    packed, shifts = compact_operand_cuda(torch.zeros(4, 64, device=DEVICE).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="packed: expected shape"):
        expand_operand_cuda(packed[:, :24], shifts)
