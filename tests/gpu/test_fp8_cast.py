"""The Triton row-wise FP8 casts (`fp8_pack_cuda`) against `fp8_pack_reference`, bit for bit.

Runs on CUDA; on a CPU machine with Triton it also runs under the interpreter
(`TRITON_INTERPRET=1`, small shapes), where the FP8 conversions are the kernel's integer
emulation. Outputs are poisoned (0xFF: NaN in fp32 and both FP8 formats) before the kernels write.
NaN bytes are compared as NaN (the sign of a NaN is not part of the reference's contract:
torch's CPU conversion keeps it, the GPU's canonical NaN does not).
"""

from __future__ import annotations

import pytest
import torch

from pack_inputs import DISTS, INTERPRETED, TRITON_DEVICE, assert_bits_equal, assert_colsum_close, triton_marks

from mxflux.kernels import fp8_pack_cuda
from mxflux.ops.custom_ops import fp8_pack
from mxflux.ops.pack_reference import fp8_pack_reference

DEVICE = TRITON_DEVICE
pytestmark = triton_marks()

SHAPES = [(96, 256), (33, 96), (200, 160)] if INTERPRETED else \
    [(4096, 3072), (4096, 12288), (1000, 3072), (777, 3104), (33, 96)]
NAMES = ("row_data", "row_scale", "col_data", "col_scale")


def assert_fp8_equal(name, got, want):
    """Bit-equal, except that any NaN equals any NaN."""
    if want is None or want.element_size() != 1:
        return assert_bits_equal(name, got, want)
    assert got is not None and got.shape == want.shape and got.dtype == want.dtype, name
    gn, wn = got.float().isnan(), want.float().isnan()
    assert torch.equal(gn, wn), f"{name}: NaN positions differ ({int((gn != wn).sum())} elements)"
    assert_bits_equal(name, torch.where(wn, 0, got.view(torch.uint8)), torch.where(wn, 0, want.view(torch.uint8)))


def check(x, **kw):
    got = fp8_pack_cuda(x, _poison=True, **kw)
    want = fp8_pack_reference(x, **kw)
    for name, g, w in zip(NAMES, got, want):
        assert_fp8_equal(name, g, w)
    if kw.get("colsum"):
        assert_colsum_close(got[4], want[4], x)
    else:
        assert got[4] is None
    return got, want


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dist", list(DISTS))
def test_fp8_pack_matches_reference(shape, fmt, dist, gen):
    x = DISTS[dist](*shape, gen, DEVICE)
    got, _ = check(x, fmt=fmt, colsum=True)
    if dist == "normal":  # a real cast: scales are amax/fmax, and the bytes use the whole range
        fmax = torch.finfo(got[0].dtype).max
        amax = x.float().abs().amax(1)
        assert torch.equal(got[1][:, 0], amax / torch.full_like(amax, fmax))  # IEEE division
        assert float(got[0].float().abs().max()) == fmax


@pytest.mark.parametrize("which", ["row", "col", "colsum"])
def test_single_outputs(which, gen):
    x = DISTS["student_t"](*SHAPES[1], gen, DEVICE)
    kw = dict(row=which == "row", col=which == "col", colsum=which == "colsum", fmt="e5m2")
    got, _ = check(x, **kw)
    for name, t in zip(NAMES + ("colsum",), got):
        assert (t is not None) == kw.get(name.split("_")[0], False), name


def test_strided_input_and_op_dispatch(gen):
    r, c = SHAPES[0]
    big = DISTS["normal"](r, c + 64, gen, DEVICE)
    x = big[:, 32:32 + c]  # row stride c + 64
    check(x, fmt="e4m3")
    if DEVICE == "cuda":  # the custom op runs the kernel on CUDA: same bytes as the reference
        outs = fp8_pack(x, True, True, "e4m3", True)
        want = fp8_pack_reference(x, fmt="e4m3", colsum=True)
        for name, g, w in zip(NAMES, outs, want):
            assert_fp8_equal(name, g, w)


def test_bad_inputs(gen):
    x = DISTS["normal"](64, 64, gen, DEVICE)
    with pytest.raises(ValueError, match="fmt"):
        fp8_pack_cuda(x, fmt="e3m4")
    with pytest.raises(ValueError, match="bfloat16"):
        fp8_pack_cuda(x.float())
    with pytest.raises(ValueError, match="2-D"):
        fp8_pack_cuda(x[0])
    with pytest.raises(ValueError, match="non-empty"):
        fp8_pack_cuda(x[:0])
    with pytest.raises(ValueError, match="row"):
        fp8_pack_cuda(x, row=1)
