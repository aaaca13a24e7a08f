"""The weights' e_ref computed by the AdamW step for their owner (`nn.MXWeightState`) and the
packer's pass 2 run on them (`mx_operands_cuda(..., erefs=)`).

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`; small
shapes). What must hold: the packer given the e_ref writes the reference's operands bit for bit;
the fused step writes exactly what the plain Triton step writes, and the e_ref of those values;
a layer uses what is kept only while it is current. The end-to-end trainings at the end need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, TRITON_DEVICE, assert_bits_equal, dev_gen, triton_marks

from mxflux.kernels import mx_operands_cuda, weight_erefs
from mxflux.mx.formats import get_format
from mxflux.kernels import adamw_cuda as adamw_kernels
from mxflux.kernels.adamw_cuda import OperandTile
from mxflux.kernels.operands_cuda import weight_exponents_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import mx_operands_reference
from mxflux.nn import MXFP6Linear, MXWeightState
from mxflux.train import adamw_cuda
from mxflux.train.optimizer import ClippingAdamW

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
FIELDS = ("row_data", "row_scale", "col_data", "col_scale")
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _fp32_weight(r, c, gen, dist="adversarial"):
    """fp32 values whose bf16 rounding is `dist`'s tensor, with bits below bf16 set (ties included)."""
    x = DISTS[dist](r, c, gen, DEVICE).float()
    g = dev_gen(gen, DEVICE)
    low = torch.randint(0, 1 << 16, (r, c), generator=g, device=DEVICE, dtype=torch.int32)
    low[:, ::7] = 0x8000  # exact ties: rounded to even
    y = (x.view(torch.int32) | low).view(torch.float32)
    return torch.where(x.isfinite(), y, x)


def _buffer(x):
    return torch.empty(weight_erefs.buffer_words(*x.shape), dtype=torch.int32, device=x.device)


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("shape", [(200, 96), (128, 64), (33, 32)])
def test_pass_2_on_the_standalone_erefs_is_the_reference(gen, shape, hadamard):
    x = _fp32_weight(*shape, gen)
    erefs = weight_exponents_cuda(x, hadamard, _buffer(x).fill_(-1))  # overwritten, not max-ed into
    want = mx_operands_reference(x.bfloat16(), granularity=G.ROWWISE, hadamard=hadamard)
    for row, col in ((True, True), (True, False), (False, True)):
        got = mx_operands_cuda(x, row=row, col=col, hadamard=hadamard, erefs=erefs, _poison=True)
        for name in FIELDS:
            if getattr(got, name) is not None:
                assert_bits_equal(name, getattr(got, name), getattr(want, name))
        assert int(got.blocks_outside_window) == int(
            mx_operands_cuda(x, row=row, col=col, hadamard=hadamard).blocks_outside_window)
    # the given buffer is what pass 2 reads: other e_ref, other operands
    shifted = torch.where(erefs > 0, erefs + 1, erefs)
    other = mx_operands_cuda(x, hadamard=hadamard, erefs=shifted)
    assert not torch.equal(other.row_scale, want.row_scale)


@pytest.mark.parametrize("dist", ["adversarial", "student_t"])
def test_an_activations_first_pass_alone_lets_each_orientation_be_packed_apart(gen, dist):
    """A bf16 activation's e_ref from the first pass run on its own (`mx_erefs_cuda`, `mxflux::mx_erefs`
    on the GPU: a cached plan, the same as the weights' uncached entry) are
    the reference's (`rowwise_erefs_reference`), and packing each orientation by its own call with
    them (`MXConfig.pack_apart`, through the op's kernel entry) gives the reference's bytes and the one
    call's counts; the erefs are used (shifted ones give other operands)."""
    from mxflux.kernels import mx_operands_cuda_counted
    from mxflux.mx import rowwise_erefs_reference

    from mxflux.kernels.operands_cuda import mx_erefs_cuda

    x = DISTS[dist](200, 96, gen, DEVICE)
    erefs = mx_erefs_cuda(x, True)
    for _ in range(2):  # its cached plan again (on a GPU: the compiled launch), and the weights' entry
        assert torch.equal(mx_erefs_cuda(x, True), erefs)
    assert torch.equal(weight_exponents_cuda(x, True, _buffer(x).fill_(-1)), erefs)
    rows, cols = weight_erefs.rows_and_columns(erefs, 200, 96)
    want_rows, want_cols = rowwise_erefs_reference(x.cpu())
    assert torch.equal(rows[:200].cpu(), want_rows) and torch.equal(cols.cpu(), want_cols)
    want = mx_operands_reference(x, granularity=G.ROWWISE)
    whole = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    mx_operands_cuda_counted(x, None, whole, True, True, G.ROWWISE, True, "none", False)
    apart = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    rd, rs, _, _, _, _ = mx_operands_cuda_counted(x, None, apart, True, False, G.ROWWISE, True, "none", False, erefs)
    _, _, cd, cs, _, _ = mx_operands_cuda_counted(x, None, apart, False, True, G.ROWWISE, True, "none", False, erefs)
    for name, got in (("row_data", rd), ("row_scale", rs), ("col_data", cd), ("col_scale", cs)):
        assert_bits_equal(name, got, getattr(want, name))
    assert int(apart) == int(whole) == int(want.blocks_outside_window)
    shifted = torch.where(erefs > 0, erefs + 1, erefs)
    other = mx_operands_cuda_counted(x, None, torch.zeros_like(apart), True, False, G.ROWWISE, True, "none", False,
                                     shifted)
    assert not torch.equal(other[1], want.row_scale)
    with pytest.raises(ValueError, match="x: mx_operands_cuda reads"):
        mx_erefs_cuda(x.half(), True)
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        mx_erefs_cuda(x[0], True)


def test_bad_erefs_are_refused_by_name(gen):
    x = _fp32_weight(64, 64, gen)
    with pytest.raises(ValueError, match="erefs: expected int32"):
        mx_operands_cuda(x, erefs=torch.zeros(7, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out: expected int32"):
        weight_exponents_cuda(x, True, torch.zeros(weight_erefs.buffer_words(64, 64), device=DEVICE))


def _layers_over(params, hadamards):
    """MXFP6Linear layers over these parameters (the state is per layer)."""
    layers = []
    for p, h in zip(params, hadamards):
        m = MXFP6Linear(p.shape[1], p.shape[0], bias=False, hadamard=h).to(DEVICE)
        m.weight = p
        layers.append(m)
    return layers


def _pair(init, track: bool):
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = ClippingAdamW(ps, kernel="triton", fused=True, **HP)
    if track:
        opt.weight_state = MXWeightState(_layers_over(ps, (True, False, True)), min_elements=adamw_cuda.LARGE)
        assert len(opt.weight_state.of) == len(ps)
    return ps, opt


@pytest.mark.parametrize("tile", [(128, 2, 8, 4), (64, 2, 4, 2), (32, 2, 4, 1)], ids=lambda t: "x".join(map(str, t)))
def test_the_step_writes_what_the_plain_step_writes_and_the_erefs_of_it(gen, monkeypatch, tile):
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)  # small weights through the kernels (interpreter)
    for name, value in zip(("BR", "NB", "NUM_WARPS", "SLICES"), tile):
        monkeypatch.setattr(OperandTile, name, value)
    shapes = [(224, 96), (128, 64), (64, 160)]  # MXFP6Linear weights: whole 32-row blocks (dgrad's contraction)
    init = [_fp32_weight(r, c, gen, "normal") * 0.02 for r, c in shapes]
    plain, o_plain = _pair(init, track=False)
    fused, o_fused = _pair(init, track=True)
    hadamards = dict(zip(fused, (True, False, True)))
    g = dev_gen(gen, DEVICE)
    for step in range(3):
        factor = torch.tensor(0.37 if step == 1 else 1.0, device=DEVICE)
        for a, b in zip(plain, fused):
            gr = torch.randn(a.shape, generator=g, device=DEVICE) * torch.exp2(
                torch.randint(-8, 8, (a.shape[0], 1), generator=g, device=DEVICE).float())
            a.grad, b.grad = gr.clone(), gr.clone()
        adamw_cuda.adamw_clipped_step(o_plain, factor)
        adamw_cuda.adamw_clipped_step(o_fused, factor, state=o_fused.weight_state)
        for a, b in zip(plain, fused):
            assert torch.equal(a.detach(), b.detach())
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(o_plain.state[a][k], o_fused.state[b][k])
            assert o_fused.weight_state.is_current(b)
            got = o_fused.weight_state.of[b][1]
            want = weight_exponents_cuda(b.detach(), hadamards[b], _buffer(b))
            assert torch.equal(got, want), (step, tuple(b.shape))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op's kernel path (CUDA tensors)")
def test_a_layer_packs_with_its_kept_e_ref_only_while_it_is_current(gen):
    """Through the op: a layer hands the packer its kept e_ref only while they are the weight's
    current ones (a wrong e_ref shows in the output and the outside-window count); after a write
    through torch it packs itself."""
    m = _layers_over([torch.nn.Parameter(_fp32_weight(128, 64, gen, "normal") * 0.02)], (True,))[0]
    x = torch.randn(32, 64, generator=dev_gen(gen, DEVICE), device=DEVICE).bfloat16()
    counted = m.blocks_outside_window

    def outside_of(y_fn):
        before = int(counted)
        y = y_fn()
        return y, int(counted) - before

    want, n = outside_of(lambda: m(x))  # nothing kept: the packer's two passes
    assert n == 0
    wrong = weight_exponents_cuda(m.weight.detach(), True, _buffer(m.weight))
    # e_ref a binade past the fold window too high: every weight block then lies outside it (a
    # wrong e_ref within the window would fold exactly and leave the output as it is)
    wrong += (wrong > 0).int() * (get_format("e2m3").fold_window + 1)
    m.weight_erefs = wrong
    y, n = outside_of(lambda: m(x))
    assert torch.equal(y, want) and n == 0  # attached, but never marked current
    m.weight_state_version = m.weight._version
    y, n = outside_of(lambda: m(x))
    assert not torch.equal(y, want) and n > 0  # current: the packer ran pass 2 on them
    with torch.no_grad():
        m.weight.mul_(1.0)  # any write through torch bumps the version
    y, n = outside_of(lambda: m(x))
    assert torch.equal(y, want) and n == 0


# ---------------------------------------------------------------------- operands kept by the step
def _dequantized(data, scale):
    """What an operand stands for: E4M3 data times its row's fp32 scale (exact: both powers of two
    apart from the 4-bit significands)."""
    return data.float() * scale


def _assert_same_mx_values(got, want, where):
    for name, data, scale in (("row", got[0], got[1]), ("col", got[2], got[3])):
        w = _dequantized(getattr(want, f"{name}_data"), getattr(want, f"{name}_scale"))
        g = _dequantized(data, scale)
        same = (g == w) | (g.isnan() & w.isnan())
        assert bool(same.all()), (where, name, int((~same).sum()))


def _kept_layers(gen, shapes, lr=3e-3, hadamards=(True, False, True), prepare=None, keep_cols=True):
    """MXFP6Linear layers on the kernels' device whose operands an optimizer keeps (`prepare` edits
    the weights before the optimizer first packs them; `keep_cols=False`: their row operands alone)."""
    from mxflux.nn import MXFP6Linear

    layers = []
    for (r, c), h in zip(shapes, hadamards):
        m = MXFP6Linear(c, r, bias=False, hadamard=h).to(DEVICE)
        with torch.no_grad():
            m.weight.copy_(_fp32_weight(r, c, gen, "normal") * 0.02)
        layers.append(m)
    if prepare is not None:
        with torch.no_grad():
            prepare([m.weight for m in layers])
    opt = ClippingAdamW([m.weight for m in layers], kernel="triton", fused=True, **{**HP, "lr": lr})
    opt.weight_state = MXWeightState(layers, layers, keep_cols=keep_cols, min_elements=adamw_cuda.LARGE)
    assert set(opt.weight_state.kept) == {m.weight for m in layers}
    return layers, opt


def _step(opt, layers, g, scale=1.0):
    for m in layers:
        m.weight.grad = torch.randn(m.weight.shape, generator=g, device=DEVICE) * scale
    adamw_cuda.adamw_clipped_step(opt, torch.tensor(1.0, device=DEVICE), state=opt.weight_state)


@pytest.mark.parametrize("tile", [None, (32, 2, 2, 2), (128, 4, 8, 4)], ids=lambda t: "x".join(map(str, t or ("shipped",))))
def test_the_step_keeps_the_operands_of_what_it_writes(gen, monkeypatch, tile):
    """After each step the kept operands stand for the packer's operands of the updated weight,
    element for element; they are encoded against the previous e_ref one binade up (the scales are
    the packer's times 2, or 1 or 4 where a row's or column's largest block moved a binade), and no
    fix-up ran. A layer's forward with them is its forward without them, bit for bit. At the shipped
    tile and at others benchmarks/bench_optimizer.py may time."""
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)
    for name, value in zip(("BR", "NB", "NUM_WARPS", "SLICES"), tile or ()):
        monkeypatch.setattr(OperandTile, name, value)
    layers, opt = _kept_layers(gen, [(224, 96), (128, 64), (64, 160)])
    g = dev_gen(gen, DEVICE)
    for step in range(2):
        _step(opt, layers, g)
        for m in layers:
            kept = opt.weight_state.kept[m.weight].operands
            want = mx_operands_reference(m.weight.detach().bfloat16(), granularity=G.ROWWISE, hadamard=m.cfg.hadamard)
            _assert_same_mx_values(kept, want, (step, tuple(m.weight.shape)))
            for got, ref in ((kept[1], want.row_scale), (kept[3], want.col_scale)):
                ratio = got / ref
                assert bool(((ratio == 1) | (ratio == 2) | (ratio == 4)).all()), (step, ratio.unique())
                assert float((ratio == 2).float().mean()) > 0.5, (step, ratio.unique())
        assert int(opt.weight_state.fixups) == 0
    x = torch.randn(48, 96, generator=g, device=DEVICE).bfloat16()
    m = layers[0]
    assert m.kept_weight_state()[1] is not None
    y_kept = m(x)
    m.weight_state_version = None  # the same layer packing its own weight
    assert torch.equal(y_kept, m(x))


def _grads(m, x):
    """(y, dx, dW) of one forward and backward of layer `m` on `x`."""
    x = x.detach().requires_grad_(True)
    m.weight.grad = None
    y = m(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, m.weight.grad


def test_a_state_keeping_the_rows_alone_writes_no_col_operand_and_backward_packs_it(gen, monkeypatch):
    """`keep_cols=False` (`precision.kept_weight_cols: false`): the step writes the row operands (the
    packer's values, as with both kept) and no col operand, which is not even allocated, yet the e_ref
    of both orientations; a layer's backward then packs Wᵀ from the weight with that e_ref, and its
    output and both gradients are those of the layer packing its weight itself, bit for bit."""
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)
    layers, opt = _kept_layers(gen, [(224, 96), (128, 64)], keep_cols=False)
    g = dev_gen(gen, DEVICE)
    for step in range(2):
        _step(opt, layers, g)
        for m in layers:
            kept = opt.weight_state.kept[m.weight].operands
            assert kept[2] is None and kept[3] is None and m.kept_weight_state()[1] is kept
            want = mx_operands_reference(m.weight.detach().bfloat16(), granularity=G.ROWWISE, hadamard=m.cfg.hadamard)
            w = _dequantized(want.row_data, want.row_scale)
            assert torch.equal(_dequantized(*kept[:2]), w), (step, tuple(m.weight.shape))
            erefs = weight_exponents_cuda(m.weight.detach(), m.cfg.hadamard, _buffer(m.weight))
            assert_bits_equal("erefs", m.weight_erefs, erefs)  # the columns' too: backward packs with them
        assert int(opt.weight_state.fixups) == 0
    for m in layers:
        x = torch.randn(48, m.in_features, generator=g, device=DEVICE).bfloat16()
        kept_run = _grads(m, x)
        m.weight_state_version = None  # the same layer packing its own weight
        assert m.kept_weight_state() == (None, None)
        for name, a, b in zip(("y", "dx", "dW"), kept_run, _grads(m, x)):
            assert_bits_equal(name, a, b)
    state = opt.weight_state
    assert state.free() == sum(r * c + 4 * r for r, c in [(224, 96), (128, 64)])  # rows and their scales only


def test_released_rows_are_written_again_by_the_step_or_by_refresh(gen, monkeypatch):
    """`release_weight_rows` frees the kept row operands (1 byte per weight element) where the owner
    allows it, and the layers stop using what is kept: an eager forward packs the weight itself, the same
    bits. The next step gives them their memory back and writes the packer's values; without a step,
    refresh writes the packer's bits."""
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)
    shapes = [(224, 96), (128, 64)]
    layers, opt = _kept_layers(gen, shapes)
    g = dev_gen(gen, DEVICE)
    _step(opt, layers, g)
    kept = [opt.weight_state.kept[m.weight].operands for m in layers]
    m, x = layers[0], torch.randn(48, 96, generator=g, device=DEVICE).bfloat16()
    y = m(x)
    assert opt.release_weight_rows() == 0 and kept[0][0].untyped_storage().nbytes() == 224 * 96  # not allowed
    opt.releases_rows = True
    assert opt.release_weight_rows() == sum(r * c for r, c in shapes)
    assert [k[0].untyped_storage().nbytes() for k in kept] == [0, 0]
    assert m.kept_weight_state() == (None, None)
    assert torch.equal(m(x), y)
    assert opt.release_weight_rows() == 0  # nothing left to free
    # the step's kernel gets every tensor with its memory back (the interpreter's launcher would hand a
    # freed one its storage itself; a GPU kernel would write through a null pointer)
    kernel = adamw_kernels.adamw_operands_kernel

    class WholeTensorsOnly:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for t in args:
                    if isinstance(t, torch.Tensor):
                        assert t.untyped_storage().nbytes() >= t.numel() * t.element_size(), t.shape
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(adamw_kernels, "adamw_operands_kernel", WholeTensorsOnly())
    _step(opt, layers, g)
    monkeypatch.setattr(adamw_kernels, "adamw_operands_kernel", kernel)
    for m, k in zip(layers, kept):
        assert k[0].untyped_storage().nbytes() == m.weight.numel() and m.kept_weight_state()[1] is k
        want = mx_operands_reference(m.weight.detach().bfloat16(), granularity=G.ROWWISE, hadamard=m.cfg.hadamard)
        _assert_same_mx_values(k, want, tuple(m.weight.shape))
    layers[1].weight.requires_grad_(False)  # a frozen weight, which no step writes, keeps its rows
    assert opt.release_weight_rows() == 224 * 96 and kept[1][0].untyped_storage().nbytes() == 128 * 64
    layers[1].weight.requires_grad_(True)
    opt.release_weight_rows()
    opt.refresh_weight_state()
    for m, k in zip(layers, kept):
        want = mx_operands_reference(m.weight.detach().bfloat16(), granularity=G.ROWWISE, hadamard=m.cfg.hadamard)
        for name, got in zip(FIELDS, k):
            assert_bits_equal(name, got, getattr(want, name))
        assert m.kept_weight_state()[1] is k


def test_a_finished_runs_kept_operands_are_released_while_its_layers_are_still_held(gen, monkeypatch):
    """`mxflux bench step` frees the trainer's state before the bare loop builds its own; the layers (held
    by compiled code) keep the kept operands alive, so `_release` frees their memory under them."""
    from mxflux.bench.step import _release

    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)
    shapes = [(224, 96), (128, 64)]
    layers, opt = _kept_layers(gen, shapes)
    _step(opt, layers, dev_gen(gen, DEVICE))
    kept = [m.kept_weight_state()[1] for m in layers]
    assert all(k is not None for k in kept)
    _release(torch.nn.Sequential(*layers), opt)
    assert [t.untyped_storage().nbytes() for k in kept for t in k] == [0] * 8


@pytest.mark.parametrize("keep_cols", [True, False], ids=["both", "rows-alone"])
def test_blocks_the_previous_e_ref_cannot_hold_are_fixed_up_to_the_packers_operands(gen, monkeypatch, keep_cols):
    """Weight a: a row's largest block grows by more than two binades between the e_ref the step
    holds and the step. Weight b: a block eleven binades below its row's largest, inside the weight's
    own window but not below the raised e_ref, and one twelve below (outside both). Each gets its
    fix-up pass, which writes the packer's operands bit for bit and counts the window as it does
    (the row orientation's alone where the state keeps the rows alone: backward's packer counts Wᵀ's)."""
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)

    def prepare(ws):
        b = ws[1]
        b[7, 0], b[9, 0] = 0.2, 0.2  # largest block exponent -3 in rows 7 and 9
        b[7, 32:64] = torch.where(b[7, 32:64] < 0, -1.0, 1.0) * 2.0 ** -14  # d = -11
        b[9, 32:64] = torch.where(b[9, 32:64] < 0, -1.0, 1.0) * 2.0 ** -15  # d = -12: outside

    layers, opt = _kept_layers(gen, [(128, 64), (64, 96)], lr=0.0, hadamards=(False, False), prepare=prepare,
                               keep_cols=keep_cols)
    a = layers[0].weight
    with torch.no_grad():
        # written after the optimizer took the e_ref it encodes against: the block 4.5x the row's largest
        a[5, :32] *= 4.5 * a[5].abs().max() / a[5, :32].abs().max()
    for m in layers:
        m.blocks_outside_window.zero_()
    _step(opt, layers, dev_gen(gen, DEVICE), scale=0.0)  # lr 0: the weights stay as they are
    assert int(opt.weight_state.fixups) == 2
    for m in layers:
        kept = opt.weight_state.kept[m.weight].operands
        want = mx_operands_reference(m.weight.detach().bfloat16(), col=keep_cols, granularity=G.ROWWISE,
                                     hadamard=False)
        for name, got in zip(FIELDS[:4 if keep_cols else 2], kept):
            assert_bits_equal(name, got, getattr(want, name))
        assert int(m.blocks_outside_window) == int(want.blocks_outside_window)
    assert int(layers[1].blocks_outside_window) >= 1


def test_a_write_through_torch_is_not_used_stale_and_is_repacked_by_refresh(gen, monkeypatch):
    """After a write through torch an eager forward packs the weight itself (the kept operands are
    stale); the owner's refresh (before each model forward) packs them again: the packer's bits."""
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)
    layers, opt = _kept_layers(gen, [(128, 64)], hadamards=(True,))
    m = layers[0]
    x = torch.randn(32, 64, generator=dev_gen(gen, DEVICE), device=DEVICE).bfloat16()
    with torch.no_grad():
        m.weight.mul_(-3.0)  # bumps the version: the kept operands are stale
    assert m.kept_weight_state() == (None, None)
    y = m(x)
    opt.refresh_weight_state()
    kept = opt.weight_state.kept[m.weight].operands
    want = mx_operands_reference(m.weight.detach().bfloat16(), granularity=G.ROWWISE, hadamard=True)
    for name, got in zip(FIELDS, kept):
        assert_bits_equal(name, got, getattr(want, name))
    assert m.kept_weight_state()[1] is kept
    assert torch.equal(y, m(x))


@pytest.mark.parametrize("repack, operands, kept, cols", [(False, True, 2, True), (True, True, 0, True),
                                                         (False, False, 0, True), (False, True, 2, False)])
def test_repack_weights_keeps_the_e_ref_but_no_operands_between_steps(repack, operands, kept, cols):
    """`precision.repack_weights` asks for no weight operand kept through the step, so the precision's
    optimizer state then keeps the weights' e_ref only (as weight_operands_in_optimizer: false does),
    and the run's step path says so, naming the field."""
    from types import SimpleNamespace

    from mxflux.train import load_recipe
    from mxflux.train.step_path import step_path

    cfg = load_recipe("tiny-mxfp6", [f"precision.repack_weights={str(repack).lower()}",
                                     f"precision.weight_operands_in_optimizer={str(operands).lower()}",
                                     'precision.fused_mlp="off"', "precision.release_weight_rows=false",
                                     f"precision.kept_weight_cols={str(cols).lower()}"])
    model = torch.nn.Sequential(MXFP6Linear(512, 1024, repack_weights=repack),
                                MXFP6Linear(1024, 512, repack_weights=repack)).to(DEVICE)
    converter = cfg.precision.converter()
    assert converter.keeps_operands() == (operands and not repack)
    # (what `optimizer_state` builds on a GPU; on the CPU it says the Triton step runs on CUDA only)
    state = MXWeightState.of_model(model, keep_operands=converter.keeps_operands(), keep_cols=cols,
                                   min_elements=adamw_cuda.LARGE)
    assert len(state.of) == 2 and len(state.kept) == kept
    assert all((k.operands[2] is not None) == cols for k in state.kept.values())
    trainer = SimpleNamespace(cfg=cfg, device=torch.device(DEVICE), model=model,
                              optimizer=SimpleNamespace(weight_state=state, last_step=None),
                              block_graphs=SimpleNamespace(on=False), accum=1, world=1)
    weights = step_path(trainer)["mx_weights"]
    assert weights.startswith("kept by the optimizer step (2 weights")
    if kept == 0:
        assert ("precision.repack_weights: true" if repack else "weight_operands_in_optimizer: false") in weights
        assert "their e_ref only" in weights
    else:
        assert "e_ref only" not in weights
        assert "their row operands, 0.00 GiB, kept from forward to the step: precision.release_weight_rows: false" \
            in weights
        trainer.optimizer.releases_rows = True
        assert "row operands, 0.00 GiB, freed from the last micro-batch's forward" in step_path(trainer)["mx_weights"]
        packed = "Wᵀ packed in each backward from the weight (precision.kept_weight_cols: false)"
        assert (packed in step_path(trainer)["mx_weights"]) == (not cols)


def test_only_row_granularity_layers_keep_state():
    m = MXFP6Linear(128, 128, mx_gemm="blockwise")
    with pytest.raises(ValueError, match="layers: the e_ref and operands kept are the row granularity's.*'blockwise'"):
        MXWeightState([m])


# ---------------------------------------------------------------------- end to end, on a GPU
def _mlp_run(seed: int, track: bool, captured: bool, steps: int = 4, keep: bool = False, compiled: bool = False,
             release: bool = False, keep_cols: bool = True):
    """A two-layer MXFP6 MLP (weights through the kernels) trained with clipping, eager or captured;
    `keep`: the step also keeps the weights' operands for the layers; `compiled`: the model under
    torch.compile (which reads kept operands unchecked: refreshed before each step, as the
    trainer's forward hook does); `release`: their row operands freed between forward and backward;
    `keep_cols=False`: the step keeps the row operands alone, backward packs Wᵀ from the weights."""
    from mxflux.train.clipping import clip_and_step

    torch.manual_seed(seed)
    model = torch.nn.Sequential(MXFP6Linear(512, 1024), torch.nn.GELU(approximate="tanh"),
                                MXFP6Linear(1024, 512)).cuda()
    opt = ClippingAdamW(model.parameters(), kernel="triton", fused=True, capturable=captured, **HP)
    if track:
        opt.weight_state = MXWeightState.of_model(model, keep_operands=keep, keep_cols=keep_cols,
                                                  min_elements=adamw_cuda.LARGE)
        assert len(opt.weight_state.of) == 2 and len(opt.weight_state.kept) == (2 if keep else 0)
    opt.releases_rows = release
    forward = torch.compile(model) if compiled else model
    xs = [torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(steps)]
    static = torch.empty_like(xs[0])

    def step():
        if compiled:
            opt.refresh_weight_state()
        loss = forward(static).float().square().mean()
        assert opt.release_weight_rows() == (1024 * 512 * 2 if release else 0)
        loss.backward()
        clip_and_step(opt, model.parameters(), 0.5)
        return loss.detach()

    losses, graph = [], None
    for i, x in enumerate(xs):
        static.copy_(x)
        if graph is None:
            opt.zero_grad(set_to_none=True)  # the captured backward then allocates them in its pool
        if captured and i == 2:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        if graph is not None:
            opt.refresh_weight_state()
            graph.replay()
            losses.append(float(out))
        else:
            losses.append(float(step()))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="end-to-end training on a GPU")
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("keep", [False, True], ids=["erefs", "operands"])
def test_training_with_the_erefs_from_the_step_is_bit_identical(captured, keep):
    seed = int(torch.randint(0, 2**31, (1,)))
    l0, w0 = _mlp_run(seed, track=False, captured=captured)
    l1, w1 = _mlp_run(seed, track=True, captured=captured, keep=keep)
    assert l0 == l1, (seed, l0, l1)
    for a, b in zip(w0, w1):
        assert torch.equal(a, b), seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="end-to-end training on a GPU")
@pytest.mark.parametrize("keep_cols", [True, False], ids=["cols-kept", "cols-packed"])
def test_eager_training_with_the_row_operands_released_is_bit_identical(keep_cols):
    seed = int(torch.randint(0, 2**31, (1,)))
    l0, w0 = _mlp_run(seed, track=False, captured=False)
    l1, w1 = _mlp_run(seed, track=True, captured=False, keep=True, release=True, keep_cols=keep_cols)
    assert l0 == l1, (seed, l0, l1)
    for a, b in zip(w0, w1):
        assert torch.equal(a, b), seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="end-to-end training on a GPU")
@pytest.mark.parametrize("keep_cols", [True, False], ids=["cols-kept", "cols-packed"])
@pytest.mark.parametrize("release", [False, True], ids=["rows-kept", "rows-released"])
def test_compiled_training_with_the_kept_operands_is_bit_identical(release, keep_cols):
    seed = int(torch.randint(0, 2**31, (1,)))
    l0, w0 = _mlp_run(seed, track=False, captured=False, compiled=True)
    l1, w1 = _mlp_run(seed, track=True, captured=False, keep=True, compiled=True, release=release,
                      keep_cols=keep_cols)
    assert l0 == l1, (seed, l0, l1)
    for a, b in zip(w0, w1):
        assert torch.equal(a, b), seed
