"""Reference semantics of the MX packer: what every packing kernel must reproduce.

A packer reads one bf16 matrix [R, C] (optionally through a prologue) and writes the GEMM
operands that the FP8 tensor cores consume (DESIGN.md §2–§3):

- "row" orientation: quantized along C (blocks of 32 consecutive columns), folded to E4M3 →
  data [R, C] float8_e4m3fn + fp32 scale [R, C/g] (g = C for row-wise folding → [R, 1]);
- "col" orientation: the transposed copy, quantized along R → data [C, Rp] + scale [C, Rp/g],
  where R is zero-padded to Rp, a multiple of 32 and of g (zero blocks add nothing to a GEMM);
- colsum: Σ over rows of the (prologue-applied) bf16 values in fp32 → [C] (a bias gradient);
- n_inexact: blocks outside the fold window, summed over both orientations.

Prologues (the fused MLP's, DESIGN.md §4) reproduce exactly what the unfused modules compute
in bf16: "gelu_tanh" is F.gelu(x, approximate="tanh"); "gelu_tanh_grad" is x × GELU′(aux),
torch's gelu_backward with aux = the pre-activation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..mx import fold_to_e4m3, quantize

__all__ = ["FP8_DTYPES", "PROLOGUES", "Packed", "apply_prologue", "fp8_pack_reference", "pack_reference", "padded_rows"]

PROLOGUES = ("none", "gelu_tanh", "gelu_tanh_grad")


class Packed(NamedTuple):
    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    colsum: torch.Tensor | None
    n_inexact: torch.Tensor


def padded_rows(r: int, granularity: str | int = "row", block: int = 32) -> int:
    """Rows of the col orientation: R rounded up to whole blocks and whole scale groups."""
    multiple = block if granularity == "row" else max(block, int(granularity))
    return -(-r // multiple) * multiple


def apply_prologue(x: torch.Tensor, prologue: str, aux: torch.Tensor | None = None) -> torch.Tensor:
    if prologue == "none":
        return x
    if prologue == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if prologue == "gelu_tanh_grad":
        if aux is None or aux.shape != x.shape:
            raise ValueError(f"aux: the gelu_tanh_grad prologue needs the pre-activation, shape {tuple(x.shape)}")
        return torch.ops.aten.gelu_backward(x, aux, approximate="tanh")
    raise ValueError(f"prologue: expected one of {PROLOGUES}, got {prologue!r}")


def pack_reference(
    x: torch.Tensor,
    *,
    row: bool = True,
    col: bool = True,
    granularity: str | int = "row",
    hadamard: bool = True,
    fmt: str = "e2m3",
    prologue: str = "none",
    aux: torch.Tensor | None = None,
    colsum: bool = False,
) -> Packed:
    """Pack a 2-D [R, C] tensor into the requested GEMM operands (see module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    v = apply_prologue(x, prologue, aux)
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    row_data = row_scale = col_data = col_scale = sums = None
    n_inexact = zero
    if row:
        row_data, row_scale, n = fold_to_e4m3(quantize(v, fmt, axis=1, hadamard=hadamard), granularity)
        n_inexact = n_inexact + n
    if col:
        r = v.shape[0]
        vt = F.pad(v, (0, 0, 0, padded_rows(r, granularity) - r)).t()  # [C, Rp]
        col_data, col_scale, n = fold_to_e4m3(quantize(vt, fmt, axis=1, hadamard=hadamard), granularity)
        n_inexact = n_inexact + n
    if colsum:
        sums = v.float().sum(dim=0)
    return Packed(row_data, row_scale, col_data, col_scale, sums, n_inexact)


# --- FP8 baseline (DESIGN.md: the MLPerf FP8 recipe): row-wise current scaling -------------

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _fp8_rowwise(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row current scaling: scale = amax/max(dtype), data = v/scale saturated into dtype."""
    fmax = torch.finfo(dtype).max
    amax = v.abs().amax(dim=1, keepdim=True).float()
    # A tensor divisor, not the Python float: torch's CUDA kernel turns division by a CPU scalar
    # into multiplication by its rounded reciprocal (one bit off for ~half of the amaxes), the CPU
    # divides. IEEE division on every device is the definition the Triton casts reproduce.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, fmax), torch.ones_like(amax))
    data = (v.float() / scale).clamp(-fmax, fmax).to(dtype)
    return data, scale


def fp8_pack_reference(x: torch.Tensor, *, row: bool = True, col: bool = True, fmt: str = "e4m3",
                       colsum: bool = False):
    """Both orientations of a row-wise-scaled FP8 operand of x [R, C] (what `fp8_pack_cuda` matches).

    Returns (row_data [R, C], row_scale [R, 1], col_data [C, Rp], col_scale [C, 1], colsum [C]),
    None for what was not asked for; the col copy is x transposed and zero-padded to Rp rows.
    """
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt: expected one of {sorted(FP8_DTYPES)}, got {fmt!r}")
    dtype = FP8_DTYPES[fmt]
    row_data, row_scale = _fp8_rowwise(x, dtype) if row else (None, None)
    col_data = col_scale = None
    if col:
        r = x.shape[0]
        xt = F.pad(x, (0, 0, 0, padded_rows(r) - r)).t().contiguous()
        col_data, col_scale = _fp8_rowwise(xt, dtype)
    sums = x.float().sum(dim=0) if colsum else None
    return row_data, row_scale, col_data, col_scale, sums
