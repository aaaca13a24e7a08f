"""`mxflux.optim.AdamW` in a loop of one's own takes the trainer's step: the Triton AdamW that
writes the MXFP6 weights' e_ref and operands, the clipping in its pass.

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`; the
kernels' device widened to the CPU, small weights let through, as the other step tests do).
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import TRITON_DEVICE, triton_marks

from mxflux.nn import MXFP6Linear, MXWeightState
from mxflux.optim import AdamW
from mxflux.train import adamw_cuda
from mxflux.train.clipping import clip_and_step
from mxflux.train.optimizer import ClippingAdamW

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    monkeypatch.setattr(adamw_cuda, "LARGE", 1024)  # small weights through the kernels (interpreter)
    if DEVICE == "cpu":
        monkeypatch.setattr(adamw_cuda, "on_kernel_device", lambda t: t.device.type == "cpu")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(MXFP6Linear(64, 96), torch.nn.GELU(approximate="tanh"),
                               MXFP6Linear(96, 64)).to(DEVICE)


def _train(model, opt, step, xs):
    losses = []
    for x in xs:
        loss = model(x).float().square().mean()
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["unclipped", "clipped"])
def test_the_users_adamw_is_the_trainers_step(gen, max_grad_norm):
    """Its losses and weights equal, bit for bit, those of the trainer's optimizer (`build_optimizer`'s
    ClippingAdamW with the weights' state attached, `clip_and_step`, or a factor of 1 unclipped); its
    steps go through the Triton kernel, which keeps both layers' operands current after each step."""
    seed = int(torch.randint(2**31, (1,), generator=gen))
    xs = [torch.randn(40, 64, generator=gen).to(DEVICE, torch.bfloat16) * 4 for _ in range(3)]

    ref_model = _model(seed)
    ref = ClippingAdamW(ref_model.parameters(), kernel="triton", fused=True, **HP)
    ref.weight_state = MXWeightState.of_model(ref_model, keep_operands=True, min_elements=adamw_cuda.LARGE)
    ref.weight_state.install(ref_model)
    one = torch.ones((), device=DEVICE)
    ref_losses, ref_weights = _train(ref_model, ref, (lambda: clip_and_step(ref, ref_model.parameters(), max_grad_norm))
                                     if max_grad_norm else (lambda: ref.step(grad_factor=one)), xs)

    model = _model(seed)
    opt = AdamW(model, max_grad_norm=max_grad_norm, **HP)
    assert opt.weight_state is not None and len(opt.weight_state.kept) == 2
    losses, weights = _train(model, opt, opt.step, xs)
    assert opt.last_step == "triton"
    assert all(opt.weight_state.is_current(m.weight) for m in model if isinstance(m, MXFP6Linear))
    assert losses == ref_losses
    for a, b in zip(weights, ref_weights):
        assert torch.equal(a, b)
    assert (opt.last_grad_norm is None) == (max_grad_norm is None)
    # and torch's AdamW, unclipped, takes the same first step to fp32 rounding (another kernel; later
    # steps part further, a rounding of the weights moving an MX value)
    if max_grad_norm is None:
        torch_model, our_model = _model(seed), _model(seed)
        torch_opt = torch.optim.AdamW(torch_model.parameters(), fused=True, **HP)
        our_opt = AdamW(our_model, **HP)
        _, torch_weights = _train(torch_model, torch_opt, torch_opt.step, xs[:1])
        _, our_weights = _train(our_model, our_opt, our_opt.step, xs[:1])
        for a, b in zip(our_weights, torch_weights):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
