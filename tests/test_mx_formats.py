"""Element formats: every code decodes to its table value and re-encodes to itself; ties, saturation."""

import pytest
import torch

from mxflux.mx import FORMATS, get_format
from mxflux.mx.formats import code_table
from mxflux.mx.quantize import round_to_format

E2M3_POSITIVE = (
    [k / 8 for k in range(8)]  # subnormals 0 … 0.875
    + [1 + k / 8 for k in range(8)]
    + [2 + k / 4 for k in range(8)]
    + [4 + k / 2 for k in range(8)]
)


def test_e2m3_table_is_the_ocp_grid():
    table = code_table(FORMATS["e2m3"])
    assert table[:32].tolist() == E2M3_POSITIVE
    assert table[32:].tolist() == [-v for v in E2M3_POSITIVE]


@pytest.mark.parametrize(
    "name, maximum, min_sub, emax",
    [("e2m3", 7.5, 0.125, 2), ("e3m2", 28.0, 0.0625, 4), ("e2m1", 6.0, 0.5, 2),
     ("e4m3", 448.0, 2**-9, 8), ("e5m2", 57344.0, 2**-16, 15)],
)
def test_format_table_facts(name, maximum, min_sub, emax):
    f = FORMATS[name]
    assert f.max == maximum and f.min_subnormal == min_sub and f.emax == emax
    table = code_table(f)
    assert float(table[~table.isnan()].max()) == maximum


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_code_decodes_and_reencodes_to_itself(name):
    f = FORMATS[name]
    table = code_table(f)
    codes = torch.arange(len(table))
    finite = ~table.isnan()
    again = round_to_format(table[finite], f).long()
    assert torch.equal(again, codes[finite])


@pytest.mark.parametrize("name", ["e2m3", "e3m2", "e2m1", "e4m3", "e5m2"])
def test_ties_round_to_even_at_every_tie_point(name):
    f = FORMATS[name]
    pos = code_table(f)[: f.sign_mask]
    pos = pos[~pos.isnan()]
    mids = (pos[:-1] + pos[1:]) / 2  # exact in fp32: neighbours differ by one quantum
    lo_codes = torch.arange(len(pos) - 1)
    want = torch.where(lo_codes % 2 == 0, lo_codes, lo_codes + 1)  # the even mantissa wins
    assert torch.equal(round_to_format(mids, f).long(), want)
    # Negative ties mirror, with the sign bit set.
    assert torch.equal(round_to_format(-mids, f).long(), want | f.sign_mask)
    # Just off the tie goes to the nearer neighbour.
    eps = (pos[1:] - pos[:-1]) / 64
    assert torch.equal(round_to_format(mids - eps, f).long(), lo_codes)
    assert torch.equal(round_to_format(mids + eps, f).long(), lo_codes + 1)


@pytest.mark.parametrize("name", ["e2m3", "e3m2", "e2m1", "e4m3"])
def test_saturates_at_max(name):
    f = FORMATS[name]
    big = torch.tensor([f.max, f.max * 1.01, f.max * 1.2, 1e30, float("inf")])
    codes = round_to_format(torch.cat([big, -big]), f)
    values = code_table(f)[codes.long()]
    assert values[:5].tolist() == [f.max] * 5
    assert values[5:].tolist() == [-f.max] * 5


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="fmt: unknown element format 'e9m9'"):
        get_format("e9m9")


def test_fold_window_facts():
    # docs/design.md, "The exact FP8 fold and its window": E2M3 folds with shift 5 and an 11-binade window.
    assert FORMATS["e2m3"].fold_shift == 5 and FORMATS["e2m3"].fold_window == 11
    assert FORMATS["e3m2"].fold_shift == 4 and FORMATS["e3m2"].fold_window == 9
    assert FORMATS["e2m1"].fold_shift == 6 and FORMATS["e2m1"].fold_window == 14
    assert FORMATS["e5m2"].fold_shift is None
