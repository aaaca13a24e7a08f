"""The weights' e_ref computed by the AdamW step (`adamw_cuda.WeightErefs`) and the packer's pass 2
run on them (`mx_operands_cuda(..., erefs=)`, `weight_erefs`).

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`; small
shapes). What must hold: the packer given the e_ref writes the reference's operands bit for bit;
the fused step writes exactly what the plain Triton step writes, and the e_ref of those values;
the op path uses a buffer only while it is current. The end-to-end trainings at the end need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, TRITON_DEVICE, assert_bits_equal, dev_gen, triton_marks

from mxflux.kernels import mx_operands_cuda, mx_operands_cuda_counted, weight_erefs
from mxflux.kernels.operands_cuda import weight_exponents_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.mx import mx_operands_reference
from mxflux.train import adamw_cuda
from mxflux.train.optimizer import ClippingAdamW

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
FIELDS = ("row_data", "row_scale", "col_data", "col_scale")
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _fresh_registry():
    weight_erefs.clear()
    yield
    weight_erefs.clear()


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


def test_bad_erefs_are_refused_by_name(gen):
    x = _fp32_weight(64, 64, gen)
    with pytest.raises(ValueError, match="erefs: expected int32"):
        mx_operands_cuda(x, erefs=torch.zeros(7, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out: expected int32"):
        weight_exponents_cuda(x, True, torch.zeros(weight_erefs.buffer_words(64, 64), device=DEVICE))


def _pair(init, track: bool):
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = ClippingAdamW(ps, kernel="triton", fused=True, **HP)
    if track:
        assert opt.track_weight_erefs([(p, h) for p, h in zip(ps, (True, False, True))]) == len(ps)
    return ps, opt


@pytest.mark.parametrize("tile", [(128, 2, 8, 4), (64, 2, 4, 2), (32, 2, 4, 1)], ids=lambda t: "x".join(map(str, t)))
def test_the_step_writes_what_the_plain_step_writes_and_the_erefs_of_it(gen, monkeypatch, tile):
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)  # small weights through the kernels (interpreter)
    for name, value in zip(("BR", "NB", "NUM_WARPS", "SLICES"), tile):
        monkeypatch.setattr(adamw_cuda.WeightErefs, name, value)
    shapes = [(200, 96), (128, 64), (64, 160)]
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
        adamw_cuda.adamw_clipped_step(o_fused, factor, erefs=o_fused.weight_erefs)
        for a, b in zip(plain, fused):
            assert torch.equal(a.detach(), b.detach())
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(o_plain.state[a][k], o_fused.state[b][k])
            assert weight_erefs.is_current(b)
            got = o_fused.weight_erefs.of[b][1]
            want = weight_exponents_cuda(b.detach(), hadamards[b], _buffer(b))
            assert torch.equal(got, want), (step, tuple(b.shape))


def test_the_packer_uses_a_buffer_only_while_it_is_current(gen):
    x = torch.nn.Parameter(_fp32_weight(128, 64, gen))
    counter = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    want = mx_operands_reference(x.detach().bfloat16(), granularity=G.ROWWISE, hadamard=True)

    def packed(hadamard=True):
        return mx_operands_cuda_counted(x.detach(), None, counter, True, True, G.ROWWISE, hadamard, "none", False)

    wrong = weight_exponents_cuda(x.detach(), True, _buffer(x))
    wrong += (wrong > 0).int()  # e_ref one binade off: operands that show it
    weight_erefs.track(x, True, wrong)
    assert_bits_equal("row_scale", packed()[1], want.row_scale)  # tracked, never marked current
    weight_erefs.mark_current(x)
    assert not torch.equal(packed()[1], want.row_scale)  # current: the buffer is used (an alias too)
    assert torch.equal(packed(hadamard=False)[1], mx_operands_cuda(x.detach(), hadamard=False).row_scale)
    with torch.no_grad():
        x.mul_(1.0)  # any write through torch bumps the version
    rd, rs, cd, cs = packed()[:4]
    for name, got in zip(FIELDS, (rd, rs, cd, cs)):
        assert_bits_equal(name, got, getattr(want, name))


# ---------------------------------------------------------------------- end to end, on a GPU
def _mlp_run(seed: int, track: bool, captured: bool, steps: int = 4):
    """A two-layer MXFP6 MLP (weights through the kernels) trained with clipping, eager or captured."""
    from mxflux.nn import MXFP6Linear, rowwise_mx_weights
    from mxflux.train.clipping import clip_and_step

    torch.manual_seed(seed)
    model = torch.nn.Sequential(MXFP6Linear(512, 1024), torch.nn.GELU(approximate="tanh"),
                                MXFP6Linear(1024, 512)).cuda()
    opt = ClippingAdamW(model.parameters(), kernel="triton", fused=True, capturable=captured, **HP)
    if track:
        assert opt.track_weight_erefs(rowwise_mx_weights(model)) == 2
    xs = [torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(steps)]
    static = torch.empty_like(xs[0])

    def step():
        loss = model(static).float().square().mean()
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
            opt.refresh_weight_erefs()
            graph.replay()
            losses.append(float(out))
        else:
            losses.append(float(step()))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="end-to-end training on a GPU")
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_training_with_the_erefs_from_the_step_is_bit_identical(captured):
    seed = int(torch.randint(0, 2**31, (1,)))
    l0, w0 = _mlp_run(seed, track=False, captured=captured)
    l1, w1 = _mlp_run(seed, track=True, captured=captured)
    assert l0 == l1, (seed, l0, l1)
    for a, b in zip(w0, w1):
        assert torch.equal(a, b), seed
