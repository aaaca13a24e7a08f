"""`scaled_gemm_cuda`'s plans on the CPU: validation and the choice of GEMM made once per key
(shapes, strides, dtypes, devices, granularity, output dtype), contiguous copies only where a
tensor is not, and a bad call never cached. The GEMMs themselves run on the GPU
(tests/gpu/test_gemm_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from mxflux.mx import FoldGranularity as G


@pytest.fixture
def gemm_fake(monkeypatch):
    from mxflux.kernels import gemm

    checks, routes = [], []
    # _check's own rules (CUDA tensors among them) are tested on the GPU (tests/gpu/test_gemm_cuda.py)
    check = lambda *a: checks.append(1)  # noqa: E731

    def recorder(name):
        return lambda *a: routes.append((name, a)) or name

    monkeypatch.setattr(gemm, "_check", check)
    for name in ("_rowwise", "_blockwise", "_exact"):
        monkeypatch.setattr(gemm, name, recorder(name))
    gemm._GEMM_PLANS.clear()
    yield gemm, checks, routes
    gemm._GEMM_PLANS.clear()


def f8(*shape):
    return torch.zeros(*shape).to(torch.float8_e4m3fn)


def test_gemm_plan_validates_once_per_key_and_picks_the_route(gemm_fake):
    gemm, checks, routes = gemm_fake
    a, b = f8(64, 256), f8(32, 256)
    sa, sb = torch.ones(64, 1), torch.ones(32, 1)
    assert gemm.scaled_gemm_cuda(a, sa, b, sb, G.ROWWISE) == "_rowwise"
    assert gemm.scaled_gemm_cuda(f8(64, 256), sa, b, sb, G.ROWWISE) == "_rowwise"
    assert len(checks) == 1 and len(gemm._GEMM_PLANS) == 1
    assert routes[-1][1][0] is not a and routes[-1][1][1] is sa  # the call's own tensors, uncopied
    assert gemm.scaled_gemm_cuda(a, torch.ones(64, 2), b, torch.ones(32, 2), G.BLOCKWISE) == "_blockwise"
    assert gemm.scaled_gemm_cuda(f8(64, 128), sa, f8(32, 128), sb, G.BLOCKWISE) == "_rowwise"  # one 1x128 group
    assert gemm.scaled_gemm_cuda(a, torch.ones(64, 8), b, torch.ones(32, 8), G.EXACT) == "_exact"
    assert gemm.scaled_gemm_cuda(a, sa, b, sb, G.ROWWISE, torch.zeros(32), torch.float32) == "_rowwise"
    assert len(checks) == 5 and len(gemm._GEMM_PLANS) == 5


def test_gemm_plan_copies_what_is_not_contiguous_and_never_caches_a_bad_call(gemm_fake):
    gemm, checks, routes = gemm_fake
    b, sb = f8(32, 256), torch.ones(32, 1)
    a_t = f8(256, 64).t()  # [64, 256], not contiguous
    sa = torch.ones(64, 1)
    for _ in range(2):
        gemm.scaled_gemm_cuda(a_t, sa, b, sb, G.ROWWISE)
        got = routes[-1][1][0]
        assert got.is_contiguous() and got.shape == (64, 256) and got is not a_t
    assert len(checks) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="a_scale, b_scale"):
            gemm.scaled_gemm_cuda(f8(64, 256), torch.ones(64, 2), b, sb, G.ROWWISE)
        with pytest.raises(ValueError, match="granularity: expected a FoldGranularity"):
            gemm.scaled_gemm_cuda(f8(64, 256), sa, b, sb, "rowwise")
    assert len(gemm._GEMM_PLANS) == 1
