"""When an MX layer uses what the optimizer step keeps of its weight (`MXFP6Linear.kept_weight_state`),
and the e_ref buffer layout (CPU; the kernels that fill and read the buffers, and `nn.MXWeightState`
around them, are tested in tests/gpu/test_weight_erefs.py)."""

from __future__ import annotations

import pytest
import torch

from mxflux.kernels import weight_erefs
from mxflux.nn import MXFP6Linear, MXWeightState


def _attached(rows=64, cols=96):
    m = MXFP6Linear(cols, rows, bias=False)
    erefs = torch.full((weight_erefs.buffer_words(rows, cols),), 7, dtype=torch.int32)
    operands = (torch.empty(rows, cols, dtype=torch.float8_e4m3fn),)
    m.weight_erefs, m.weight_operands = erefs, operands
    return m, erefs, operands


def test_buffer_layout_pads_the_rows_to_16_bytes():
    assert weight_erefs.buffer_words(3072, 9216) == 3072 + 9216
    assert weight_erefs.buffer_words(33, 64) == 36 + 64
    buf = torch.arange(weight_erefs.buffer_words(33, 64), dtype=torch.int32)
    rows, cols = weight_erefs.rows_and_columns(buf, 33, 64)
    assert rows.numel() == 36 and cols.numel() == 64 and int(cols[0]) == 36 and rows.data_ptr() == buf.data_ptr()


def test_a_layer_uses_what_is_kept_only_at_the_version_it_was_computed_from():
    m, erefs, operands = _attached()
    assert m.kept_weight_state() == (None, None)  # attached, never marked current
    m.weight_state_version = m.weight._version
    got = m.kept_weight_state()
    assert got[0] is erefs and got[1] is operands
    with torch.no_grad():
        m.weight.add_(1.0)  # any write through torch bumps the version
    assert m.kept_weight_state() == (None, None)
    m.weight_state_version = m.weight._version  # the owner computed them again
    assert m.kept_weight_state()[0] is erefs
    m.load_state_dict({"weight": torch.zeros_like(m.weight)})
    assert m.kept_weight_state() == (None, None)


def test_a_stale_layer_packs_its_weight_itself_with_the_same_output():
    m, _, _ = _attached()
    x = torch.randn(16, 96).bfloat16()
    want = m(x)
    m.weight_state_version = m.weight._version
    with torch.no_grad():
        m.weight.mul_(1.0)
    assert torch.equal(m(x), want)  # the kept (garbage) tensors were not used


def _run(m, x, forward=None):
    """(y, dx, dW, db) of one forward and backward of `m` (through `forward`, m's own by default) on `x`."""
    x = x.detach().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    y = (m if forward is None else forward)(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, m.weight.grad, m.bias.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_given_its_row_operand_alone_packs_wt_in_backward_with_the_same_bits(compiled):
    """What a layer does with a state that keeps the row operands alone (`precision.kept_weight_cols:
    false`), on the CPU packers, eager and compiled: forward multiplies by the row operand it is given
    and saves the parameter, backward packs Wᵀ from it: output and gradients bit for bit those of the
    layer packing its weight itself. The given row operand is what forward reads (a wrong one shows in y)."""
    from mxflux.ops import mx_operands

    torch.manual_seed(0)
    m = MXFP6Linear(96, 64)
    x = torch.randn(40, 96).bfloat16()
    want = _run(m, x)
    rd, rs = mx_operands(m.weight.detach(), None, torch.zeros(1, dtype=torch.int64), True, False, "rowwise", True,
                         "none", False)[:2]
    erefs = torch.zeros(weight_erefs.buffer_words(64, 96), dtype=torch.int32)  # (the CPU packers find their own)
    m.weight_erefs, m.weight_operands, m.weight_state_version = erefs, (rd, rs, None, None), m.weight._version
    assert m.kept_weight_state()[1][2] is None
    forward = torch.compile(m) if compiled else m
    for name, got, ref in zip(("y", "dx", "dW", "db"), _run(m, x, forward), want):
        assert torch.equal(got, ref), name
    m.weight_operands = (rd, rs * 2, None, None)
    assert not torch.equal(forward(x), want[0])


def test_the_state_takes_row_granularity_layers_only_and_none_without_kernels():
    with pytest.raises(ValueError, match="layers: the e_ref and operands kept are the row granularity's.*'blockwise'"):
        MXWeightState([MXFP6Linear(128, 128, mx_gemm="blockwise")])
    from mxflux.ops import weight_exponents_available

    m = MXFP6Linear(128, 128)
    state = MXWeightState([m], [m])
    if not weight_exponents_available(m.weight):  # CPU tensors without Triton's interpreter
        assert state.of == {} and state.kept == {} and m.kept_weight_state() == (None, None)


@pytest.mark.parametrize("repack, operands", [(False, True), (True, True), (False, False), (True, False)])
def test_the_step_keeps_operands_only_where_nothing_asks_for_none(repack, operands):
    """`precision.repack_weights` (no weight operand kept through the step) overrides the default
    `weight_operands_in_optimizer`: the step then keeps only the weights' e_ref."""
    from mxflux.train import load_recipe

    cfg = load_recipe("tiny-mxfp6", [f"precision.repack_weights={str(repack).lower()}",
                                     f"precision.weight_operands_in_optimizer={str(operands).lower()}"])
    assert cfg.precision.converter().keeps_operands() == (operands and not repack)
