"""`pack_cuda(..., counter=c)`: the kernels add the blocks outside the fold window straight into
the caller's counter (the custom op's path), with the same outputs as without it.

Runs on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, small shapes)."""

from __future__ import annotations

import pytest
import torch

from pack_inputs import INTERPRETED, TRITON_DEVICE, adversarial, assert_bits_equal, triton_marks

from mxflux.kernels import pack_cuda
from mxflux.ops.pack_reference import pack_reference

DEVICE = TRITON_DEVICE
pytestmark = triton_marks()
SHAPE = (96, 128) if INTERPRETED else (1000, 3072)


@pytest.mark.parametrize("granularity", ["row", 128])  # 32: every block its own scale, none outside
def test_counter_accumulates_what_n_inexact_reports(granularity, gen):
    xs = [adversarial(*SHAPE, gen, DEVICE) for _ in range(2)]
    want = [pack_reference(x, granularity=granularity, colsum=True) for x in xs]
    assert sum(int(w.n_inexact) for w in want) > 0  # the inputs do leave the window
    counter = torch.full((1,), 7, dtype=torch.int64, device=DEVICE)
    for x, w in zip(xs, want):
        got = pack_cuda(x, granularity=granularity, colsum=True, counter=counter, _poison=True)
        for name in ("row_data", "row_scale", "col_data", "col_scale"):
            assert_bits_equal(name, getattr(got, name), getattr(w, name))
        assert got.n_inexact is counter
    assert int(counter) == 7 + sum(int(w.n_inexact) for w in want)


def test_bad_counter_is_named(gen):
    x = adversarial(*SHAPE, gen, DEVICE)
    for bad in (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match="counter"):
            pack_cuda(x, counter=bad)
