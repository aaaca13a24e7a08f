"""bf16 × bf16 → fp32 matrix products on the CPU, through the MKL that PyTorch's CPU library links.

PyTorch has no CPU op that multiplies bf16 matrices into an fp32 result: `aten::mm.dtype` is
registered for CUDA only, a bf16 `mm` rounds its result to bf16, and `torch._scaled_mm` on the
CPU is a reference loop (seconds for a 1536 x 896 x 128 product). MKL has exactly this product,
`cblas_gemm_bf16bf16f32` (exact bf16 products, fp32 accumulation, fp32 result), and x86 builds of
PyTorch link MKL into `libtorch_cpu` and export it. On a CPU with AMX or AVX512-BF16 it runs ~3x
faster than fp32 `sgemm` on the same values (the demo model's GEMMs, 2 cores).

Where the library or the symbol is missing (non-x86 builds, other BLAS), `bf16_gemm_available()`
is False and callers keep their fp32 path.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

__all__ = ["bf16_gemm_available", "bf16_gemm_fits", "gemm_bf16_f32"]

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values
_INT32_MAX = 2**31 - 1  # the LP64 interface's MKL_INT


@lru_cache(maxsize=1)
def _cblas_gemm_bf16bf16f32():
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(path).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    fn.restype = None
    return fn


def bf16_gemm_available() -> bool:
    """True when MKL's bf16 GEMM can be called (x86 PyTorch builds)."""
    return _cblas_gemm_bf16bf16f32() is not None


def bf16_gemm_fits(m: int, n: int, k: int) -> bool:
    """True when an [m, k] x [n, k] product fits the 32-bit indexing of MKL's LP64 interface."""
    return max(m * k, n * k, m * n) <= _INT32_MAX


def gemm_bf16_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a · bᵀ for contiguous CPU bf16 `a` [M, K] and `b` [N, K]: every product exact, summed in
    fp32 in MKL's order (which, like a tensor core's, may flush products below fp32's normal range)."""
    fn = _cblas_gemm_bf16bf16f32()
    if fn is None:
        raise RuntimeError("gemm_bf16_f32: this PyTorch build exports no cblas_gemm_bf16bf16f32 (check bf16_gemm_available())")
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous 2-D bf16 CPU tensor, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device} (contiguous: {t.is_contiguous()})")
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"b: expected K={k} columns like a, got {tuple(b.shape)}")
    if not bf16_gemm_fits(m, n, k):
        raise ValueError(f"gemm_bf16_f32: [{m}, {k}] x [{n}, {k}] exceeds MKL's 32-bit indexing")
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        if k == 0:
            return out.zero_()
        fn(_ROW_MAJOR, _NO_TRANS, _TRANS, m, n, k, 1.0, a.data_ptr(), k, b.data_ptr(), k, 0.0, out.data_ptr(), n)
    return out
