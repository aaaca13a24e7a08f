"""Storage bit-packing of 6-bit element codes: 4 codes in 3 bytes, little-endian.

Bytes (b0, b1, b2) hold the 24-bit word c0 | c1<<6 | c2<<12 | c3<<18. Kernels keep one code
per byte; this form is for checkpoints, saved activations and files. (Packing into GEMM
operands, which quantizes and folds, is `mxflux.mx.operands`.)
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits6", "unpack_bits6"]


def pack_bits6(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes (< 64) along the last axis: [..., n] → [..., 3n/4] uint8."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    if codes.dim() == 0:
        raise ValueError("codes: expected at least one dimension, got a scalar")
    n = codes.shape[-1]
    if n % 4:
        raise ValueError(f"codes: last-axis length {n} is not a multiple of 4 (4 codes pack into 3 bytes)")
    if codes.numel() and int(codes.max()) >= 64:
        raise ValueError(f"codes: values must be 6-bit (< 64), found {int(codes.max())}")
    c = codes.reshape(*codes.shape[:-1], n // 4, 4).to(torch.int32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack((word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF), dim=-1)
    return out.to(torch.uint8).reshape(*codes.shape[:-1], 3 * n // 4)


def unpack_bits6(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_bits6`: [..., 3n/4] uint8 → [..., n] uint8 codes."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected a uint8 tensor, got {getattr(packed, 'dtype', type(packed))}")
    if n % 4:
        raise ValueError(f"n: {n} is not a multiple of 4 (4 codes pack into 3 bytes)")
    if packed.dim() == 0 or packed.shape[-1] != 3 * n // 4:
        raise ValueError(
            f"packed: expected last-axis length {3 * n // 4} for n={n}, got shape {tuple(packed.shape)}"
        )
    b = packed.reshape(*packed.shape[:-1], n // 4, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    c = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1)
    return c.to(torch.uint8).reshape(*packed.shape[:-1], n)
