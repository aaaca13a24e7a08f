"""The packer as compiled regions launch it (`mxflux::mx_operands_inline`, `kernels.operands_inline`):
bit for bit the opaque packer op's outputs and count.

Eager calls run on CUDA, and on a CPU machine with Triton under its interpreter; the traced calls
(torch.compile, inductor launching the kernel from its generated code) need CUDA. The op
allocates its own outputs, so on CUDA the allocator's free memory is filled with 0xFF (NaN in
fp32 and E4M3) first: an element the kernels missed shows as a difference.
"""

from __future__ import annotations

import re

import pytest
import torch

from pack_inputs import DISTS, TRITON_DEVICE, assert_bits_equal, assert_colsum_close, triton_marks

from mxflux.kernels import mx_operands_cuda, weight_erefs
from mxflux.kernels.operands_cuda import weight_exponents_cuda
from mxflux.mx import FoldGranularity as G
from mxflux.ops import custom_ops

pytestmark = triton_marks()
DEVICE = TRITON_DEVICE
CUDA = DEVICE == "cuda"
FIELDS = ("row_data", "row_scale", "col_data", "col_scale")


def _poison_free_memory():
    """Fill what the CUDA caching allocator holds free with 0xFF, so fresh outputs start as NaN."""
    if CUDA:
        torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE).fill_(0xFF)


def _inline(x, row=True, col=True, granularity=G.ROWWISE, hadamard=True, colsum=False, erefs=None, fn=None):
    counter = torch.full((1,), 5, dtype=torch.int64, device=x.device)  # the op adds into it
    _poison_free_memory()
    fn = fn or torch.ops.mxflux.mx_operands_inline
    out = fn(x, counter, row, col, granularity.value, hadamard, colsum, erefs)
    return out, counter


def _check(x, out, counter, row=True, col=True, granularity=G.ROWWISE, hadamard=True, colsum=False, erefs=None):
    want = mx_operands_cuda(x, row=row, col=col, granularity=granularity, hadamard=hadamard, colsum=colsum,
                            erefs=erefs, _poison=True)
    for name, got in zip(FIELDS, out[:4]):
        w = getattr(want, name)
        if w is None:
            assert got.numel() == 0 and got.dtype == torch.float32, name  # as the opaque op returns
        else:
            assert_bits_equal(name, got, w)
    if colsum:
        assert_colsum_close(out[4], want.colsum, x)
    else:
        assert out[4].numel() == 0
    assert int(counter) == 5 + int(want.blocks_outside_window)
    return want


@pytest.mark.parametrize("granularity", list(G), ids=lambda g: g.value)
@pytest.mark.parametrize("dist", ["normal", "adversarial"])
def test_inline_op_is_the_packer(granularity, dist, gen):
    x = DISTS[dist](200, 256, gen, DEVICE)  # 200 rows: the col orientation is zero-padded
    want = _check(x, *_inline(x, granularity=granularity, colsum=True), granularity=granularity, colsum=True)
    if dist == "adversarial" and granularity is not G.EXACT:
        assert int(want.blocks_outside_window) > 0  # the count is exercised


@pytest.mark.parametrize("row, col", [(True, False), (False, True)])
@pytest.mark.parametrize("hadamard", [True, False])
def test_inline_op_single_orientation(row, col, hadamard, gen):
    x = DISTS["adversarial"](33, 160, gen, DEVICE)  # a partial row tile and column tile
    _check(x, *_inline(x, row=row, col=col, hadamard=hadamard), row=row, col=col, hadamard=hadamard)


def test_inline_op_reads_strided_and_offset_views(gen):
    """A column slice (row stride wider than the row) and a view whose start is not 16-byte aligned
    (the op copies it) pack as their contiguous copies do."""
    big = DISTS["adversarial"](97, 352, gen, DEVICE)
    for x in (big[:, 64:], big.reshape(-1)[3:3 + 96 * 256].view(96, 256)):
        out, counter = _inline(x, colsum=True)
        _check(x.contiguous(), out, counter, colsum=True)


def test_inline_op_packs_fp32_weights_with_their_erefs(gen):
    """fp32 master weights, pass 2 alone on the e_ref the optimizer keeps (`erefs`)."""
    w = DISTS["adversarial"](96, 160, gen, DEVICE).float()
    erefs = weight_exponents_cuda(w, True, torch.empty(weight_erefs.buffer_words(96, 160), dtype=torch.int32,
                                                       device=DEVICE))
    _check(w, *_inline(w, erefs=erefs), erefs=erefs)
    _check(w, *_inline(w))  # and both passes without them


@pytest.mark.skipif(not CUDA, reason="traced calls need inductor on CUDA")
def test_compiled_calls_launch_the_kernel_from_inductors_code(gen, monkeypatch):
    """Traced, `mx_operands` is the inline op and inductor launches the packer's two passes itself:
    no call into the opaque op, no copies, and the same bits and count as the eager op."""
    from torch._inductor.utils import run_and_get_code

    from torch._inductor import config

    torch._dynamo.reset()
    monkeypatch.setattr(custom_ops, "INLINE_PACK", True)

    def pack(x, counter):
        return custom_ops.mx_operands(x * 1, None, counter, True, True, "rowwise", True, "none", True)

    x = DISTS["adversarial"](300, 512, gen, DEVICE)
    counter = torch.full((1,), 5, dtype=torch.int64, device=DEVICE)
    _poison_free_memory()
    with config.patch(static_launch_user_defined_triton_kernels=True):  # as the trainer sets it
        out, code = run_and_get_code(torch.compile(pack, fullgraph=True), x, counter)
    code = "\n".join(code)
    _check(x, out, counter, colsum=True)
    assert "mxflux.mx_operands" not in code
    assert len(set(re.findall(r"\b_pack_kernel\w*", code))) >= 1  # the passes' kernels, in inductor's code
    # nothing copied (inductor found what the kernel writes; the counter is updated in place) and no
    # dtype views: the outputs are the buffers the kernel wrote
    wrapper = code[code.rindex("def call("):]  # (the module before it holds the kernels' sources)
    assert "clone" not in wrapper and "copy_" not in wrapper and "view.dtype" not in wrapper
