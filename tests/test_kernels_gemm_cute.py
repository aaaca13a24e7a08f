"""Where CuTe DSL is absent or broken, asking whether the CuTe GEMM runs costs a compiled block nothing and
a run nothing: every compiled MX GEMM asks (`gemm_cute.takes`, traced by torch.compile), so a graph break
there would split each block at every GEMM; a broken install, a kernel that cannot be built or one whose
first launch fails leave the GEMMs to cuBLAS with one warning."""

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


def _operands(m: int, n: int, k: int):
    """E4M3 operands and power-of-two row scales on the CPU, as the row granularity makes them."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
    sa = 2.0 ** torch.randint(-4, 4, (m, 1), generator=g).float()
    sb = 2.0 ** torch.randint(-4, 4, (n, 1), generator=g).float()
    return a, sa, b, sb


@pytest.fixture
def cute_taking_all(monkeypatch):
    """The CuTe GEMM asked for every GEMM, and said to be available, on CPU tensors standing in for CUDA ones
    (cuBLAS's stand-in is torch's CPU `_scaled_mm`)."""
    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("all"))
    monkeypatch.setattr(gemm_cute, "available", lambda: True)
    monkeypatch.setattr(gemm_cute, "_UNUSABLE", None)
    monkeypatch.setattr(gemm_cute, "_COMPILED", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return monkeypatch


def test_a_cute_gemm_that_cannot_be_built_here_leaves_the_gemms_to_cublas_with_one_warning(cute_taking_all):
    from mxflux.kernels.gemm import _rowwise

    def cannot_build(*args, **kwargs):
        raise RuntimeError("ptxas fatal: Value 'sm_90a' is not defined for option 'gpu-name'")

    cute_taking_all.setattr(gemm_cute, "prepared_gemm", cannot_build)
    a, sa, b, sb = _operands(256, 192, 64)
    assert gemm_cute.takes(a, b, False, torch.bfloat16)
    want = torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="the CuTe-DSL GEMM does not run here .RuntimeError: ptxas fatal"):
        got = _rowwise(a, sa, b, sb, None, torch.bfloat16)
    assert torch.equal(got, want)
    assert not gemm_cute.takes(a, b, False, torch.bfloat16)  # cuBLAS for the rest of the process


def test_only_a_kernels_first_launch_may_fail_over_to_cublas(cute_taking_all):
    """A kernel built by this call whose first launch fails (loading it: a driver the build does not suit)
    gives the GEMMs up; one that has run before and fails now raises: that is an error, not a mismatch."""
    def built_and_failing(*args, **kwargs):
        gemm_cute._COMPILED[len(gemm_cute._COMPILED)] = "a kernel"

        def launch():
            raise RuntimeError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
        return launch

    a, sa, b, sb = _operands(256, 192, 64)
    cute_taking_all.setattr(gemm_cute, "prepared_gemm", built_and_failing)
    with pytest.warns(UserWarning, match="CUDA_ERROR_UNSUPPORTED_PTX_VERSION"):
        with pytest.raises(gemm_cute.CuteGemmUnusable):
            gemm_cute.cute_scaled_gemm(a, sa, b, sb, None, torch.bfloat16)

    def ran_before_and_failing(*args, **kwargs):  # no kernel built by this call
        def launch():
            raise RuntimeError("an illegal memory access was encountered")
        return launch

    cute_taking_all.setattr(gemm_cute, "_UNUSABLE", None)
    cute_taking_all.setattr(gemm_cute, "prepared_gemm", ran_before_and_failing)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        gemm_cute.cute_scaled_gemm(a, sa, b, sb, None, torch.bfloat16)
    assert not isinstance(raised.value, gemm_cute.CuteGemmUnusable) and gemm_cute._UNUSABLE is None


def test_quacks_kernel_fails_over_on_a_signatures_first_launch_only(cute_taking_all):
    """MXFLUX_CUTE_KERNEL=quack-pingpong: quack builds inside its call, so a signature's first call failing gives the
    GEMMs up to cuBLAS (one warning), while a signature that ran before and fails now raises."""
    from mxflux.kernels import gemm_quack

    cute_taking_all.setattr(gemm_cute, "KERNEL", "quack-pingpong")
    cute_taking_all.setattr(gemm_cute, "_QUACK_RAN", set())
    a, sa, b, sb = _operands(256, 192, 64)
    launches = []

    def prepared(config, *args, **kwargs):
        def launch():
            launches.append(config)
            if len(launches) > 1:
                raise RuntimeError("an illegal memory access was encountered")
        return launch

    cute_taking_all.setattr(gemm_quack, "prepared_gemm", prepared)
    gemm_cute.cute_scaled_gemm(a, sa, b, sb, None, torch.bfloat16)  # first call of this signature: runs
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        gemm_cute.cute_scaled_gemm(a, sa, b, sb, None, torch.bfloat16)  # ran before: an error
    assert not isinstance(raised.value, gemm_cute.CuteGemmUnusable) and gemm_cute._UNUSABLE is None
    with pytest.warns(UserWarning, match="illegal memory access"):  # another signature's first call
        with pytest.raises(gemm_cute.CuteGemmUnusable):
            gemm_cute.cute_scaled_gemm(a, sa, b, sb, None, torch.float32)
    assert launches == ["quack-pingpong"] * 3


@pytest.mark.parametrize("env,message", [
    ({"MXFLUX_CUTE_KERNEL": "quack"}, "MXFLUX_CUTE_KERNEL: expected one of rowwise, quack-pingpong, quack-cooperative"),
    ({"MXFLUX_CUTE_KERNEL": "quack-pingpong", "MXFLUX_CUTE_ACCUMULATE": "fast"},
     "MXFLUX_CUTE_KERNEL=quack-pingpong sums K in fp32 only")])
def test_the_kernel_switch_names_what_it_takes(env, message):
    import os
    import subprocess

    r = subprocess.run([sys.executable, "-c", "import mxflux.kernels.gemm_cute"], capture_output=True, text=True,
                       env={**os.environ, **env})
    assert r.returncode != 0 and message in r.stderr


def test_quacks_kernel_asked_for_where_quack_is_missing_is_one_warning_and_cublas(fresh_probe):
    fresh_probe.setattr(gemm_cute, "KERNEL", "quack-cooperative")
    fresh_probe.setitem(sys.modules, "quack", None)
    fresh_probe.setitem(sys.modules, "quack.epilogue", None)
    fresh_probe.setitem(sys.modules, "quack.epilogue.frontend", None)
    with pytest.warns(UserWarning, match="MXFLUX_CUTE_KERNEL=quack-cooperative needs quack-kernels"):
        assert gemm_cute.available() is False


@pytest.mark.parametrize("tvm_ffi,floor", [(True, 2048), (False, 8192)])
def test_autos_token_floor_follows_the_calling_convention(monkeypatch, tvm_ffi, floor):
    """Through TVM-FFI's calling convention a call costs a sixth of the host time, and the 6+12-block model's
    2048-token GEMMs gained on the kernel; through the DSL's own only GEMMs of 8192 tokens and up did. An
    explicit MXFLUX_CUTE_MIN_TOKENS wins either way."""
    monkeypatch.setattr(gemm_cute, "tvm_ffi_present", lambda: tvm_ffi)
    monkeypatch.delenv("MXFLUX_CUTE_MIN_TOKENS", raising=False)
    assert gemm_cute.cute_gemm_choice("auto") == gemm_cute.CuteGemm(frozenset(gemm_cute.CUTE_GEMM_KINDS), floor)
    monkeypatch.setenv("MXFLUX_CUTE_MIN_TOKENS", "4096")
    assert gemm_cute.cute_gemm_choice("auto").min_tokens == 4096
    assert gemm_cute.cute_gemm_choice("all").min_tokens == 0  # named kinds take every size


def test_a_broken_tvm_ffi_is_one_warning_and_the_dsls_convention(monkeypatch):
    """apache-tvm-ffi that fails to import with something other than ImportError (a library it cannot load)
    must not break importing mxflux: one warning, and the DSL's own calling convention (with its floor)."""
    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "tvm_ffi":
            raise OSError("libtvm_ffi.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    gemm_cute.tvm_ffi_present.cache_clear()
    monkeypatch.setattr(builtins, "__import__", failing)
    monkeypatch.delitem(sys.modules, "tvm_ffi", raising=False)
    monkeypatch.delenv("MXFLUX_CUTE_MIN_TOKENS", raising=False)
    try:
        with pytest.warns(UserWarning, match="apache-tvm-ffi is installed but does not import .OSError"):
            assert gemm_cute.tvm_ffi_present() is False
        assert gemm_cute.cute_gemm_choice("auto").min_tokens == gemm_cute.MIN_TOKENS_DSL
    finally:
        gemm_cute.tvm_ffi_present.cache_clear()


@pytest.mark.parametrize("kernel,quack", [("quack-pingpong", False), ("quack-cooperative", True), ("rowwise", False)])
def test_a_quack_setting_is_skipped_where_its_gemm_would_not_run(kernel, quack, monkeypatch):
    """`bench step`'s `mxfp6-quack-*` settings (MXFLUX_CUTE_KERNEL) where quack-kernels or CuTe DSL and a Hopper GPU
    are missing: skipped with the reason, not timed on cuBLAS under the quack setting's name; the default kernel is
    not affected."""
    from mxflux.bench.availability import setting_unavailability
    from mxflux.kernels import gemm_quack
    from mxflux.train.config import load_recipe

    monkeypatch.setattr(gemm_cute, "KERNEL", kernel)
    monkeypatch.setattr(gemm_quack, "installed", lambda: quack)  # CuTe DSL or the GPU missing here either way
    why = setting_unavailability(load_recipe("tiny-mxfp6", []), torch.device("cpu"))
    if kernel == "rowwise":
        assert why is None
    else:
        assert why == (f"MXFLUX_CUTE_KERNEL={kernel} needs quack-kernels, CuTe DSL and a Hopper GPU (without them its "
                       "GEMMs would run on cuBLAS)")


def test_the_blockwise_gemm_goes_to_the_per_column_kernel_only_where_switched_on(monkeypatch):
    """`mx_gemm: blockwise`'s GEMM: with MXFLUX_CUTE_BLOCKWISE off (the default) never the CuTe kernel; on, where
    a row-scaled GEMM of that kind and size would go to it, on the per-column block-scaled kernel (`fp32-bscol`),
    its 1x128 scales passed as they are."""
    from mxflux.kernels import gemm

    monkeypatch.setattr(gemm_cute, "CUTE_GEMM", gemm_cute.cute_gemm_choice("all"))
    monkeypatch.setattr(gemm_cute, "available", lambda: True)
    monkeypatch.setattr(gemm_cute, "_UNUSABLE", None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # meta tensors stand in for CUDA ones
    (tm, tn), (cm, cn) = gemm_cute.CONFIGS["fp32-bscol"]
    a, b = torch.empty(tm * cm, 256, device="meta"), torch.empty(tn * cn, 256, device="meta")
    assert gemm_cute.BLOCKWISE == "off" and not gemm_cute.takes_blockwise(a, b, True, torch.bfloat16)
    monkeypatch.setattr(gemm_cute, "BLOCKWISE", "on")
    assert gemm_cute.takes_blockwise(a, b, True, torch.bfloat16)
    assert not gemm_cute.takes_blockwise(a, torch.empty(tn * cn + 64, 256, device="meta"), True, torch.bfloat16)
    calls = []
    monkeypatch.setattr(gemm_cute, "cute_scaled_gemm", lambda *args: calls.append(args) or "out")
    sa, sb = torch.empty(tm * cm, 2, device="meta"), torch.empty(tn * cn, 2, device="meta")
    assert gemm._blockwise(a, sa, b, sb, None, torch.bfloat16) == "out"
    assert calls == [(a, sa, b, sb, None, torch.bfloat16, "fp32-bscol")]
