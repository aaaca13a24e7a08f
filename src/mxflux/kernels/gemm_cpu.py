"""The CPU fast path of the scaled FP8 GEMM: `mxflux.mx.scaled_gemm.scaled_gemm_reference`, bit
for bit, with the operands dequantized by one compiled pass each.

The reference dequantizes an operand as `data.float() * scale.repeat_interleave(...)`: PyTorch
converts float8 to fp32 element by element (~3 ns each on a small CPU), then expands the scales
and multiplies, three passes over [rows, K] fp32. On the demo model's CPU training path that was
a third of a step. Here one vectorized numba pass per operand decodes each E4M3 byte to the fp32
value torch gives it (NaNs and signed zeros included; tested over all 256 bytes) and multiplies
it by its group's scale: the same fp32 values, hence the same product from the same fp32 matmul.

numba is optional (`cpu_kernel_available()`); the custom ops fall back to the reference without it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..mx.scaled_gemm import dequantized_gemm
from .operands_cpu import HAS_NUMBA, numpy_view

__all__ = ["dequantize_operand_cpu", "scaled_gemm_cpu"]

if HAS_NUMBA:
    from numba import njit, prange

    from .cpu_bits import bits_f32, f32_bits

    @njit(cache=True, inline="always")
    def _e4m3_value(byte):
        """torch's fp32 value of an E4M3 byte, computed from its fields (vectorizes, where a table
        lookup is a gather): normals by placing exponent and mantissa, subnormals as m x 2^-9, and
        NaN (S.1111.111) as torch writes it, the mantissa bits under an all-ones exponent."""
        b = np.int32(byte)
        sign = (b & 0x80) << 24
        e = (b >> 3) & 0xF
        m = b & 0x7
        normal = sign | ((e + 120) << 23) | (m << 20)
        nan = sign | np.int32(0x7F800000) | (m << 20)
        subnormal = bits_f32(np.int32(sign | f32_bits(np.float32(m) * np.float32(1.0 / 512.0))))
        return subnormal if e == 0 else bits_f32(np.int32(nan if (b & 0x7F) == 0x7F else normal))

    @njit(cache=True, parallel=True)
    def _dequantize(codes, scale, out):
        """out[r, k] = fp32(codes[r, k]) * scale[r, k // (K / groups)] for uint8 `codes` [R, K]."""
        R, K = codes.shape
        groups = scale.shape[1]
        g = K // groups
        for r in prange(R):
            for gi in range(groups):
                s = scale[r, gi]
                for k in range(gi * g, (gi + 1) * g):
                    out[r, k] = _e4m3_value(codes[r, k]) * s


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
        _dequantize(numpy_view(data.view(torch.uint8)), numpy_view(scale.float()), out)
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
