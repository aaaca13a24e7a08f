"""Error metrics shared by tests, benchmarks and the numerics tool."""

from __future__ import annotations

import math

import torch

__all__ = ["snr_db"]


def snr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-noise ratio 10·log10(Σref² / Σ(got − ref)²) in dB, computed in float64.

    Returns +inf when `got` equals `ref` exactly and NaN if either holds NaN.
    """
    if ref.shape != got.shape:
        raise ValueError(f"got: shape {tuple(got.shape)} differs from ref's {tuple(ref.shape)}")
    r, g = ref.detach().double(), got.detach().double()
    signal = float((r * r).sum())
    noise = float(((g - r) ** 2).sum())
    if math.isnan(signal) or math.isnan(noise):
        return float("nan")
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
