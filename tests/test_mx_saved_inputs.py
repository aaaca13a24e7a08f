"""`precision.mx_saved: inputs`: forward keeps the bf16 inputs, backward re-packs their col operands.

The packer is deterministic, so every output, gradient and fold counter must equal the default
`operands` mode bit for bit; what changes is only what autograd keeps (docs/design.md, "The three
GEMMs and their operands"). On the CPU (numba packer) and, with a GPU, on CUDA (Triton packer).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from mxflux.model import Flux, flux_config
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear, apply_precision
from mxflux.nn.precision.config import PrecisionConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _wide_range(shape, gen, device):
    """Random bf16 values whose 32-blocks span 2^-30..2^4, so some fall outside the fold window."""
    x = torch.randn(*shape, generator=gen)
    blocks = x.view(*shape[:-1], shape[-1] // 32, 32)
    blocks.mul_(torch.exp2(torch.randint(-30, 5, (*shape[:-1], shape[-1] // 32, 1), generator=gen).float()))
    return x.bfloat16().to(device)


def _run(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    counters_ = [m.blocks_outside_window.clone() for m in module.modules() if isinstance(m, MXFP6Linear)]
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()] + counters_


def _pair(make, gen, device):
    a = make("operands").to(device)
    for p in a.parameters():
        nn.init.normal_(p, std=0.05, generator=gen)
    b = make("inputs").to(device)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mx_gemm", ["rowwise", "blockwise", "exact"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_saving_inputs_is_bit_identical(device, mx_gemm, bias, gen):
    a, b = _pair(lambda s: MXFP6Linear(256, 384, bias=bias, mx_gemm=mx_gemm, saved=s).bfloat16(), gen, device)
    x = _wide_range((3, 70, 256), gen, device)  # 210 tokens: wgrad's axis is zero-padded
    dy = _wide_range((3, 70, 384), gen, device)
    ra, rb = _run(a, x, dy), _run(b, x, dy)
    for i, (ta, tb) in enumerate(zip(ra, rb)):
        assert torch.equal(ta, tb), i
    if mx_gemm != "exact":  # one scale per block: nothing is ever outside the window
        assert ra[-1].item() > 0, "the inputs put no block outside the window: the counter test is void"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["on", "off"])
def test_mlp_saving_inputs_is_bit_identical(device, mode, gen):
    a, b = _pair(lambda s: FusedMXFP6MLP(256, 512, mode=mode, saved=s).bfloat16(), gen, device)
    x = _wide_range((2, 48, 256), gen, device)
    dy = _wide_range((2, 48, 256), gen, device)
    for i, (ta, tb) in enumerate(zip(_run(a, x, dy), _run(b, x, dy))):
        assert torch.equal(ta, tb), i


@pytest.mark.parametrize("device", DEVICES)
def test_linear_saving_inputs_keeps_the_input_and_weight_themselves(device, gen):
    layer = MXFP6Linear(256, 128, saved="inputs", device=device)
    x = torch.randn(64, 256, generator=gen).bfloat16().to(device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.bfloat16]
    assert saved[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # by reference
    assert torch.equal(saved[1], layer.weight.detach().bfloat16())  # the bf16 weight, no FP8 copy


def test_the_recipe_field_reaches_every_mx_module():
    model = Flux(flux_config("flux-tiny", depth=1, depth_single_blocks=1))
    apply_precision(model, PrecisionConfig(fp6="e2m3", mx_saved="inputs"))
    mx = [m for m in model.modules() if isinstance(m, MXFP6Linear)]
    assert mx and all(m.cfg.saved == "inputs" for m in mx)
    with pytest.raises(ValueError, match="mx_saved"):
        PrecisionConfig(fp8="hybrid", mx_saved="inputs")  # an MXFP6 option in an FP8 recipe
    with pytest.raises(ValueError, match="mx_saved"):
        PrecisionConfig(fp6="e2m3", mx_saved="everything")
    with pytest.raises(ValueError, match="saved must be one of"):
        MXFP6Linear(64, 64, saved="bf16")


def test_compiled_saving_inputs_equals_compiled_saving_operands(gen):
    """Both compiled (inductor's LayerNorm and GELU round differently from eager's), with the
    partitioner free to recompute the LayerNorm output that the "inputs" mode hands to backward."""
    torch._dynamo.reset()
    counters.clear()
    try:
        def stack(saved):
            return nn.Sequential(nn.LayerNorm(128), MXFP6Linear(128, 256, saved=saved), nn.GELU(approximate="tanh"),
                                 MXFP6Linear(256, 128, saved=saved)).bfloat16()
        operands, inputs = _pair(stack, gen, "cpu")
        x = torch.randn(2, 40, 128, generator=gen).bfloat16()
        dy = torch.randn(2, 40, 128, generator=gen).bfloat16()
        want = _run(torch.compile(operands, fullgraph=True), x, dy)
        got = _run(torch.compile(inputs, fullgraph=True), x, dy)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        for i, (ta, tb) in enumerate(zip(want, got)):
            assert torch.equal(ta, tb), i
    finally:
        torch._dynamo.reset()
