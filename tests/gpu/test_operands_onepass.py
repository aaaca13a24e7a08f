"""The one-pass row-granularity packer (`mx_operands_onepass_cuda`): both operands from one read of x,
the columns against a predicted e_ref, the ones it does not hold fixed up.

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`; small
shapes). What must hold: bit for bit the reference given the same prediction
(`mx_operands_reference(..., col_held=, col_headroom=)`), and the two-pass packer's operands where the
prediction is the columns' own maxima; x's own column maxima returned for the next call; exactly the
columns the prediction does not hold re-encoded; the same count of blocks outside the window.
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, TRITON_DEVICE, assert_bits_equal, assert_colsum_close, triton_marks

from mxflux.kernels import mx_operands_cuda, mx_operands_onepass_cuda
from mxflux.mx import mx_operands_reference
from mxflux.mx.operands import rowwise_erefs_reference

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
FIELDS = ("row_data", "row_scale", "col_data", "col_scale")
SHAPES = [(64, 256), (45, 96), (33, 544)] if DEVICE == "cpu" else [(64, 256), (45, 96), (1000, 3072), (4099, 12288)]


def _predictions(cols: torch.Tensor, gen: torch.Generator) -> dict:
    """Predictions of x's column maxima `cols` (e_ref + 128, 0 for none), by what the packer must do
    with them: the true maxima; none at all; one binade low on a third of the columns (those are
    fixed up, the rest held); one to three binades high (all held, windows placed higher)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    c = cols.cpu()
    third = torch.arange(c.numel()) % 3 == 0
    high = c + torch.randint(1, 4, c.shape, generator=g, dtype=torch.int32)
    return {
        "true": cols,
        "none": torch.zeros_like(cols),
        "low": torch.where(third & (c > 0), c - 1, c).to(torch.int32).to(cols.device),
        "high": torch.where(c > 0, high, 0).to(torch.int32).to(cols.device),
    }


@pytest.mark.parametrize("dist", list(DISTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_one_pass_packer_is_the_reference_given_the_same_prediction(gen, shape, dist):
    x = DISTS[dist](*shape, gen, DEVICE)
    colsum = dist != "adversarial"  # (sums over inf and NaN are compared by the two-pass tests)
    _, cols = rowwise_erefs_reference(x)
    two_pass = mx_operands_cuda(x, colsum=colsum)
    for name, held in _predictions(cols, gen).items():
        for headroom in (0, 1):
            got, new, fixed = mx_operands_onepass_cuda(x, held, headroom=headroom, colsum=colsum, _poison=True)
            want = mx_operands_reference(x, colsum=colsum, col_held=held, col_headroom=headroom)
            for f in FIELDS:
                assert_bits_equal(f"{name}+{headroom} {f}", getattr(got, f), getattr(want, f))
            assert int(got.blocks_outside_window) == int(want.blocks_outside_window), (name, headroom)
            assert torch.equal(new, cols), (name, headroom)  # x's own maxima, whatever was predicted
            pred = torch.where(held > 0, held + headroom, 0)
            expect_fixed = int(((cols > 0) & ((held == 0) | (cols > pred))).sum())
            assert int(fixed) == expect_fixed, (name, headroom)
            if colsum:
                assert_colsum_close(got.colsum, want.colsum, x)
            # the rows never depend on the prediction: the two-pass packer's bytes
            assert_bits_equal("row_data", got.row_data, two_pass.row_data)
            assert_bits_equal("row_scale", got.row_scale, two_pass.row_scale)
            if name == "true" and headroom == 0:  # the columns' own e_ref: the two-pass packer's operands
                for f in FIELDS:
                    assert_bits_equal(f, getattr(got, f), getattr(two_pass, f))
                assert int(got.blocks_outside_window) == int(two_pass.blocks_outside_window)


@pytest.mark.parametrize("piece_tiles", [1, 2, 3])
@pytest.mark.parametrize("dist", ["normal", "adversarial"])
def test_rows_walked_in_pieces_are_the_two_passes_whether_or_not_each_piece_was_published(gen, dist, piece_tiles):
    """A program walks a piece of a stripe and re-scales its rows a round later, from every piece's row
    maxima as published or, for each piece whose program has not run yet, read from x. Under the interpreter
    the programs run one after another, so a walk finds its stripe's earlier pieces published and reads the
    later ones from x: both ways, mixed in one stripe, give the two-pass packer's bytes at every piece width
    (C = 1568: 13 tiles, the last a quarter full)."""
    x = DISTS[dist](96, 1568, gen, DEVICE)
    _, cols = rowwise_erefs_reference(x)
    want = mx_operands_cuda(x)
    helped = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got, _, fixed = mx_operands_onepass_cuda(x, cols, _poison=True, _piece_tiles=piece_tiles, _helped=helped)
    for f in FIELDS:
        assert_bits_equal(f, getattr(got, f), getattr(want, f))
    assert int(got.blocks_outside_window) == int(want.blocks_outside_window) and int(fixed) == 0
    n_pieces = -(-13 // piece_tiles)
    if DEVICE == "cpu":  # (on a GPU the programs run side by side: how often one helps is timing)
        # of the 3 stripes x n_pieces walks' n_pieces maxima each, some read from x, the others as published
        assert 0 < int(helped) < 3 * n_pieces * n_pieces


def test_a_prediction_that_holds_moves_no_value_inside_the_window(gen):
    """Placed one binade high, a column's window still holds every block of a normal tensor: the
    dequantized col operand (data times scale) is the two-pass packer's exactly, while the bytes
    and the scale each differ by the power of two."""
    x = DISTS["normal"](64, 256, gen, DEVICE)
    _, cols = rowwise_erefs_reference(x)
    got, _, fixed = mx_operands_onepass_cuda(x, cols, headroom=1)
    want = mx_operands_cuda(x)
    assert int(fixed) == 0 and int(got.blocks_outside_window) == int(want.blocks_outside_window) == 0
    assert torch.equal(got.col_scale, 2 * want.col_scale)
    assert torch.equal(got.col_data.float() * got.col_scale, want.col_data.float() * want.col_scale)
    assert not torch.equal(got.col_data.view(torch.uint8), want.col_data.view(torch.uint8))


def test_the_count_goes_into_the_callers_counter(gen):
    x = DISTS["adversarial"](64, 96, gen, DEVICE)
    _, cols = rowwise_erefs_reference(x)
    counter = torch.full((1,), 5, dtype=torch.int64, device=DEVICE)
    got, _, _ = mx_operands_onepass_cuda(x, torch.zeros_like(cols), counter=counter)
    want = mx_operands_reference(x)
    assert got.blocks_outside_window is counter and int(counter) == 5 + int(want.blocks_outside_window) > 5


def test_no_rows_gives_empty_operands_and_the_held_scales():
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    held = torch.tensor([0, 130] * 32, dtype=torch.int32, device=DEVICE)
    got, new, fixed = mx_operands_onepass_cuda(x, held, headroom=1)
    assert got.row_data.shape == (0, 64) and got.col_data.shape == (64, 0) and got.row_scale.shape == (0, 1)
    # (the reference cannot fold zero rows) every column holds: 2^(e_ref - 5), e_ref = 130 - 128 + 1 or 0
    want = torch.tensor([2.0 ** -5, 2.0 ** -2] * 32, device=DEVICE)[:, None]
    assert torch.equal(got.col_scale, want)
    assert int(new.abs().sum()) == 0 and int(fixed) == 0


@pytest.mark.parametrize("bad, message", [
    (dict(held=torch.zeros(64, dtype=torch.int64)), "held: expected int32 [96]"),
    (dict(held=torch.zeros(95, dtype=torch.int32)), "held: expected int32 [96]"),
    (dict(headroom=-1), "headroom: expected an int of binades in [0, 8]"),
    (dict(headroom=True), "headroom: expected an int"),
    (dict(colsum=1), "colsum: expected a bool"),
    (dict(x=torch.zeros(8, 96)), "x: mx_operands_cuda reads torch.bfloat16"),
    (dict(x=torch.zeros(8, 80, dtype=torch.bfloat16)), "x: 80 columns is not a multiple"),
])
def test_bad_arguments_are_refused_by_name(bad, message):
    args = dict(x=torch.zeros(8, 96, dtype=torch.bfloat16), held=torch.zeros(96, dtype=torch.int32))
    args.update(bad)
    x = args.pop("x").to(DEVICE)
    held = args.pop("held").to(DEVICE)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mx_operands_onepass_cuda(x, held, **args)


def test_a_held_value_that_is_no_e_ref_holds_nothing_and_the_headroom_stops_at_e8m0s_top(gen):
    """Only e + 128 in [1, 255] predicts anything (a buffer never written, or written by something else,
    must not place windows where no block is); a prediction raised past 127 stays at 127."""
    x = DISTS["normal"](64, 96, gen, DEVICE)
    _, cols = rowwise_erefs_reference(x)
    held = cols.clone()
    held[::3] = 300
    held[1::3] = -5
    held[2::3] = 254  # e = 126: + headroom 3 would be 129
    got, _, fixed = mx_operands_onepass_cuda(x, held, headroom=3)
    want = mx_operands_reference(x, col_held=held, col_headroom=3)
    for f in FIELDS:
        assert_bits_equal(f, getattr(got, f), getattr(want, f))
    assert int(fixed) == 64  # the two thirds that hold nothing
    assert torch.equal(got.col_scale[2::3].cpu(), torch.full((32, 1), 2.0 ** 122))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layer takes the kernels on CUDA only")
@pytest.mark.parametrize("compiled", [False, True])
def test_a_held_layer_on_cuda_trains_as_the_exact_one_and_keeps_its_maxima(gen, compiled):
    """`MXConfig.held_cols` on CUDA (the one-pass packer for X in forward and dY in backward, the layer's
    kept e_ref mutated in both, compiled or not): while every block stays inside the placed windows the
    output and the input and weight gradients are the plain layer's bit for bit (the bias gradient, dY's
    column sums, up to fp32 summation order), and after each step the layer holds X's and dY's own
    column maxima."""
    from mxflux.nn import MXFP6Linear

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    held = MXFP6Linear(3072, 1024, device="cuda")
    plain = MXFP6Linear(3072, 1024, device="cuda")
    plain.load_state_dict(held.state_dict())
    held.cfg = held.cfg._replace(held_cols=True)
    run_held = torch.compile(held) if compiled else held
    run_plain = torch.compile(plain) if compiled else plain
    for step in range(3):
        x = DISTS["normal"](2048, 3072, gen, DEVICE)
        gy = DISTS["normal"](2048, 1024, gen, DEVICE)
        outs = []
        for layer, run in ((held, run_held), (plain, run_plain)):
            xi = x.clone().requires_grad_()
            y = run(xi)
            y.backward(gy)
            outs.append((y, xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
            layer.weight.grad = layer.bias.grad = None
        for a, b in zip(outs[0][:3], outs[1][:3]):
            assert torch.equal(a, b), step
        assert_colsum_close(outs[0][3], outs[1][3], gy)
        assert torch.equal(held.x_col_erefs, rowwise_erefs_reference(x)[1])
        assert torch.equal(held.dy_col_erefs, rowwise_erefs_reference(gy)[1])
    assert int(held.blocks_outside_window) == int(plain.blocks_outside_window) == 0
