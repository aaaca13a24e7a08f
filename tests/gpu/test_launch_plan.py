"""The packer's cached launch plans and compiled-kernel launches give the same bits as a first,
uncached call through Triton's normal launch path, and count into the caller's counter exactly
as into the packer's own.

Runs on CUDA (where launches after a plan's first go straight to the compiled kernel with Triton
3.6), and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, small shapes; plans only).
The host-side logic without Triton is in tests/test_kernels_launch_plan.py."""

from __future__ import annotations

import pytest
import torch

from pack_inputs import INTERPRETED, TRITON_DEVICE, adversarial, assert_bits_equal, assert_colsum_close, triton_marks

from mxflux.kernels import mx_operands_cuda
from mxflux.kernels import operands_cuda as oc
from mxflux.kernels import operands_plan as op
from mxflux.kernels.triton_common import compiled_launch_supported
from mxflux.mx import FoldGranularity as G
from mxflux.mx import mx_operands_reference

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
SHAPE = (200, 256) if INTERPRETED else (1000, 3072)
FIELDS = ("row_data", "row_scale", "col_data", "col_scale")


@pytest.fixture(autouse=True)
def fresh_plans():
    oc.clear_launch_plans()
    yield
    oc.clear_launch_plans()


def same(got, want):
    for name in FIELDS:
        assert_bits_equal(name, getattr(got, name), getattr(want, name))


KWS = [dict(granularity=G.ROWWISE), dict(granularity=G.ROWWISE, colsum=True, row=False),
       dict(granularity=G.BLOCKWISE), dict(granularity=G.EXACT, col=False),
       dict(granularity=G.BLOCKWISE, prologue="gelu_tanh", colsum=True)]


@pytest.mark.parametrize("kw", KWS, ids=lambda kw: "-".join(str(getattr(v, "value", v)) for v in kw.values()))
def test_repeated_calls_equal_the_reference_and_count_into_the_counter(kw, gen):
    xs = [adversarial(*SHAPE, gen, DEVICE) for _ in range(3)]
    wants = [mx_operands_reference(x, **kw) for x in xs]
    counter = torch.full((1,), 7, dtype=torch.int64, device=DEVICE)
    for x, want in zip(xs, wants):  # the first call builds the plan, the others reuse it
        got = mx_operands_cuda(x, counter=counter, _poison=True, **kw)
        same(got, want)
        assert got.blocks_outside_window is counter
        own = mx_operands_cuda(x, _poison=True, **kw)  # the packer's own count (another plan)
        same(own, want)
        assert int(own.blocks_outside_window) == int(want.blocks_outside_window)
        if kw.get("colsum"):
            assert_colsum_close(got.colsum, want.colsum, x)
            assert_colsum_close(own.colsum, want.colsum, x)
    assert int(counter) == 7 + sum(int(w.blocks_outside_window) for w in wants)
    assert len(op._PLANS) == 2
    if DEVICE == "cuda" and compiled_launch_supported():
        assert all(p.fast for p in op._PLANS.values())  # the later calls went to the compiled kernels


def test_compiled_launch_switch_gives_the_same_bits(gen, monkeypatch):
    x = adversarial(*SHAPE, gen, DEVICE)
    aux = adversarial(*SHAPE, gen, DEVICE)
    kw = dict(granularity=G.ROWWISE, prologue="gelu_tanh_grad", aux=aux, colsum=True)
    outs = [mx_operands_cuda(x, **kw) for _ in range(3)]
    monkeypatch.setenv("MXFLUX_COMPILED_LAUNCH", "0")
    oc.clear_launch_plans()
    outs += [mx_operands_cuda(x, **kw) for _ in range(2)]
    assert not any(p.fast for p in op._PLANS.values())
    for o in outs[1:]:
        same(o, outs[0])
        assert int(o.blocks_outside_window) == int(outs[0].blocks_outside_window)


def test_strided_and_misaligned_inputs(gen):
    base = adversarial(SHAPE[0], 2 * SHAPE[1], gen, DEVICE)
    strided = base[:, :SHAPE[1]]  # read in place with its row stride
    flat = torch.empty(SHAPE[0] * SHAPE[1] + 4, dtype=torch.bfloat16, device=DEVICE)
    misaligned = flat[4:].view(SHAPE)
    misaligned.copy_(strided)  # 8 bytes off a 16-byte boundary: read through an aligned copy
    want = mx_operands_reference(strided.contiguous())
    for x in (strided, misaligned, strided, misaligned, strided.contiguous()):
        same(mx_operands_cuda(x, _poison=True), want)
    assert len(op._PLANS) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and graphs need CUDA")
def test_compiled_launch_runs_on_the_current_stream_and_in_a_cuda_graph(gen):
    x = adversarial(*SHAPE, gen, DEVICE)
    want = mx_operands_reference(x)
    counter = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    mx_operands_cuda(x, counter=counter)  # builds the plan
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = mx_operands_cuda(x, counter=counter)
    side.synchronize()
    same(got, want)
    counter.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mx_operands_cuda(x, counter=counter)  # warm-up on the capture stream
    side.synchronize()
    counter.zero_()
    with torch.cuda.graph(graph):
        captured = mx_operands_cuda(x, counter=counter)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    same(captured, want)
    assert int(counter) == 2 * int(want.blocks_outside_window)
