"""The 32-point Walsh–Hadamard rotation applied to every MX block (docs/design.md, "The Hadamard block
rotation").

Computed in fp32 as butterflies with h = 1, 2, 4, 8, 16 in that order (Sylvester order), then
one multiply by the fp32 constant 1/sqrt(32). The order of the additions is part of the
definition: GPU kernels reproduce it so that their codes match the reference bit for bit.
"""

from __future__ import annotations

import math

import torch

from .constants import MX_BLOCK

__all__ = ["hadamard32", "hadamard32_by_gemm", "HADAMARD_SCALE"]

# fp32(1/sqrt(32)); rounding it once here is what every implementation must use.
HADAMARD_SCALE = float(torch.tensor(1.0 / math.sqrt(MX_BLOCK), dtype=torch.float32))


def _fwht32_last(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised butterflies over the last axis, which holds exactly 32 fp32 values."""
    x = x.contiguous()
    lead = x.shape[:-1]
    out = torch.empty_like(x)  # never written into the caller's tensor
    h = 1
    while h < MX_BLOCK:
        # Pairs (j, j+h) inside each group of 2h: new_j = a + b, new_{j+h} = a - b.
        y = x.view(*lead, MX_BLOCK // (2 * h), 2, h)
        o = out.view(*lead, MX_BLOCK // (2 * h), 2, h)
        torch.add(y[..., 0, :], y[..., 1, :], out=o[..., 0, :])
        torch.sub(y[..., 0, :], y[..., 1, :], out=o[..., 1, :])
        x, out = out, (x if h > 1 else torch.empty_like(x))  # ping-pong between two buffers
        h *= 2
    return x


def hadamard32(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Rotate each block of 32 consecutive elements along `axis`; returns fp32.

    The normalised transform is its own inverse: hadamard32(hadamard32(x)) == x up to fp32
    rounding.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    axis = axis % x.dim() if x.dim() else 0
    n = x.shape[axis]
    if n % MX_BLOCK:
        raise ValueError(f"x: length {n} along axis {axis} is not a multiple of {MX_BLOCK}")
    xt = x.float().movedim(axis, -1)
    lead = xt.shape[:-1]
    y = _fwht32_last(xt.reshape(*lead, n // MX_BLOCK, MX_BLOCK)) * HADAMARD_SCALE
    return y.reshape(*lead, n).movedim(-1, axis).contiguous()


def _sylvester32(dtype: torch.dtype, device) -> torch.Tensor:
    """The unnormalised 32-point Hadamard matrix in Sylvester order, S[i, j] = (-1)^popcount(i & j):
    the matrix the butterflies apply. Exact in any floating dtype."""
    i = torch.arange(MX_BLOCK, device=device)
    bits = (i[:, None] & i[None, :])
    parity = sum((bits >> b) & 1 for b in range(5)) & 1
    return (1 - 2 * parity).to(dtype)


def hadamard32_by_gemm(x: torch.Tensor) -> torch.Tensor:
    """The block rotation along the last axis, in x's dtype, as one GEMM with the ±1 Sylvester
    matrix (exact in any dtype) and then the multiply by HADAMARD_SCALE: for a bf16 x one bf16 GEMM
    with fp32 sums, rounded to bf16, then the scale, rounded again. Not `hadamard32`'s bits (its sums
    are fp32 butterflies in a fixed order, and it returns fp32); where a rotation of an activation-
    sized tensor must cost no more than reading and writing it (the frozen base's dgrad), this is the
    form a GPU runs at that speed. The rotation is symmetric, so x·S is S applied to each block."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"x: last dimension {k} is not a multiple of {MX_BLOCK}")
    y = x.reshape(-1, MX_BLOCK) @ _sylvester32(x.dtype, x.device)
    return y.reshape(*lead, k) * HADAMARD_SCALE
