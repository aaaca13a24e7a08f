"""The row-granularity MX GEMM on CuTe DSL's kernel (`cute_rowwise_gemm`: CUTLASS's persistent Hopper FP8
GEMM with the row and column scales and the bias in its epilogue), opt-in while it is measured:
MXFLUX_CUTE_GEMM=bias (the GEMMs with a bias: fprop) or all (fprop, dgrad, wgrad); off by default.

Why: cuBLAS offers one row-scaled FP8 algorithm (128x128 tiles, no clusters), slower in the step than its
tensor-wise kernels, and the scales cannot be deferred to the next op without the partitioner writing the
scaled output whole (benchmarks/NOTES.md, "The fprop GEMMs unit-scaled"). This one applies them where
the accumulator is, with the tensor-wise kernels' tiles. Its numbers are the GEMM contract's (fp32
accumulation, the power-of-two scales exact, the bias added in fp32, one rounding), within the fp32
summation bound of cuBLAS's (a different order of the same sums), so eager and compiled calls both take it
for the GEMMs it is on for, and a run names it (`train.step_path`).
"""

from __future__ import annotations

import functools
import os

import torch

CUTE_GEMM_MODES = ("off", "bias", "all")
CUTE_GEMM = os.environ.get("MXFLUX_CUTE_GEMM", "off")
if CUTE_GEMM not in CUTE_GEMM_MODES:
    raise ValueError(f"MXFLUX_CUTE_GEMM: expected one of {', '.join(CUTE_GEMM_MODES)}, got {CUTE_GEMM!r}")
CONFIG = ((128, 256), (2, 1))  # tile (M, N), cluster (M, N): the tensor-wise kernels' class


@functools.cache
def available() -> bool:
    """CuTe DSL importable and a Hopper GPU present."""
    try:
        import cutlass.cute  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def takes(a_data: torch.Tensor, b_data: torch.Tensor, has_bias: bool) -> bool:
    """Whether this row-granularity GEMM runs here: `CUTE_GEMM` asks for it, and M and N are whole tiles
    (the epilogue reads each row's and column's scale unguarded; K needs 16 bytes, as cuBLAS's FP8 GEMMs)."""
    if CUTE_GEMM == "off" or (CUTE_GEMM == "bias" and not has_bias) or not a_data.is_cuda or not available():
        return False
    (tile_m, tile_n), _ = CONFIG
    return a_data.shape[0] % tile_m == 0 and b_data.shape[0] % tile_n == 0 and a_data.shape[1] % 16 == 0


def _tensor(t: torch.Tensor, dtype, leading_dim: int):
    from cutlass.cute.runtime import from_dlpack

    ct = from_dlpack(t.view(torch.uint8) if t.element_size() == 1 else t, assumed_align=16)
    ct.element_type = dtype
    return ct.mark_layout_dynamic(leading_dim=leading_dim)


_COMPILED: dict = {}


def cute_scaled_gemm(a_data, a_scale, b_data, b_scale, bias, out_dtype) -> torch.Tensor:
    """(A ⊙ a_scale)(B ⊙ b_scale)ᵀ + bias: a_data [M, K], b_data [N, K] E4M3 (contiguous), a_scale [M, 1],
    b_scale [N, 1] fp32, bias [N] or None, out bf16 or fp32."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from .cute_rowwise_gemm import RowScaledFP8Gemm

    m, n = a_data.shape[0], b_data.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_data.device)
    vectors = (a_scale.reshape(-1).contiguous(), b_scale.reshape(-1).contiguous(),
               (bias.float() if bias is not None else torch.zeros(n, device=a_data.device)).contiguous())
    args = (_tensor(a_data.unsqueeze(-1), cutlass.Float8E4M3FN, 1), _tensor(b_data.unsqueeze(-1), cutlass.Float8E4M3FN, 1),
            _tensor(out.unsqueeze(-1), cutlass.Float32 if out_dtype == torch.float32 else cutlass.BFloat16, 1),
            *(_tensor(v, cutlass.Float32, 0) for v in vectors))
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = (bias is not None, out_dtype)
    if key not in _COMPILED:
        tile, cluster = CONFIG
        clusters = cutlass.utils.HardwareInfo().get_max_active_clusters(cluster[0] * cluster[1])
        _COMPILED[key] = cute.compile(RowScaledFP8Gemm(cutlass.Float32, tile, cluster, 1, True), *args,
                                      bias is not None, clusters, stream)
    _COMPILED[key](*args, stream)
    return out
