"""The columns' e_ref held from the last call (`precision.held_col_erefs`, `MXConfig.held_cols`): the
weight gradient's operands Xᵀ and dYᵀ encoded against a prediction, on the CPU (the reference packer;
the CUDA one-pass packer is held to the same reference bit for bit in tests/gpu/test_operands_onepass.py).

What must hold: the fold places a column's window at the prediction only where it holds the column
(at or above its largest block), with the same values inside it; a layer gives the same outputs and
gradients as without while every block stays inside the window, keeps its inputs' and gradients' own
column maxima for the next call, and packs against them there (seen in the bytes of its col operand
and in the blocks it counts outside the window); the recipe switch reaches every MXFP6Linear.
"""

from __future__ import annotations

import pytest
import torch

from mxflux.mx import FoldGranularity, mx_operands_reference, quantize
from mxflux.mx.fold import fold_to_e4m3
from mxflux.mx.operands import rowwise_erefs_reference
from mxflux.nn import MXFP6Linear
from mxflux.nn.functional import MXConfig
from mxflux.nn.precision import PrecisionConfig, apply_precision

DEFAULT_HEADROOM = MXConfig().held_headroom  # (X, dY): the binades above the last maxima by default


def _x(gen, r=64, c=96, spread=0):
    x = torch.randn(r, c, generator=gen)
    if spread:  # columns over `spread` binades, so that some blocks sit far below their column's largest
        x = x * torch.exp2(torch.randint(-spread, 1, (r // 32, c), generator=gen).float()).repeat_interleave(32, 0)
    return x.bfloat16()


def test_the_fold_places_the_window_only_where_the_prediction_holds(gen):
    x = _x(gen)
    mx = quantize(x.t().contiguous(), "e2m3", axis=1)
    own = rowwise_erefs_reference(x)[1]
    data, scale, _ = fold_to_e4m3(mx)
    # one binade above every column: the scale doubles, the values stay
    d2, s2, _ = fold_to_e4m3(mx, held=own, headroom=1)
    assert torch.equal(s2, 2 * scale) and torch.equal(d2.float() * s2, data.float() * scale)
    assert not torch.equal(d2.view(torch.uint8), data.view(torch.uint8))
    # one binade below every column does not hold it: each keeps its own e_ref; so does "none held" (0)
    for held in (own - 1, torch.zeros_like(own)):
        d3, s3, _ = fold_to_e4m3(mx, held=held.to(torch.int32))
        assert torch.equal(d3.view(torch.uint8), data.view(torch.uint8)) and torch.equal(s3, scale)


@pytest.mark.parametrize("bad, message", [
    (dict(held=torch.zeros(95, dtype=torch.int32)), r"held: expected int32 \(96,\)"),
    (dict(held=torch.zeros(96, dtype=torch.int64)), r"held: expected int32 \(96,\)"),
    (dict(held=torch.zeros(96, dtype=torch.int32), granularity=FoldGranularity.BLOCKWISE),
     "held: a predicted e_ref is for the row granularity"),
])
def test_a_bad_prediction_is_refused_by_name(gen, bad, message):
    mx = quantize(_x(gen, r=128).t().contiguous(), "e2m3", axis=1)
    with pytest.raises(ValueError, match=message):
        fold_to_e4m3(mx, **bad)


def _pair(gen, held: bool, headroom=DEFAULT_HEADROOM):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    a = MXFP6Linear(96, 64)
    b = MXFP6Linear(96, 64)
    b.load_state_dict(a.state_dict())
    if held:
        a.cfg = a.cfg._replace(held_cols=True, held_headroom=headroom)
    return a, b


def _step(layer, x, gy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(gy)
    grads = (x.grad, layer.weight.grad, layer.bias.grad)
    layer.weight.grad = layer.bias.grad = None
    return y, grads


def test_a_held_layer_trains_as_the_exact_one_while_its_blocks_stay_in_the_window(gen):
    held, plain = _pair(gen, True)
    for step in range(3):
        x, gy = _x(gen), _x(gen, c=64)
        y, g = _step(held, x, gy)
        y0, g0 = _step(plain, x, gy)
        assert torch.equal(y, y0)
        for a, b in zip(g, g0):
            assert torch.equal(a, b), step
        # what the next call predicts from: this call's own column maxima, of X and of dY
        assert torch.equal(held.x_col_erefs, rowwise_erefs_reference(x)[1])
        assert torch.equal(held.dy_col_erefs, rowwise_erefs_reference(gy)[1])
        assert int(held.blocks_outside_window) == int(plain.blocks_outside_window) == 0
    assert torch.equal(plain.x_col_erefs, torch.zeros_like(plain.x_col_erefs))  # the plain layer keeps none


@pytest.mark.parametrize("headroom", [DEFAULT_HEADROOM, (0, 0), (2, 0)])
def test_the_next_call_packs_against_what_the_last_one_kept(gen, headroom):
    """The window placed above a column's own largest block by the headroom: where a column spreads
    over more binades than the exact window minus the headroom, blocks fall below it and are counted.
    The same input twice: the first call has no prediction (exact fold, the plain layer's count), the
    second packs against the first's maxima raised by the headroom (more blocks outside; none more
    with no headroom, where the prediction is the column's own e_ref)."""
    held, plain = _pair(gen, True, headroom)
    # 256 tokens: 8 blocks a column, so that some column has a block the headroom pushes out (with 2 a
    # column, 9 of 300 seeds had none; with 8, 0 of 300)
    x, gy = _x(gen, r=256, spread=14), _x(gen, r=256, c=64)
    counts = []
    for _ in range(2):
        before = int(held.blocks_outside_window)
        _step(held, x, gy)
        counts.append(int(held.blocks_outside_window) - before)
    _step(plain, x, gy)
    exact = int(plain.blocks_outside_window)
    assert counts[0] == exact and (counts[1] > exact) == (headroom[0] > 0)  # (x spreads, dY does not)
    # ... which is the reference packer given that prediction
    want = mx_operands_reference(x, col_held=rowwise_erefs_reference(x)[1], col_headroom=headroom[0])
    dy_want = mx_operands_reference(gy, col_held=rowwise_erefs_reference(gy)[1], col_headroom=headroom[1])
    assert counts[1] - exact == (int(want.blocks_outside_window) + int(dy_want.blocks_outside_window)
                                 - int(mx_operands_reference(x).blocks_outside_window)
                                 - int(mx_operands_reference(gy).blocks_outside_window))


def test_an_evaluation_neither_uses_nor_overwrites_the_prediction(gen):
    """A forward autograd does not record (validation, sampling) packs no col operand, so it has nothing
    to encode against the prediction: it must leave the prediction as the last training call left it,
    or the next training step would be packed against what the evaluation saw."""
    held, twin = _pair(gen, True)
    twin.cfg = held.cfg  # held too: the same weights, the same calls but the evaluation
    x, gy = _x(gen, spread=14), _x(gen, c=64)
    _step(held, x, gy)
    _step(twin, x, gy)
    kept = held.x_col_erefs.clone(), held.dy_col_erefs.clone()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = held(_x(gen, spread=6) * 64)
        assert y.shape == (64, 64)
        assert torch.equal(held.x_col_erefs, kept[0]) and torch.equal(held.dy_col_erefs, kept[1])
    x2, gy2 = _x(gen, spread=14), _x(gen, c=64)
    y, g = _step(held, x2, gy2)
    y0, g0 = _step(twin, x2, gy2)  # the twin never evaluated
    assert torch.equal(y, y0) and all(torch.equal(a, b) for a, b in zip(g, g0))


def test_a_forward_without_autograd_packs_the_row_operands_alone(gen, monkeypatch):
    """Validation and sampling pack X, W (and the fused MLP's activation) for the forward GEMM only."""
    import mxflux.nn.functional as functional
    from mxflux.nn import FusedMXFP6MLP

    cols = []
    pack = functional._pack

    def spy(x, cfg, counter, *, row=True, col=True, **kw):
        cols.append(col)
        return pack(x, cfg, counter, row=row, col=col, **kw)

    monkeypatch.setattr(functional, "_pack", spy)
    layer = MXFP6Linear(96, 64)
    mlp = FusedMXFP6MLP.from_linears(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64), activation="gelu_tanh",
                                     mode="on")
    x = _x(gen)
    for module, calls in ((layer, 2), (mlp, 4)):
        cols.clear()
        with torch.no_grad():
            y = module(x if module is layer else x[:, :64])
        assert len(cols) == calls and not any(cols), cols
        cols.clear()
        xg = (x if module is layer else x[:, :64]).detach().requires_grad_()
        module(xg).float().sum().backward()  # and with autograd every col operand again
        assert cols[:calls] == [True] * calls
        with torch.no_grad():
            assert torch.equal(module(x if module is layer else x[:, :64]), y)


def test_the_recipe_switch_reaches_every_mx_linear_and_recompute_turns_it_off():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(128, 64))
    holder = torch.nn.Sequential(model, torch.nn.Linear(64, 96))
    apply_precision(holder, PrecisionConfig(fp6="e2m3", fused_mlp="off", held_col_erefs=True, include=("*",)))
    layers = [m for m in holder.modules() if isinstance(m, MXFP6Linear)]
    assert len(layers) == 3 and all(m.cfg.held_cols and m.holds_col_erefs() for m in layers)
    layers[0].cfg = layers[0].cfg._replace(recomputed=True)
    assert not layers[0].holds_col_erefs()
    assert all(m.cfg.held_headroom == DEFAULT_HEADROOM for m in layers)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 96))
    apply_precision(plain, PrecisionConfig(fp6="e2m3", include=("*",)))
    assert not plain[0].cfg.held_cols
    tight = torch.nn.Sequential(torch.nn.Linear(64, 96))
    apply_precision(tight, PrecisionConfig(fp6="e2m3", held_col_erefs=True, held_headroom_x=0, held_headroom_dy=1,
                                           include=("*",)))
    assert tight[0].cfg.held_headroom == (0, 1)


@pytest.mark.parametrize("override, message", [
    ("precision.held_headroom_x=0", "held_headroom_x: applies to precision.held_col_erefs: true only"),
    ("precision.held_headroom_dy=9", "held_headroom_dy"),
])
def test_a_headroom_without_held_or_out_of_range_is_refused_by_name(override, message, demo_root, tmp_path):
    from mxflux.train import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=message):
        load_recipe("tiny-mxfp6", [override, f"data.root={demo_root}", f"train.out_dir={tmp_path}"])


# --- the predictions through a checkpoint and a warm-up (`mxflux.train.held_erefs`) ----------------------------

HELD = ("precision.held_col_erefs=true", "precision.fused_mlp='off'")


def _trainer(demo_root, out, *extra):
    from mxflux.train import load_recipe
    from mxflux.train.trainer import Trainer

    cfg = load_recipe("tiny-mxfp6", [f"data.root={demo_root}", f"train.out_dir={out}", "batch.global_batch_size=8",
                                     "batch.micro_batch_size=8", "train.sample_prompts=[]", "optim.warmup_steps=1",
                                     *HELD, *extra])
    return Trainer(cfg, device="cpu")


def _steps(trainer, batches, n):
    """n steps: each one's loss and blocks outside the window, then the weights as they end."""
    out = [tuple(trainer.train_step([next(batches)]).read()[k] for k in ("loss", "blocks_outside_window"))
           for _ in range(n)]
    return out, [p.detach().clone() for p in trainer.model.parameters()]


def test_a_resumed_held_run_goes_on_bit_for_bit(demo_root, tmp_path):
    """The checkpoint carries each layer's predictions: the run resumed from it packs its next step's col
    operands against what the uninterrupted run's last step kept, so its losses, window counts and weights
    are that run's bit for bit. (A resume without them packs the exact fold there: more blocks inside the
    window, other weight gradients.)"""
    from mxflux.train.checkpoint import load_checkpoint

    a = _trainer(demo_root, tmp_path / "a")
    batches = a.batches()
    _steps(a, batches, 3)
    ck = a.save(tmp_path / "ck.pt")
    want, want_w = _steps(a, batches, 2)
    (saved,) = load_checkpoint(ck)["held_col_erefs"]
    assert saved and all(v.dtype == torch.uint8 for v in saved.values())
    assert sum(int(v.ne(0).sum()) for v in saved.values()) > 0

    b = _trainer(demo_root, tmp_path / "b")
    b.resume(ck)
    got, got_w = _steps(b, b.batches(), 2)
    assert got == want
    assert all(torch.equal(x, y) for x, y in zip(got_w, want_w))


def test_a_warm_up_leaves_no_prediction_behind(demo_root, tmp_path):
    """From a trained state (at the start the output layer's zero weights leave dY zero and the
    predictions moot): the warm-up's steps replace the predictions, which it then puts back."""
    from mxflux.train.warmup import warmup_without_trace

    a = _trainer(demo_root, tmp_path / "a")
    _steps(a, a.batches(), 3)
    ck = a.save(tmp_path / "ck.pt")
    plain, warmed = _trainer(demo_root, tmp_path / "p"), _trainer(demo_root, tmp_path / "w")
    plain.resume(ck)
    warmed.resume(ck)
    warmup_without_trace(warmed, 2)
    want, want_w = _steps(plain, plain.batches(), 2)
    got, got_w = _steps(warmed, warmed.batches(), 2)
    assert got == want and all(torch.equal(x, y) for x, y in zip(got_w, want_w))


def test_predictions_from_another_number_of_ranks_are_not_taken(gen):
    """Each rank predicts from its own data: a checkpoint of 2 ranks restores rank by rank on 2, and on 1
    (or from a checkpoint without any) every layer starts without a prediction."""
    from mxflux.train.held_erefs import gather_held, held_snapshot, restore_gathered_held

    layers = torch.nn.Sequential(MXFP6Linear(96, 64))
    layers[0].cfg = layers[0].cfg._replace(held_cols=True)
    _step(layers[0], _x(gen), _x(gen, c=64))
    (mine,) = gather_held(layers, 1)
    assert torch.equal(mine["0.x_col_erefs"].int(), layers[0].x_col_erefs)
    other = {k: v + 1 for k, v in mine.items()}
    restore_gathered_held(layers, [mine, other], 1, 2)
    assert torch.equal(held_snapshot(layers)["0.dy_col_erefs"], other["0.dy_col_erefs"])
    for every, world in (([mine, other], 1), (None, 1)):
        restore_gathered_held(layers, every, 0, world)
        assert not layers[0].x_col_erefs.any() and not layers[0].dy_col_erefs.any()
    plain = torch.nn.Sequential(MXFP6Linear(96, 64))
    assert gather_held(plain, 1) is None  # no layer holds: nothing in the checkpoint
