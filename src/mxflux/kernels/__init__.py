"""Fast paths of the MX numerics (docs/design.md, "Kernels, backends and the reference"): the
Triton MX operand packers, the saved-operand compaction kernels and cuBLAS FP8 GEMMs for Hopper, and the compiled CPU packer and
GEMM (numba dequantization, MKL's bf16 GEMM) that the CPU training path uses. The packers are bit-exact twins of a
reference in `mxflux.mx`; the GEMMs equal theirs up to the fp32 summation order.

This package imports only `mxflux.mx` (plus torch, triton, numba); `mxflux.ops` picks between
these and the references. Importing it never needs CUDA or Triton: `mx_operands_cuda` raises a
clear RuntimeError where it cannot run (check `cuda_kernel_available()` first), and
`scaled_gemm_cuda` needs a CUDA device for cuBLAS.
"""

from .compact_cuda import compact_operand_cuda, expand_operand_cuda
from .gemm import GEMM_SHAPE_RULES, scaled_gemm_cuda, scaled_gemm_cuda_traceable
from .gemm_cpu import dequantize_operand_cpu, scaled_gemm_cpu
from .operands_cpu import HAS_NUMBA, cpu_kernel_available, mx_operands_cpu
from .operands_cuda import cuda_kernel_available, mx_operands_cuda, mx_operands_cuda_counted, prologue_cuda
from .operands_onepass import mx_operands_onepass_cuda
from .triton_common import HAS_TRITON

__all__ = [
    "GEMM_SHAPE_RULES",
    "HAS_NUMBA",
    "HAS_TRITON",
    "compact_operand_cuda",
    "cpu_kernel_available",
    "cuda_kernel_available",
    "dequantize_operand_cpu",
    "expand_operand_cuda",
    "mx_operands_cpu",
    "mx_operands_cuda",
    "mx_operands_cuda_counted",
    "mx_operands_onepass_cuda",
    "prologue_cuda",
    "scaled_gemm_cpu",
    "scaled_gemm_cuda",
    "scaled_gemm_cuda_traceable",
]
