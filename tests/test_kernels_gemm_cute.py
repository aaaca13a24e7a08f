"""Where CuTe DSL is absent or broken, asking whether the CuTe GEMM runs costs a compiled block nothing and
a run nothing: every compiled MX GEMM asks (`gemm_cute.takes`, traced by torch.compile), so a graph break
there would split each block at every GEMM; a broken install falls back to cuBLAS with one warning."""

from __future__ import annotations

import builtins
import sys

import pytest
import torch

from mxflux.kernels import gemm_cute


@pytest.fixture
def fresh_probe(monkeypatch):
    """`available()` asked anew (its probe cached per process), and afresh again after the test."""
    gemm_cute._cute_dsl_runs_here.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    gemm_cute._cute_dsl_runs_here.cache_clear()


def _traced_graphs(fn) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(torch.randn(8))
    return explained.graph_count, explained.graph_break_count


def test_asking_whether_cute_runs_is_no_graph_break_where_it_is_not_installed(fresh_probe):
    fresh_probe.setitem(sys.modules, "cutlass", None)  # `import cutlass.cute` raises ImportError, as uninstalled
    fresh_probe.setitem(sys.modules, "cutlass.cute", None)

    def step(x):
        y = x * 2
        if gemm_cute.available():
            y = y + 1
        return y.sin()

    assert _traced_graphs(step) == (1, 0)
    assert gemm_cute.available() is False


def test_a_broken_install_is_one_warning_and_cublas(fresh_probe):
    real_import = builtins.__import__

    def import_(name, *args, **kwargs):
        if name.startswith("cutlass"):
            raise RuntimeError("No CTK flavor installed: expected one or more of ..._cutlass_ir.cu{N}.so")
        return real_import(name, *args, **kwargs)

    fresh_probe.setattr(builtins, "__import__", import_)
    with pytest.warns(UserWarning, match=r"installed but does not import \(RuntimeError: No CTK flavor installed"):
        assert gemm_cute.available() is False
