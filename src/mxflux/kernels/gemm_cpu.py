"""The CPU fast path of the scaled FP8 GEMM (`mxflux.mx.scaled_gemm`): the operands dequantized by
one compiled pass each, then multiplied with fp32 accumulation and rounded once.

The reference dequantizes an operand as `data.float() * scale.repeat_interleave(...)`: PyTorch
converts float8 to fp32 element by element (~3 ns each on a small CPU), then expands the scales
and multiplies, three passes over [rows, K] fp32. On the demo model's CPU training path that was
a third of a step. Here one vectorized numba pass per operand decodes each E4M3 byte to the fp32
value torch gives it (NaNs and signed zeros included; tested over all 256 bytes) and multiplies
it by its group's scale.

The values have at most 4 significant bits and the MX scales are powers of two, so each value is
also exactly a bf16 (unless a scale below 2^-117 makes an fp32 subnormal of it; such groups are
checked value by value). Then the product runs as MKL's bf16 GEMM with fp32 accumulation
(`cpu_blas`), ~3x the fp32 matmul: the contract of the GEMM (exact values, fp32 sums, one
rounding) with another summation order, as cuBLAS has on the GPU. Operands with a value that is not
a bf16, or a PyTorch without that GEMM, take the reference's own fp32 matmul on the fp32 values:
the reference bit for bit (as do products too large for MKL's 32-bit indexing).

numba is optional (`cpu_kernel_available()`); the custom ops fall back to the reference without it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..mx.scaled_gemm import add_bias_and_round, dequantized_gemm
from .cpu_blas import bf16_gemm_available, bf16_gemm_fits, gemm_bf16_f32
from .operands_cpu import HAS_NUMBA, numpy_view

__all__ = ["dequantize_operand_bf16_cpu", "dequantize_operand_cpu", "scaled_gemm_cpu"]

# The fp32 bits of 2^-117. Every E4M3 value (≤ 4 significant bits, down to the subnormal 2^-9)
# times a zero, ±inf or power-of-two scale at least this large is exactly a bf16: it stays an fp32
# normal (or overflows to inf in both formats). Groups with other scales are checked value by value.
_EXACT_SCALE_MIN_BITS = (127 - 117) << 23

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
                # 1-D slices of the group: with 2-D indexing in the loop LLVM does not vectorize it (3x slower)
                c, o = codes[r, gi * g:(gi + 1) * g], out[r, gi * g:(gi + 1) * g]
                for k in range(g):
                    o[k] = _e4m3_value(c[k]) * s

    @njit(cache=True, parallel=True)
    def _dequantize_bf16(codes, scale, out):
        """`_dequantize` into the bf16 bits (uint16) of the same values: the upper half of each fp32
        value's bits. Returns how many groups hold a value whose lower half is not zero (not a bf16);
        only groups whose scale does not guarantee exactness (`_EXACT_SCALE_MIN_BITS`) are checked."""
        R, K = codes.shape
        groups = scale.shape[1]
        g = K // groups
        inexact = 0
        for r in prange(R):
            for gi in range(groups):
                s = scale[r, gi]
                c, o = codes[r, gi * g:(gi + 1) * g], out[r, gi * g:(gi + 1) * g]
                for k in range(g):
                    o[k] = np.uint16((f32_bits(_e4m3_value(c[k]) * s) >> 16) & 0xFFFF)
                mag = f32_bits(s) & 0x7FFFFFFF
                if mag != 0 and ((mag & 0x7FFFFF) != 0 or mag < _EXACT_SCALE_MIN_BITS):
                    low = 0
                    for k in range(g):
                        low |= f32_bits(_e4m3_value(c[k]) * s) & 0xFFFF
                    if low != 0:
                        inexact += 1
        return inexact


def _check_operand(data: torch.Tensor, scale: torch.Tensor) -> None:
    if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        raise ValueError(f"data: expected a 2-D float8_e4m3fn tensor, got {data.dtype} of shape {tuple(data.shape)}")
    r, k = data.shape
    if scale.dim() != 2 or scale.shape[0] != r or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"scale: expected [{r}, groups] with groups dividing K={k}, got {tuple(scale.shape)}")


def _dequantize_into(data, scale, dtype, poison: bool) -> tuple[torch.Tensor, int]:
    """The values and, for bf16, the count of groups with a value that is not a bf16 (0 for fp32)."""
    if not HAS_NUMBA:
        raise RuntimeError("dequantizing on the CPU needs numba (pip install numba); use dequantize_operand instead")
    _check_operand(data, scale)
    r, k = data.shape
    # Poisoned (NaN; 0xFFFF is a bf16 NaN) for tests: an element the kernel missed fails them.
    out = np.full((r, k), np.nan if dtype == np.float32 else 0xFFFF, dtype) if poison else np.empty((r, k), dtype)
    inexact = 0
    if r and k:
        codes, scales = numpy_view(data.view(torch.uint8)), numpy_view(scale.float())
        if dtype == np.float32:
            _dequantize(codes, scales, out)
        else:
            inexact = _dequantize_bf16(codes, scales, out)
    return torch.from_numpy(out), int(inexact)


def dequantize_operand_cpu(data: torch.Tensor, scale: torch.Tensor, *, _poison: bool = False) -> torch.Tensor:
    """`mxflux.mx.scaled_gemm.dequantize_operand` on the CPU: fp32 values of a scaled E4M3 operand
    [R, K] (any strides) with fp32 scale [R, K/g], bit for bit."""
    return _dequantize_into(data, scale, np.float32, _poison)[0]


def dequantize_operand_bf16_cpu(data: torch.Tensor, scale: torch.Tensor, *, _poison: bool = False) -> torch.Tensor | None:
    """`dequantize_operand_cpu` as bf16 (the same values), or None where some value is not a bf16.
    MX operands' values always are (≤ 4 significant bits, power-of-two scales), except where a
    scale below 2^-117 makes an fp32 subnormal of a nonzero one."""
    values, inexact = _dequantize_into(data, scale, np.uint16, _poison)
    return None if inexact else values.view(torch.bfloat16)


def scaled_gemm_cpu(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`scaled_gemm_reference` on CPU tensors (same arguments): through MKL's bf16 GEMM where the
    operands' values are exact bf16s, otherwise bit for bit."""
    if bf16_gemm_available() and bf16_gemm_fits(a_data.shape[0], b_data.shape[0], a_data.shape[-1]):
        a = dequantize_operand_bf16_cpu(a_data, a_scale)
        b = dequantize_operand_bf16_cpu(b_data, b_scale) if a is not None else None
        if b is not None:
            return add_bias_and_round(gemm_bf16_f32(a, b), bias, out_dtype)
    a = dequantize_operand_cpu(a_data, a_scale)
    b = dequantize_operand_cpu(b_data, b_scale)
    return dequantized_gemm(a, b, bias, out_dtype)
