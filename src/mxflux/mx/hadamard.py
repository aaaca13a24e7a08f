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

__all__ = ["hadamard32", "HADAMARD_SCALE"]

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
