"""Reference semantics of the MX operand packer: what every packing kernel must reproduce.

A packer reads one bf16 matrix [R, C] (optionally through a prologue), quantizes it to MX
(rotation, E8M0 scales, element codes) and folds it into the operands that the FP8 tensor cores
consume (docs/design.md, "The exact FP8 fold and its window" and "The three GEMMs and their
operands"):

- "row" orientation: quantized along C (blocks of MX_BLOCK consecutive columns), folded to
  E4M3 → data [R, C] float8_e4m3fn + fp32 scale [R, C/g] (g = C for ROWWISE → [R, 1]);
- "col" orientation: the transposed copy, quantized along R → data [C, Rp] + scale [C, Rp/g],
  where R is zero-padded to Rp, whole blocks and whole scale groups (zero blocks add nothing
  to a GEMM);
- colsum: Σ over rows of the (prologue-applied) bf16 values in fp32 → [C] (a bias gradient);
- blocks_outside_window: blocks outside the fold window, summed over both orientations.

Prologues (the fused MLP's, docs/design.md, "Fusions") reproduce exactly what the unfused
modules compute in bf16: "gelu_tanh" is F.gelu(x, approximate="tanh"); "gelu_tanh_grad" is
x × GELU′(aux), torch's gelu_backward with aux = the pre-activation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fold import fold_to_e4m3, rowwise_erefs
from .granularity import FoldGranularity
from .quantize import quantize
from .scaled_gemm import dequantize_operand

__all__ = ["MXOperands", "PROLOGUES", "apply_prologue", "mx_operands_reference", "padded_rows", "rowwise_erefs_reference",
           "transposed_column_scale", "transposed_operand"]

PROLOGUES = ("none", "gelu_tanh", "gelu_tanh_grad")


class MXOperands(NamedTuple):
    """A packer's outputs; None for an orientation or column sum that was not asked for."""

    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    colsum: torch.Tensor | None
    blocks_outside_window: torch.Tensor  # 0-d int64


def padded_rows(r: int, granularity: FoldGranularity = FoldGranularity.ROWWISE) -> int:
    """Rows of the col orientation: R rounded up to whole blocks and whole scale groups."""
    multiple = granularity.row_multiple
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


def mx_operands_reference(
    x: torch.Tensor,
    *,
    row: bool = True,
    col: bool = True,
    granularity: FoldGranularity = FoldGranularity.ROWWISE,
    hadamard: bool = True,
    fmt: str = "e2m3",
    prologue: str = "none",
    aux: torch.Tensor | None = None,
    colsum: bool = False,
    col_held: torch.Tensor | None = None,
    col_headroom: int = 0,
) -> MXOperands:
    """Pack a 2-D [R, C] tensor into the requested GEMM operands (see module docstring).

    `col_held` (ROWWISE only: int32 [C], e_ref + 128 per column or 0, as `rowwise_erefs_reference`
    gives them) places each column's fold window at a predicted e_ref, raised by `col_headroom`
    binades, wherever that holds the column (`fold_to_e4m3`'s `held`): what the one-pass packer
    encodes against, the prediction being the last step's maxima."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    v = apply_prologue(x, prologue, aux)
    outside = torch.zeros((), dtype=torch.int64, device=x.device)
    row_data = row_scale = col_data = col_scale = sums = None
    if row:
        row_data, row_scale, n = fold_to_e4m3(quantize(v, fmt, axis=1, hadamard=hadamard), granularity)
        outside = outside + n
    if col:
        r = v.shape[0]
        vt = F.pad(v, (0, 0, 0, padded_rows(r, granularity) - r)).t()  # [C, Rp]
        col_data, col_scale, n = fold_to_e4m3(quantize(vt, fmt, axis=1, hadamard=hadamard), granularity,
                                              held=col_held, headroom=col_headroom)
        outside = outside + n
    if colsum:
        sums = v.float().sum(dim=0)
    return MXOperands(row_data, row_scale, col_data, col_scale, sums, outside)


def rowwise_erefs_reference(x: torch.Tensor, *, hadamard: bool = True, fmt: str = "e2m3") -> tuple[torch.Tensor, torch.Tensor]:
    """The row granularity's e_ref of each row of x and of each column (its col orientation's rows,
    R zero-padded), as `fold_to_e4m3` encodes against them: int32 [R] and [C], e_ref + 128 where the
    line has a live block, 0 where it has none. What the CUDA packer's first pass finds, and what
    its second pass (or each orientation's on its own) can be handed."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    rows = rowwise_erefs(quantize(x, fmt, axis=1, hadamard=hadamard))
    vt = F.pad(x, (0, 0, 0, padded_rows(x.shape[0]) - x.shape[0])).t()
    return rows, rowwise_erefs(quantize(vt, fmt, axis=1, hadamard=hadamard))


# Where `transposed_operand` puts a column's largest value: [2^7, 2^8). E2M3's largest significand,
# 1.875, then gives at most 240, inside E4M3's 448; 14 binades of normal numbers lie below it.
_TRANSPOSED_TOP_EXPONENT = 7


def transposed_column_scale(row_data: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The power of two per column k of W (fp32 [K]) by which `transposed_operand` divides that
    column: the one that puts its largest magnitude in [2^7, 2^8) (1 for a zero column). A
    property of the weight alone: a frozen weight computes it once (`FrozenMXFP6Linear`), and
    each backward's transposition is then a single pass over the bytes, not a reduction first."""
    w = dequantize_operand(row_data, row_scale)  # fp32 [N, K], exact: E4M3 times a power of two
    top = ((w.view(torch.int32) >> 23) & 0xFF).amax(dim=0)  # fp32's exponent field: the binade, 0 for zero
    exponent = torch.where(top > 0, top - 127 - _TRANSPOSED_TOP_EXPONENT, 0).clamp(min=-126)
    return torch.ldexp(torch.ones_like(w[0]), exponent)


def transposed_operand(row_data: torch.Tensor, row_scale: torch.Tensor, granularity: FoldGranularity,
                       column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The operand of Wᵀ (data E4M3 [K, Np], scale [K, groups(Np)]) that holds the values of the row
    operand (`row_data` E4M3 [N, K], `row_scale` [N, groups(K)]) of W, re-scaled per column of W.

    The values move, they are not quantized again: each column k gets the power of two 2^e_k that
    puts its largest magnitude in [2^7, 2^8) (`transposed_column_scale`, or `column_scale` where it
    was computed before), and every value of the column is divided by it, an exact operation, then
    stored as E4M3. The bytes hold E2M3 significands (3 bits), so the store is exact for every
    value within 2^-13 of its column's largest (E4M3's normal range); a smaller one rounds to
    E4M3's subnormal grid, an error below 2^-17 of the column's largest. The same scale is
    repeated over a row's groups, whatever the granularity. Only exact operations and one rounding
    cast: any implementation of these steps gives the same bits (the CUDA path compiles this)."""
    n, k = row_data.shape
    scale = transposed_column_scale(row_data, row_scale) if column_scale is None else column_scale
    w = dequantize_operand(row_data, row_scale)
    rows = padded_rows(n, granularity)
    # (contiguous: compiled, inductor would otherwise write the bytes column-major, as it reads w)
    data = F.pad(w.t() / scale[:, None], (0, rows - n)).to(torch.float8_e4m3fn).contiguous()
    return data, scale[:, None].expand(k, granularity.groups(rows)).contiguous()
