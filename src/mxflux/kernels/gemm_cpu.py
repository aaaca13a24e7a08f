"""The CPU fast path of the scaled FP8 GEMM: `mxflux.mx.scaled_gemm.scaled_gemm_reference`, bit
for bit, with the operands dequantized by one compiled pass each.

The reference dequantizes an operand as `data.float() * scale.repeat_interleave(...)`: PyTorch
converts float8 to fp32 element by element (~3 ns each on a small CPU), then expands the scales
and multiplies, three passes over [rows, K] fp32. On the demo model's CPU training path that was
a third of a step. Here one numba pass per operand reads each E4M3 byte, looks its fp32 value up
in a 256-entry table (torch's own float8 -> fp32 conversion of every byte, so NaNs and signed
zeros are torch's) and multiplies it by its group's scale: the same fp32 values, hence the same
product from the same fp32 matmul.

numba is optional (`cpu_kernel_available()`); the custom ops fall back to the reference without it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..mx.scaled_gemm import dequantized_gemm
from .operands_cpu import HAS_NUMBA, numpy_view

if HAS_NUMBA:
    from numba import njit, prange

__all__ = ["dequantize_operand_cpu", "scaled_gemm_cpu"]

# fp32 value of every E4M3 byte, as torch converts it
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


if HAS_NUMBA:

    @njit(cache=True, parallel=True)
    def _dequantize(codes, scale, values, out):
        """out[r, k] = values[codes[r, k]] * scale[r, k // (K / groups)] for uint8 `codes` [R, K]."""
        R, K = codes.shape
        groups = scale.shape[1]
        g = K // groups
        for r in prange(R):
            for gi in range(groups):
                s = scale[r, gi]
                for k in range(gi * g, (gi + 1) * g):
                    out[r, k] = values[codes[r, k]] * s


def dequantize_operand_cpu(data: torch.Tensor, scale: torch.Tensor, *, _poison: bool = False) -> torch.Tensor:
    """`mxflux.mx.scaled_gemm.dequantize_operand` on the CPU: fp32 values of a scaled E4M3 operand
    [R, K] (any strides) with fp32 scale [R, K/g], bit for bit."""
    if not HAS_NUMBA:
        raise RuntimeError("dequantize_operand_cpu needs numba (pip install numba); use dequantize_operand instead")
    if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        raise ValueError(f"data: expected a 2-D float8_e4m3fn tensor, got {data.dtype} of shape {tuple(data.shape)}")
    r, k = data.shape
    if scale.dim() != 2 or scale.shape[0] != r or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"scale: expected [{r}, groups] with groups dividing K={k}, got {tuple(scale.shape)}")
    # Poisoned (NaN) for tests: an element the kernel missed fails them.
    out = np.full((r, k), np.nan, np.float32) if _poison else np.empty((r, k), np.float32)
    if r and k:
        _dequantize(numpy_view(data.view(torch.uint8)), numpy_view(scale.float()), _E4M3_VALUES, out)
    return torch.from_numpy(out)


def scaled_gemm_cpu(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`scaled_gemm_reference` on CPU tensors, bit for bit (same arguments, same result)."""
    a = dequantize_operand_cpu(a_data, a_scale)
    b = dequantize_operand_cpu(b_data, b_scale)
    return dequantized_gemm(a, b, bias, out_dtype)
