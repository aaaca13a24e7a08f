"""Saved-operand compaction (`mxflux.mx.compact`): a bijection on every block the packers write.

Round trips run on fresh packer outputs of the adversarial inputs (blocks outside the fold window,
zero and −0 blocks, NaN blocks, E8M0-clamped blocks) for every granularity; arbitrary bytes are
either kept exactly or poisoned to NaN, never changed into other numbers.
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, assert_bits_equal, dev_gen

from mxflux.mx import FoldGranularity as G
from mxflux.mx import SHIFT_NAN, compact_operand, compactable_blocks, expand_operand, mx_operands_reference
from mxflux.mx.formats import code_table, get_format


def _u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("dist", ["normal", "adversarial"])
def test_round_trip_is_exact_on_packer_outputs(granularity, dist, gen):
    x = DISTS[dist](200, 256, gen)
    p = mx_operands_reference(x, granularity=granularity)
    for name in ("col_data", "row_data"):  # both orientations are folded operands
        data = getattr(p, name)
        packed, shifts = compact_operand(data)
        c, rp = data.shape
        assert packed.shape == (c, 3 * rp // 4) and shifts.shape == (c, rp // 32)
        assert packed.dtype == shifts.dtype == torch.uint8
        assert bool(compactable_blocks(data).all())
        assert_bits_equal(name, expand_operand(packed, shifts), data)
        nan_blocks = torch.isnan(data.float()).reshape(c, -1, 32).all(dim=-1)
        assert torch.equal(shifts == SHIFT_NAN, nan_blocks)  # NaN blocks are the only poisoned ones
    if dist == "adversarial":
        assert int(p.blocks_outside_window) > 0 or granularity is G.EXACT
        assert bool(torch.isnan(p.col_data.float()).any())


def test_why_every_folded_block_is_representable(gen):
    """The docstring's cases, one by one: in-window blocks q·2^(d+5) (shift t = d + 5 when
    max|q| >= 4), blocks at E8M0's clamp (max|q| < 4), out-of-window blocks (multiples of 2^-9 below
    2^-4), zero and −0 blocks, NaN blocks."""
    g = dev_gen(gen, "cpu")
    vals = code_table(get_format("e2m3"))  # code -> value, sign included
    for d in range(-11, 1):
        codes = torch.randint(0, 64, (16, 32), generator=g)
        codes[:, 0] = torch.randint(24, 32, (16,), generator=g)  # max|q| in [4, 7.5]
        data = (vals[codes] * 2.0 ** (d + 5)).to(torch.float8_e4m3fn)
        packed, shifts = compact_operand(data)
        assert bool((shifts.int() - 9 == d + 5).all())  # t = d + s: the codes are the MX codes
        assert_bits_equal(f"d={d}", expand_operand(packed, shifts), data)
    clamped = (vals[torch.randint(0, 24, (16, 32), generator=g)] * 2.0**5).to(torch.float8_e4m3fn)
    outside = (torch.randint(-30, 31, (16, 32), generator=g) * 2.0**-9).to(torch.float8_e4m3fn)
    signed_zeros = torch.where(torch.rand(16, 32, generator=g) < 0.5, -0.0, 0.0).to(torch.float8_e4m3fn)
    nan = torch.full((16, 32), float("nan")).to(torch.float8_e4m3fn)
    for name, data in (("clamped", clamped), ("outside", outside), ("zeros", signed_zeros), ("nan", nan)):
        assert bool(compactable_blocks(data).all()), name
        assert_bits_equal(name, expand_operand(*compact_operand(data)), data)
    assert bool((compact_operand(nan)[1] == SHIFT_NAN).all())


def test_unrepresentable_blocks_become_nan_never_other_numbers(gen):
    g = dev_gen(gen, "cpu")
    b = torch.randint(0, 256, (64, 256), dtype=torch.uint8, generator=g)
    b.view(64, 8, 32)[:, ::2] &= 0x83  # half the blocks: subnormals m·2^-9, m <= 3 (representable)
    data = b.view(torch.float8_e4m3fn)
    ok = compactable_blocks(data)
    assert 0 < int(ok.sum()) < ok.numel()
    packed, shifts = compact_operand(data)
    back = _u8(expand_operand(packed, shifts)).reshape(64, 8, 32)
    same = (back == b.reshape(64, 8, 32)).all(dim=-1)
    assert torch.equal(same, ok | (b.reshape(64, 8, 32) == 0x7F).all(dim=-1))
    assert bool((back[~ok] == 0x7F).all()) and bool((shifts[~ok] == SHIFT_NAN).all())
    assert bool((packed.reshape(64, 8, 24)[~ok] == 0).all())  # poisoned blocks are canonical


def test_a_nan_byte_among_numbers_poisons_its_block():
    data = torch.ones(1, 64).to(torch.float8_e4m3fn)
    _u8(data)[0, 3] = 0xFF  # −NaN in one element of block 0
    packed, shifts = compact_operand(data)
    assert shifts.tolist() == [[SHIFT_NAN, 7]]  # 1.0 = code 4.0 · 2^(7 - 9): S = 7
    assert bool((_u8(expand_operand(packed, shifts))[0, :32] == 0x7F).all())


def test_bad_inputs_name_the_tensor():
    with pytest.raises(ValueError, match="data: expected a float8_e4m3fn"):
        compact_operand(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="data: expected a 2-D"):
        compact_operand(torch.zeros(4, 48).to(torch.float8_e4m3fn))
    packed, shifts = compact_operand(torch.zeros(4, 64).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="packed: expected shape"):
        expand_operand(packed[:, :24], shifts)
    with pytest.raises(ValueError, match="shifts: expected a 2-D uint8"):
        expand_operand(packed, shifts.int())
