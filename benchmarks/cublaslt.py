"""The row-wise scaled FP8 GEMM called on cuBLASLt directly (ctypes), with a chosen algorithm: the
probe `probe_rowwise_gemm.py` uses it to ask cuBLASLt for every candidate it has.

`torch._scaled_mm` with [M, 1] and [1, N] fp32 scales runs cuBLASLt's first heuristic choice, a
128x128-tile kernel at every Flux shape, and gives no way to ask for another. cuBLASLt itself
lists several candidate algorithms per problem (`cublasLtMatmulAlgoGetHeuristic`); this module
lists them, runs any of them, and describes them (tile, stages, cluster). Measured on the H200
(CUDA 13, torch 2.11): it has exactly one for outer-vector scaling at every Flux shape, the kernel
torch already runs (benchmarks/NOTES.md, "What would close the gap"), so nothing in the product
uses this module. The arithmetic contract is the same for
every algorithm cuBLASLt returns for this descriptor: E4M3 products accumulated with periodic fp32
promotion (no fast accumulation), the two scale vectors applied to the fp32 accumulator, the bias
added in the epilogue, one rounding to the output type. Algorithms may differ in summation order
(split-K, tile K-loop), which is inside the fp32 summation bound the GEMM contract allows
(docs/design.md, "The three GEMMs and their operands").

Layout: out [M, N] row-major = Dᵀ of cuBLAS's column-major D [N, M] = op(A) op(B) with A = b
(the [N, K] row-major weight-side operand read as column-major K x N, transposed) and B = a
(column-major K x M, not transposed); A's outer-vector scale is b's [N], B's is a's [M].
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

__all__ = ["LtAlgo", "available", "rowwise_algos", "rowwise_scaled_mm"]

# cublasLt.h / library_types.h / cublas_api.h values (CUDA 12.9 and 13)
_CUDA_R_32F, _CUDA_R_16BF, _CUDA_R_16F, _CUDA_R_8F_E4M3 = 0, 14, 2, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_FAST_ACCUM, _DESC_BIAS_DATA_TYPE = 17, 18, 25, 26
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                "inner_shape": 7, "cluster_shape": 8}
_DTYPES = {torch.float32: _CUDA_R_32F, torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=None)
def _lib():
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    import glob
    import os

    import nvidia  # the pip CUDA libraries torch was built against

    for root in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", "libcublasLt.so.*"))):
            return ctypes.CDLL(path)
    raise OSError("cuBLASLt: no libcublasLt found")


def available() -> bool:
    """cuBLASLt loads here and the current CUDA device can run row-wise scaled FP8 (sm_90+)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    try:
        _lib()
    except OSError:
        return False
    return True


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt: {what} returned status {status}")


@functools.lru_cache(maxsize=None)
def _handle(device_index: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


def _set(setter, obj, attr: int, value) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


@dataclass(frozen=True)
class LtAlgo:
    """One cuBLASLt algorithm for one problem: its opaque descriptor and what it is."""

    raw: bytes
    workspace: int
    waves: float
    config: tuple  # ((name, value), ...) from cublasLtMatmulAlgoConfigGetAttribute

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config)


class _Problem:
    """Descriptors for out [M, N] = (a ⊙ sa)(b ⊙ sb)ᵀ + bias, kept alive together."""

    def __init__(self, m: int, n: int, k: int, out_dtype: torch.dtype, has_bias: bool, fast_accum: bool):
        lib = _lib()
        self.desc, self.a, self.b, self.d = (ctypes.c_void_p() for _ in range(4))
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        s = lib.cublasLtMatmulDescSetAttribute
        _set(s, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(s, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(s, self.desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F))
        _set(s, self.desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F))
        _set(s, self.desc, _DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))
        _set(s, self.desc, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS if has_bias else _EPILOGUE_DEFAULT))
        if has_bias:
            _set(s, self.desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(_DTYPES[out_dtype]))
        mk = lib.cublasLtMatrixLayoutCreate
        _check(mk(ctypes.byref(self.a), _CUDA_R_8F_E4M3, ctypes.c_uint64(k), ctypes.c_uint64(n), ctypes.c_int64(k)),
               "MatrixLayoutCreate A")
        _check(mk(ctypes.byref(self.b), _CUDA_R_8F_E4M3, ctypes.c_uint64(k), ctypes.c_uint64(m), ctypes.c_int64(k)),
               "MatrixLayoutCreate B")
        _check(mk(ctypes.byref(self.d), _DTYPES[out_dtype], ctypes.c_uint64(n), ctypes.c_uint64(m),
                  ctypes.c_int64(n)), "MatrixLayoutCreate D")
        self.has_bias = has_bias

    def __del__(self):
        try:
            lib = _lib()
            lib.cublasLtMatmulDescDestroy(self.desc)
            for layout in (self.a, self.b, self.d):
                lib.cublasLtMatrixLayoutDestroy(layout)
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    def set_pointers(self, sa: int, sb: int, bias: int) -> None:
        s = _lib().cublasLtMatmulDescSetAttribute
        # cuBLAS's A is our b: its outer-vector scale is sb
        _set(s, self.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(sb))
        _set(s, self.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(sa))
        if self.has_bias:
            _set(s, self.desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias))


def _config(algo: _Algo) -> tuple:
    lib, out = _lib(), []
    for name, attr in _ALGO_CONFIG.items():
        size = ctypes.c_size_t()
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) != 0:
            continue
        buf = ctypes.create_string_buffer(max(size.value, 1))
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, buf, size.value,
                                                    ctypes.byref(size)) == 0:
            out.append((name, int.from_bytes(buf.raw[:size.value], "little")))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _problem(m, n, k, out_dtype, has_bias, fast_accum, device_index):
    with torch.cuda.device(device_index):
        return _Problem(m, n, k, out_dtype, has_bias, fast_accum)


def rowwise_algos(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype, *, count: int = 32, fast_accum: bool = False,
                  workspace: int = WORKSPACE_BYTES) -> list[LtAlgo]:
    """cuBLASLt's candidates for this problem, in its heuristic order (the first is what
    `torch._scaled_mm` runs, given the same workspace). The heuristic reads the pointers'
    alignment, so it takes the operands themselves."""
    (m, k), n = a.shape, b.shape[0]
    lib = _lib()
    p = _problem(m, n, k, out_dtype, bias is not None, fast_accum, a.device.index)
    p.set_pointers(sa.data_ptr(), sb.data_ptr(), bias.data_ptr() if bias is not None else 0)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    try:
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(workspace))
        results = (_Heuristic * count)()
        got = ctypes.c_int()
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(a.device.index), p.desc, p.a, p.b, p.d, p.d, pref, count,
                                                  results, ctypes.byref(got)), "MatmulAlgoGetHeuristic")
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    return [LtAlgo(bytes(r.algo), int(r.workspace_size), float(r.waves), _config(r.algo))
            for r in results[:got.value] if r.state == 0]


def rowwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype, algo: LtAlgo, *,
                      fast_accum: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = (a ⊙ sa)(b ⊙ sb)ᵀ + bias with cuBLASLt algorithm `algo` (from `rowwise_algos`
    for the same shapes and flags). a [M, K], b [N, K] float8_e4m3fn contiguous; sa [M] / [M, 1],
    sb [N] / [N, 1] / [1, N] float32 contiguous; bias [N] of out_dtype or None."""
    (m, k), n = a.shape, b.shape[0]
    dev = a.device.index
    p = _problem(m, n, k, out_dtype, bias is not None, fast_accum, dev)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    ws = _workspace(dev, algo.workspace)
    p.set_pointers(sa.data_ptr(), sb.data_ptr(), bias.data_ptr() if bias is not None else 0)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    raw = _Algo.from_buffer_copy(algo.raw)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    _check(_lib().cublasLtMatmul(_handle(dev), p.desc, ctypes.byref(one), ctypes.c_void_p(b.data_ptr()), p.a,
                                 ctypes.c_void_p(a.data_ptr()), p.b, ctypes.byref(zero),
                                 ctypes.c_void_p(out.data_ptr()), p.d, ctypes.c_void_p(out.data_ptr()), p.d,
                                 ctypes.byref(raw), ctypes.c_void_p(ws.data_ptr() if ws is not None else 0),
                                 ctypes.c_size_t(algo.workspace), ctypes.c_void_p(stream)), "Matmul")
    return out


_WORKSPACES: dict[int, torch.Tensor] = {}


def _workspace(dev: int, nbytes: int) -> torch.Tensor | None:
    if nbytes == 0:
        return None
    ws = _WORKSPACES.get(dev)
    if ws is None or ws.numel() < nbytes:
        ws = _WORKSPACES[dev] = torch.empty(max(nbytes, WORKSPACE_BYTES), dtype=torch.uint8,
                                            device=torch.device("cuda", dev))
    return ws
