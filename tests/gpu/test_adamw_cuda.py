"""The Triton AdamW step with the clipping factor (`mxflux.train.adamw_cuda`) against AdamW in fp64.

Runs on CUDA, and on a CPU machine with Triton under its interpreter (`TRITON_INTERPRET=1`). Each
parameter's update must be as close to the fp64 AdamW as torch's fused kernel's is (both are fp32
arithmetic), the moments likewise, the step counts and the state layout torch's; a captured step
replays to the eager result."""

from __future__ import annotations

import pytest
import torch

from pack_inputs import TRITON_DEVICE, dev_gen, triton_marks

from mxflux.train import adamw_cuda
from mxflux.train.clipping import clip_and_step
from mxflux.train.optimizer import ClippingAdamW

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
SHAPES = [(300, 256), (adamw_cuda.LARGE + 5,), (17,), (3, 64)]  # two through the kernel, two small
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _adamw64(p, m, v, g, step, lr, beta1, beta2, eps, weight_decay):
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    return p - (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps), m, v


def _params(gen):
    g = dev_gen(gen, DEVICE)
    return [torch.randn(s, generator=g, device=DEVICE) for s in SHAPES]


@pytest.mark.parametrize("factor", [1.0, 0.0371])
def test_the_kernel_step_is_as_close_to_fp64_adamw_as_torchs(gen, factor):
    init = _params(gen)
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    o1 = ClippingAdamW(ours, kernel="triton", fused=True, **HP)
    o2 = torch.optim.AdamW(theirs, fused=True, **HP)
    ref = [(x.double(), torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64))
           for x in init]
    g = dev_gen(gen, DEVICE)
    f = torch.tensor(factor, device=DEVICE)
    for step in range(1, 5):
        grads = [5 * torch.randn(s, generator=g, device=DEVICE) for s in SHAPES]
        for a, b, gr in zip(ours, theirs, grads):
            a.grad = torch.full_like(gr, float("nan")).copy_(gr)
            b.grad = gr.clone()
        adamw_cuda.adamw_clipped_step(o1, f)  # the kernel directly: on the interpreter too
        torch._foreach_mul_([b.grad for b in theirs], f)
        o2.step()
        ref = [_adamw64(p, m, v, (gr * f).double(), step, HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"])
               for (p, m, v), gr in zip(ref, grads)]
        for a, gr in zip(ours, grads):
            assert torch.equal(a.grad, gr)  # gradients are read, not written
    for a, b, (p, m, v) in zip(ours, theirs, ref):
        sa, sb = o1.state[a], o2.state[b]
        assert float(sa["step"]) == 4.0
        assert sa["step"].dtype == sb["step"].dtype and sa["step"].device == sb["step"].device
        for got, want, exact in ((a, b, p), (sa["exp_avg"], sb["exp_avg"], m), (sa["exp_avg_sq"], sb["exp_avg_sq"], v)):
            err_ours = (got.double() - exact).abs().max()
            err_torch = (want.double() - exact).abs().max()
            scale = exact.abs().max()
            assert err_ours <= 2 * err_torch + 2**-22 * scale, (a.shape, float(err_ours), float(err_torch))
    assert o1.state_dict()["state"].keys() == o2.state_dict()["state"].keys()


def _clipped_run(init, grads, captured: bool):
    """Four clipped steps from `init` over `grads` (norms ~ 100: clipped), eager or replayed."""
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = ClippingAdamW(ps, kernel="triton", fused=True, capturable=True, **HP)
    static = [torch.zeros_like(x) for x in init]

    def step():
        for p, s in zip(ps, static):
            p.grad = s.clone()
        return clip_and_step(opt, ps, 1.0)

    norms = []
    if captured:
        for p in ps:
            adamw_cuda._state(opt, p)  # torch's zero state, made before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    for gr in grads:
        for s, x in zip(static, gr):
            s.copy_(x)
        if captured:
            graph.replay()
        else:
            out = step()
        norms.append(float(out))
    return [p.detach().clone() for p in ps], norms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA device")
def test_a_captured_clipped_step_replays_the_eager_one(gen):
    init = _params(gen)
    g = dev_gen(gen, DEVICE)
    grads = [[30 * torch.randn(s, generator=g, device=DEVICE) for s in SHAPES] for _ in range(4)]
    w_eager, n_eager = _clipped_run(init, grads, captured=False)  # also compiles the kernel
    w_graph, n_graph = _clipped_run(init, grads, captured=True)
    assert n_graph == n_eager and all(n > 1 for n in n_eager)
    for a, b in zip(w_eager, w_graph):
        assert torch.equal(a, b)
