"""Which packer op a call becomes (`mxflux.ops.mx_operands`): with the inline packers on
(`MXFLUX_INLINE_PACK=1`, opt-in), inside compiled code on CUDA, a call without a prologue is the
inline op that inductor launches from its own code; every other call is the opaque op. The routing
is settings and flags only, so it is checked here with both ops replaced by recorders (the ops
themselves: tests/gpu/test_operands_inline.py)."""

from __future__ import annotations

import pytest
import torch

from mxflux.nn.functional import MXConfig, _pack
from mxflux.ops import custom_ops


@pytest.fixture
def calls(monkeypatch):
    """Both ops recorded instead of run; compiling and CUDA kernels pretended."""
    seen = []
    monkeypatch.setattr(custom_ops, "mx_operands_inline", lambda *a: seen.append("inline") or (None,) * 5)
    monkeypatch.setattr(custom_ops, "mx_operands_op", lambda *a: seen.append("op") or (None,) * 5)
    monkeypatch.setattr(custom_ops, "INLINE_PACK", True)
    monkeypatch.setattr(custom_ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(custom_ops, "static_launch_on", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    return seen


def _call(counter=None, prologue="none", **kw):
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int64) if counter is None else counter
    custom_ops.mx_operands(x, None, counter, True, True, "rowwise", True, prologue, False, **kw)


def test_compiled_cuda_calls_without_a_prologue_are_inline(calls):
    _call()
    assert calls == ["inline"]


@pytest.mark.parametrize("case", ["prologue", "counter dtype", "counter size", "not inline", "switched off",
                                  "eager", "no kernels", "no static launch"])
def test_every_other_call_is_the_opaque_op(calls, case, monkeypatch):
    if case == "switched off":
        monkeypatch.setattr(custom_ops, "INLINE_PACK", False)
    if case == "no static launch":  # inductor would launch the inlined kernels on Triton's slower launcher
        monkeypatch.setattr(custom_ops, "static_launch_on", lambda: False)
    if case == "eager":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    if case == "no kernels":  # the reference forced, or not CUDA
        monkeypatch.setattr(custom_ops, "use_kernels", lambda t: False)
    _call(prologue="gelu_tanh" if case == "prologue" else "none",
          counter={"counter dtype": torch.zeros(1, dtype=torch.int32),
                   "counter size": torch.zeros(2, dtype=torch.int64)}.get(case),
          inline=case != "not inline")
    assert calls == ["op"]


@pytest.mark.parametrize("recomputed, want", [(False, "inline"), (True, "op")])
def test_a_recomputed_layers_calls_stay_the_op_the_recompute_policy_sees(calls, recomputed, want):
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    _pack(x, MXConfig(recomputed=recomputed), torch.zeros(1, dtype=torch.int64))
    assert calls == [want]


@pytest.mark.parametrize("static", [True, False])
def test_traced_routing_reads_the_launch_switch_as_a_constant(static, monkeypatch):
    """Under dynamo (fullgraph: no graph break) the routing sees the process's switch as set by
    `static_kernel_launch`: the inline op only while inductor launches user kernels statically."""
    from torch._inductor import config

    seen = []
    monkeypatch.setattr(custom_ops, "INLINE_PACK", True)
    monkeypatch.setattr(custom_ops, "mx_operands_inline", lambda *a: seen.append("inline") or a[0])
    monkeypatch.setattr(custom_ops, "mx_operands_op", lambda *a: seen.append("op") or a[0])
    monkeypatch.setattr(custom_ops, "use_kernels", lambda t: True)

    def pack(x, counter):
        return custom_ops.mx_operands(x, None, counter, True, True, "rowwise", True, "none", False) * 2

    x = torch.ones(64, 64, dtype=torch.bfloat16)
    with config.patch(static_launch_user_defined_triton_kernels=not static):  # (restored after)
        assert custom_ops.static_kernel_launch(static) and custom_ops.static_launch_on() is static
        torch._dynamo.reset()
        out = torch.compile(pack, backend="eager", fullgraph=True)(x, torch.zeros(1, dtype=torch.int64))
        torch._dynamo.reset()
    assert torch.equal(out, x * 2) and seen == ["inline" if static else "op"]
