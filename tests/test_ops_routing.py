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


def test_mx_erefs_finds_the_e_ref_the_packer_encodes_against(gen):
    """`mxflux::mx_erefs` (the row granularity's first pass alone) on the CPU: per row and per column
    (R zero-padded) e_ref + 128 where the line has a live block, 0 where it has none, in the buffer
    layout `erefs` takes: for every live line the reference packer's scale is 2^(e_ref - 5) (E2M3's
    fold shift); a row and a column of zeros, NaN blocks and a column scaled far up included; fp32 as its bf16
    rounding; the fake has the real shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxflux.kernels.weight_erefs import buffer_words, rows_and_columns
    from mxflux.mx import mx_operands_reference

    x = torch.randn(70, 96, generator=gen).bfloat16()
    x[3] = 0
    x[:, 40] = 0
    x[:, 37] *= 2.0**20
    x[9, 64] = float("nan")  # a NaN block: never sets its line's e_ref
    x[9, 65:96] = 0
    buf = custom_ops.mx_erefs(x, True)
    assert buf.dtype == torch.int32 and buf.shape == (buffer_words(70, 96),)
    rows, cols = rows_and_columns(buf, 70, 96)
    ref = mx_operands_reference(x)
    for got, scale in ((rows[:70], ref.row_scale.flatten()), (cols, ref.col_scale.flatten())):
        live = got > 0
        assert live.any() and (~live).any()
        assert torch.equal(scale[live], torch.exp2((got[live] - 128 - 5).float()))
    assert not rows[3] and not rows[70:].any() and not cols[40]  # the zero row and column, the padding
    assert cols[37] - 128 > cols[36] - 128 + 15  # the scaled column's e_ref
    assert torch.equal(custom_ops.mx_erefs(x.float(), True), buf)
    with FakeTensorMode() as mode:
        fake = custom_ops.mx_erefs(mode.from_tensor(x), True)
    assert fake.shape == buf.shape and fake.dtype == torch.int32
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        custom_ops.mx_erefs(x[0], True)
