"""Fast paths for Hopper (DESIGN.md §2–§4): Triton MX packers and FP8-tensor-core MX GEMMs, the
Triton row-wise FP8 casts of the FP8 baseline (`fp8_pack_cuda`);
and the compiled CPU packer (`pack_cpu`, numba: `pack_numba`) that the CPU training path uses.

Importing this package never needs CUDA or Triton: `pack_cuda` raises a clear RuntimeError
where it cannot run (check `kernel_available()` first), and `scaled_gemm_cuda` needs a CUDA
device for cuBLAS.
"""

from .fp8_cast import fp8_pack_cuda
from .gemm import GEMM_SHAPE_RULES, scaled_gemm_cuda
from .pack_numba import HAS_NUMBA, cpu_kernel_available, pack_cpu
from .pack import HAS_TRITON, kernel_available, pack_cuda, prologue_cuda

__all__ = [
    "GEMM_SHAPE_RULES",
    "HAS_NUMBA",
    "HAS_TRITON",
    "cpu_kernel_available",
    "fp8_pack_cuda",
    "kernel_available",
    "pack_cpu",
    "pack_cuda",
    "prologue_cuda",
    "scaled_gemm_cuda",
]
