"""Gradient clipping inside the optimizer's pass (`mxflux.train.clipping.clip_and_step`,
`ClippingAdamW.step(grad_factor=...)`) on the CPU: the same norm as torch's `clip_grad_norm_`;
torch's fused kernel given 1/factor as its grad_scale (bit for bit what it computes with the
divided gradients), bit-identical to torch's path where nothing is clipped; the foreach AdamW
multiplying as torch's clipping does; torch's own pass for other optimizers. The Triton kernel's
tests are in tests/gpu/test_adamw_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxflux.train import load_recipe
from mxflux.train.clipping import clip_and_step
from mxflux.train.optimizer import ClippingAdamW
from mxflux.train.trainer import Trainer


def _model_and_grads(gen, scale: float):
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 48), (48,), (7, 5, 3))]
    grads = [scale * torch.randn(p.shape, generator=gen) for p in params]
    return params, grads


def _copy(params, grads):
    ps = [nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def _adamw(params, cls=ClippingAdamW, **kw):
    return cls(params, lr=1e-2, weight_decay=0.1, **({"fused": True} | kw))


@pytest.mark.parametrize("steps", [1, 3])
def test_folded_clipping_updates_with_the_factor_inside_the_fused_step(gen, steps):
    params, _ = _model_and_grads(gen, 1.0)
    folded, torch_path, by_hand = _copy(params, [torch.zeros_like(p) for p in params]), \
        _copy(params, [torch.zeros_like(p) for p in params]), _copy(params, [torch.zeros_like(p) for p in params])
    opts = [_adamw(ps) for ps in (folded, torch_path, by_hand)]  # kernel="torch": torch's fused kernel
    for _ in range(steps):
        grads = [30.0 * torch.randn(p.shape, generator=gen) for p in params]  # norm ~ 300: clipped to 1
        for ps in (folded, torch_path, by_hand):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        norm = clip_and_step(opts[0], folded, 1.0)
        want = nn.utils.clip_grad_norm_(torch_path, 1.0)
        opts[1].step()
        assert torch.equal(norm, want) and float(norm) > 100
        # what the fused kernel is given: each gradient divided by 1 / torch's factor
        factor = torch.clamp(1.0 / (nn.utils.get_total_norm(grads, 2.0) + 1e-6), max=1.0)
        for p, g in zip(by_hand, grads):
            p.grad = g / factor.reciprocal()
        opts[2].step()
    for a, b, c in zip(folded, torch_path, by_hand):
        assert torch.equal(a, c)
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)  # g / (1/c) against g * c: one rounding
    assert not hasattr(opts[0], "grad_scale")  # the hook is set only for the step


def test_folded_clipping_is_torchs_step_bit_for_bit_where_nothing_is_clipped(gen):
    params, grads = _model_and_grads(gen, 1e-3)
    folded, torch_path = _copy(params, grads), _copy(params, grads)
    o1, o2 = _adamw(folded), _adamw(torch_path)
    norm = clip_and_step(o1, folded, 1.0)
    want = nn.utils.clip_grad_norm_(torch_path, 1.0)
    o2.step()
    assert torch.equal(norm, want) and float(norm) < 1.0
    for a, b in zip(folded, torch_path):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["foreach", "for-loop", "torch's AdamW", "sgd", "switched off"])
def test_without_a_fused_kernel_the_factor_is_torchs_own_multiplication(gen, kind):
    """ClippingAdamW's foreach and per-parameter forms multiply the gradients as clip_grad_norm_
    does; torch's own optimizers and in_optimizer=False get torch's pass: all bit for bit."""
    params, grads = _model_and_grads(gen, 30.0)
    mine, theirs = _copy(params, grads), _copy(params, grads)

    def make(ps, cls=ClippingAdamW):
        if kind == "sgd":
            return torch.optim.SGD(ps, lr=1e-2)
        if kind == "switched off":
            return _adamw(ps, cls)
        if kind == "torch's AdamW":
            return _adamw(ps, torch.optim.AdamW)
        return _adamw(ps, cls, fused=None, foreach=kind == "foreach")

    o1, o2 = make(mine), make(theirs, torch.optim.AdamW)
    norm = clip_and_step(o1, mine, 1.0, in_optimizer=kind != "switched off")
    want = nn.utils.clip_grad_norm_(theirs, 1.0)
    o2.step()
    assert torch.equal(norm, want)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)


def test_a_non_finite_norm_poisons_the_step_as_torchs_does(gen):
    params, grads = _model_and_grads(gen, 1.0)
    grads[1][3] = float("inf")
    folded, torch_path = _copy(params, grads), _copy(params, grads)
    o1, o2 = _adamw(folded), _adamw(torch_path)
    norm = clip_and_step(o1, folded, 1.0)
    want = nn.utils.clip_grad_norm_(torch_path, 1.0)
    o2.step()
    assert torch.isinf(norm) and torch.isinf(want)
    for a, b in zip(folded, torch_path):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_a_factor_is_refused_with_a_closure_and_the_kernel_named(gen):
    params, grads = _model_and_grads(gen, 1.0)
    opt = _adamw(_copy(params, grads))
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0, grad_factor=torch.ones(()))
    with pytest.raises(ValueError, match="kernel: expected 'triton' or 'torch', got 'cuda'"):
        ClippingAdamW(params, kernel="cuda")


def test_the_trainer_clips_inside_the_optimizer_by_default(tmp_path):
    from mxflux.data import build_demo_dataset

    root = build_demo_dataset(tmp_path / "data", n_train=32, n_eval=8, seed=3)
    runs = {}
    for fold in (True, False):
        cfg = load_recipe("tiny-bf16", [f"data.root={root}", f"train.out_dir={tmp_path}/run-{fold}",
                                        "batch.global_batch_size=8", "batch.micro_batch_size=8",
                                        "optim.grad_clip=0.01", f"optim.clip_in_optimizer={str(fold).lower()}"])
        tr = Trainer(cfg, device="cpu")
        batches = tr.batches()
        results = [tr.train_step([next(batches)]).read() for _ in range(4)]
        runs[fold] = (results, [p.detach().clone() for p in tr.model.parameters()])
    (folded, w_folded), (separate, w_separate) = runs[True], runs[False]
    assert all(r["grad_norm"] > 0.01 for r in folded)  # every step clipped
    assert folded[0]["grad_norm"] == separate[0]["grad_norm"]  # the same norm, logged
    for a, b in zip(folded, separate):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(w_folded, w_separate))  # the fold ran: one rounding apart
    for a, b in zip(w_folded, w_separate):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_triton_kernel_is_chosen_only_for_what_it_computes(gen):
    """`adamw_cuda.eligible`: never for CPU parameters, a foreach or amsgrad AdamW, bf16 gradients,
    or non-contiguous ones (these take torch's kernels through ClippingAdamW's other paths)."""
    from mxflux.train import adamw_cuda

    params, grads = _model_and_grads(gen, 1.0)
    ps = _copy(params, grads)
    assert not adamw_cuda.eligible(_adamw(ps, kernel="triton"), ps)  # CPU tensors
    assert not adamw_cuda.eligible(_adamw(ps, fused=None, foreach=True), ps)
    assert not adamw_cuda.eligible(_adamw(ps, amsgrad=True), ps)
    assert not adamw_cuda.eligible(torch.optim.SGD(ps, lr=1.0), ps)
    if torch.cuda.is_available():
        cuda = [nn.Parameter(p.detach().cuda()) for p in params]
        for p, g in zip(cuda, grads):
            p.grad = g.cuda()
        opt = _adamw(cuda, kernel="triton")
        assert adamw_cuda.eligible(opt, cuda) == adamw_cuda.HAS_TRITON
        cuda[0].grad = cuda[0].grad.bfloat16()
        assert not adamw_cuda.eligible(opt, cuda)
        cuda[0].grad = torch.zeros(48, 64, device="cuda").t()
        assert not adamw_cuda.eligible(opt, cuda)
