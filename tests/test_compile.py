"""torch.compile sees MX linears as custom ops: zero graph breaks, compiled == eager bit for bit."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from mxflux.nn import FusedMXFP6MLP, MXFP6Linear
from mxflux.ops.custom_ops import mx_operands_op, scaled_gemm_op


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def stack():
    return nn.Sequential(
        MXFP6Linear(128, 256), FusedMXFP6MLP(256, 512, mode="on"), MXFP6Linear(256, 128, mx_gemm="blockwise"),
        MXFP6Linear(128, 128, mx_gemm="exact"),
    ).bfloat16()


def test_fullgraph_forward_and_backward_without_graph_breaks_and_bit_equal(gen):
    model = stack()
    # The input requires grad: otherwise dynamo never reaches the backward and would report
    # zero breaks whatever is in there.
    x = torch.randn(2, 48, 128, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(2, 48, 128, generator=gen).bfloat16()

    y = model(x)
    y.backward(dy)
    eager = [y.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None

    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.backward(dy)
    got = [y.detach(), x.grad] + [p.grad for p in model.parameters()]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    for a, b in zip(eager, got):
        assert torch.equal(a, b)


def test_custom_ops_pass_opcheck(gen):
    x = torch.randn(40, 64, generator=gen).bfloat16()
    h = torch.randn(40, 64, generator=gen).bfloat16()
    outside = torch.zeros(1, dtype=torch.int64)
    for args in [
        (x, None, outside, True, True, "rowwise", True, "none", True),
        (x, h, outside, True, True, "exact", True, "gelu_tanh_grad", True),
        (x, None, outside, False, True, "rowwise", False, "gelu_tanh", False),
        (torch.randn(40, 128, generator=gen).bfloat16(), None, outside, True, True, "blockwise", True, "none", False),
    ]:
        torch.library.opcheck(mx_operands_op, args, test_utils=("test_schema", "test_faketensor"))
    # (test_schema compares FP8 inputs arithmetically, which CPU FP8 tensors do not support.)
    for granularity in ("rowwise", "exact"):
        rd, rs, _, _, _ = mx_operands_op(x, None, outside, True, False, granularity, True, "none", False)
        torch.library.opcheck(scaled_gemm_op, (rd, rs, rd[:32], rs[:32], granularity, None, torch.bfloat16),
                              test_utils=("test_faketensor",))


def test_compiled_blocks_outside_window_equals_eager(gen):
    """The packers' in-place count of blocks outside the fold window survives functionalization:
    a compiled forward+backward adds exactly what the eager one adds."""
    x = torch.randn(64, 128, generator=gen)
    x[:, 32:64] *= 2.0**-20  # 20 binades below the row's largest block: outside the window
    x = x.bfloat16().requires_grad_()
    dy = torch.randn(64, 128, generator=gen).bfloat16()
    layer = MXFP6Linear(128, 128).bfloat16()

    layer(x).backward(dy)
    eager = int(layer.blocks_outside_window)
    assert eager > 0
    layer.blocks_outside_window.zero_()
    torch.compile(layer, fullgraph=True)(x).backward(dy)
    assert int(layer.blocks_outside_window) == eager


def test_six_bit_saved_operands_compile_fullgraph_and_equal_e4m3(gen):
    """saved_operands="e2m3": the compact / expand ops trace with no graph break, and the compiled
    step equals the eager e4m3 one bit for bit."""
    x = torch.randn(2, 48, 128, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(2, 48, 128, generator=gen).bfloat16()
    results = {}
    for saved in ("e4m3", "e2m3"):
        torch.manual_seed(0)
        model = nn.Sequential(MXFP6Linear(128, 256, saved_operands=saved),
                              FusedMXFP6MLP(256, 512, mode="on", saved_operands=saved),
                              MXFP6Linear(256, 128, saved_operands=saved)).bfloat16()
        if saved == "e2m3":
            model = torch.compile(model, fullgraph=True)
        x.grad = None
        y = model(x)
        y.backward(dy)
        results[saved] = [y.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for a, b in zip(results["e4m3"], results["e2m3"]):
        assert torch.equal(a, b)


def test_compaction_ops_pass_opcheck(gen):
    from mxflux.ops import compact_operand, expand_operand

    x = torch.randn(40, 64, generator=gen).bfloat16()
    _, _, cd, _, _ = mx_operands_op(x, None, torch.zeros(1, dtype=torch.int64), False, True, "rowwise", True,
                                 "none", False)
    torch.library.opcheck(compact_operand, (cd,), test_utils=("test_faketensor",))
    packed, shifts = compact_operand(cd)
    torch.library.opcheck(expand_operand, (packed, shifts), test_utils=("test_schema", "test_faketensor"))
