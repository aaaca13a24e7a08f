"""MXFP6Linear / FusedMXFP6MLP on CUDA (kernels) against the CPU reference path."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from mxflux.mx import snr_db
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear
from mxflux.ops import custom_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def pinned(monkeypatch):
    monkeypatch.setattr(custom_ops, "FORCE_REFERENCE", False)


def run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in layer.parameters()]


def fp64(lin, x, dy):
    ref = nn.Linear(lin.in_features, lin.out_features).double().cpu()
    ref.load_state_dict({k: v.double().cpu() for k, v in lin.state_dict().items()})
    return run(ref, x.double().cpu(), dy.double().cpu())


@pytest.mark.parametrize("mode", ["rowwise", "blockwise", "exact"])
@pytest.mark.parametrize("m, k, n", [(1024, 3072, 3072), (500, 3072, 9216), (512, 12288, 3072)])
def test_mxfp6_linear_gpu_matches_the_cpu_reference(gen, mode, m, k, n):
    if mode == "blockwise" and (k % 128 or n % 128):
        pytest.skip("block-wise needs multiples of 128")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    base = nn.Linear(k, n).bfloat16()
    nn.init.normal_(base.bias, std=0.1)
    x = torch.randn(m, k).bfloat16()
    dy = torch.randn(m, n).bfloat16()
    cpu = [t.detach().clone() for t in run(MXFP6Linear.from_linear(base, mx_gemm=mode), x, dy)]
    gpu_layer = MXFP6Linear.from_linear(base.cuda(), mx_gemm=mode)
    gpu = [t.cpu() for t in run(gpu_layer, x.cuda(), dy.cuda())]
    want = [t.cpu() for t in fp64(base, x, dy)]
    for name, c, g, r in zip(["fprop", "dgrad", "wgrad", "bgrad"], cpu, gpu, want):
        s_cpu, s_gpu = snr_db(r, c), snr_db(r, g)
        print(f"{mode} M={m} K={k} N={n} {name}: SNR vs fp64 cpu {s_cpu:.3f} gpu {s_gpu:.3f}; "
              f"gpu vs cpu {snr_db(c.float(), g.float()):.1f} dB")
        # Same codes and scales; only the GEMM's fp32 summation order differs.
        assert abs(s_cpu - s_gpu) < 0.05, (name, s_cpu, s_gpu)
        assert snr_db(c.float(), g.float()) > 45, name
        if name != "bgrad":
            assert s_gpu > 24, (name, s_gpu)
    assert int(gpu_layer.blocks_outside_window) == 0


def test_fused_mlp_gpu_against_unfused_and_cpu(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    mlp = FusedMXFP6MLP(3072, 12288, mode="on").bfloat16()
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.02)
    unfused = FusedMXFP6MLP(3072, 12288, mode="off").bfloat16()
    unfused.load_state_dict(mlp.state_dict())
    x = torch.randn(2048, 3072).bfloat16()
    dy = torch.randn(2048, 3072).bfloat16()
    fused_gpu = [t.cpu() for t in run(mlp.cuda(), x.cuda(), dy.cuda())]
    unfused_gpu = [t.cpu() for t in run(unfused.cuda(), x.cuda(), dy.cuda())]
    for name, a, b in zip(["y", "dx", "w1", "b1", "w2", "b2"], fused_gpu, unfused_gpu):
        s = snr_db(b.float(), a.float())
        print(f"fused vs unfused on GPU, {name}: {s:.1f} dB")
        assert s > 40, (name, s)


def test_compile_clean_on_gpu():
    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(MXFP6Linear(3072, 3072), FusedMXFP6MLP(3072, 12288, mode="on"),
                          MXFP6Linear(3072, 3072, mx_gemm="blockwise"),
                          MXFP6Linear(3072, 3072, mx_gemm="exact")).cuda().bfloat16()
    x = torch.randn(2, 512, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 512, 3072, device="cuda", dtype=torch.bfloat16)
    y = model(x)
    y.backward(dy)
    eager = [y.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None
    y = torch.compile(model, fullgraph=True)(x)
    y.backward(dy)
    assert sum(counters["graph_break"].values()) == 0
    got = [y.detach(), x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(eager, got))


def test_a_compiled_block_under_mx_packers_packs_apart_and_matches_the_plain_block(gen):
    """A Flux double block on CUDA, compiled, under `activation_checkpointing: mx_packers` with
    `repack_weights`: its MX linears pack their inputs apart (the e_ref by `mxflux::mx_erefs`, each
    orientation by its own pass-2 call), so backward re-runs only the col operands' calls (pass 2 from
    kept e_ref, col only; no first pass), and outputs, gradients and fold-window counts equal the plain
    compiled block's bit for bit."""
    import copy

    from test_nn_recompute import _MXCalls as Calls

    from mxflux.model import Flux, flux_config, image_ids, text_ids
    from mxflux.nn import apply_precision
    from mxflux.train.config import load_recipe
    from mxflux.train.parallelize import checkpoint_block

    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    cfg = flux_config("flux-tiny", depth=1, depth_single_blocks=1, hidden_size=256, num_heads=4)
    model = Flux(cfg)
    apply_precision(model, load_recipe("tiny-mxfp6").precision.model_copy(update={"repack_weights": True,
                                                                                  "fused_mlp": "off"}))
    plain = model.double_blocks[0].cuda()
    wrapped = checkpoint_block(copy.deepcopy(plain), "mx_packers")
    b, n_txt, side, d = 2, 32, 8, cfg.hidden_size
    vec = torch.randn(b, d, generator=gen).cuda()
    pe = model.pe_embedder(torch.cat([text_ids(b, n_txt), image_ids(b, side, side)], 1)).cuda()
    xs = [torch.randn(b, side * side, d, generator=gen).cuda(), torch.randn(b, n_txt, d, generator=gen).cuda()]
    grads_out = None
    results = []
    for block in (plain, wrapped):
        block.compile()
        for _ in range(2):  # the first call compiles
            inputs = [x.clone().requires_grad_() for x in xs]
            block.zero_grad()
            for m in block.modules():
                if isinstance(m, MXFP6Linear):
                    m.blocks_outside_window.zero_()
            with torch.autocast("cuda", dtype=torch.bfloat16):  # (a dispatch mode here would make it eager)
                out = block(*inputs, vec, pe)
            if grads_out is None:
                grads_out = [torch.randn(o.shape, generator=gen).to(o) for o in out]
            with Calls() as bwd:
                torch.autograd.backward(out, grads_out)
        counts = [int(m.blocks_outside_window) for m in block.modules() if isinstance(m, MXFP6Linear)]
        results.append(([*out, *(x.grad for x in inputs), *(p.grad for p in block.parameters())], counts,
                        bwd.calls))
    (ref, ref_counts, _), (got, counts, bwd) = results
    for i, (a, b_) in enumerate(zip(ref, got)):
        assert torch.equal(a, b_), i
    assert counts == ref_counts
    recomputed = [c for c in bwd if c[0] == "pack" and c[3]]
    assert recomputed and all(c == ("pack", False, True, True) for c in recomputed), bwd
    assert ("erefs", None, None, None) not in bwd
