"""The layout of a weight's row-granularity reference exponents (e_ref), as the packer takes them.

The row granularity packs a tensor in two passes: pass 1 reads it only to find, per row and per
column, the largest block exponent e_ref; pass 2 encodes (`operands_cuda`). For a weight, pass 1
reads 4 bytes per element (fp32 master weights) for a result of a few words per row and column,
and it is the optimizer that last wrote those elements. So the AdamW step computes the e_ref of
the weights it has just updated (`adamw_cuda`), and the packer, handed them as an argument
(`mx_operands_cuda(..., erefs=)`), runs pass 2 only: bit for bit the same operands, since the same
code computes the maxima from the same bf16 rounding of the same values. Whoever hands them over
vouches that they are the weight's current ones (`mxflux.nn.weight_state`).

Buffer layout: int32 words, the rows' e_ref first (R words, padded to a multiple of 4, so that the
column part is 16-byte aligned), then the columns' (C words); e + 128 for a row or column with a
live block, 0 where it has none.
"""

from __future__ import annotations

import torch

__all__ = ["buffer_words", "rows_and_columns"]


def buffer_words(rows: int, cols: int) -> int:
    """int32 words of one weight's buffer: rows padded to 4 (16-byte aligned column part), then columns."""
    return -(-rows // 4) * 4 + cols


def rows_and_columns(erefs: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's buffer as its rows' part and its columns' part (views)."""
    split = buffer_words(rows, cols) - cols
    return erefs[:split], erefs[split:]
