"""How many MX blocks share one fp32 scale after the FP8 fold (docs/design.md, "Fold granularity").

A recipe's `mx_gemm` names it; `FoldGranularity.from_mx_gemm` is the one place that name is
read. Everything else (the reference fold, the packers, the GEMM dispatch, the custom ops) takes
a `FoldGranularity` and asks it for what it needs.
"""

from __future__ import annotations

from enum import Enum

from .constants import BLOCKWISE_GROUP, MX_BLOCK

__all__ = ["FoldGranularity"]


class FoldGranularity(Enum):
    """One fp32 scale per row (ROWWISE), per 1x128 group (BLOCKWISE) or per MX block (EXACT).

    ROWWISE runs as a row-wise-scaled FP8 GEMM and is exact inside the fold window; BLOCKWISE
    runs as cuBLAS's 1x128 block-scaled FP8 GEMM; EXACT keeps every block's own scale (always
    exact) and runs as a bf16 GEMM on the dequantized operands. The value is the recipe's name.
    """

    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    EXACT = "exact"

    @classmethod
    def from_mx_gemm(cls, name: str) -> "FoldGranularity":
        """The granularity a recipe's `mx_gemm` selects; ValueError naming the field otherwise."""
        try:
            return _BY_NAME[name]
        except (KeyError, TypeError):
            raise ValueError(f"mx_gemm: expected one of {list(_BY_NAME)}, got {name!r}") from None

    @property
    def fixed_group(self) -> int | None:
        """Elements per scale when that does not depend on the row length; None for ROWWISE."""
        return _FIXED_GROUP[self]

    @property
    def kernel_id(self) -> int:
        """The integer the Triton packer takes as its GRAN constexpr: 0 (a whole row), 128 or 32."""
        return _FIXED_GROUP[self] or 0

    @property
    def row_multiple(self) -> int:
        """What a row length must be a multiple of: whole MX blocks, and whole 1x128 groups."""
        return max(MX_BLOCK, _FIXED_GROUP[self] or MX_BLOCK)

    def group_size(self, n: int) -> int:
        """Elements per scale along a row of `n` elements (a multiple of `row_multiple`)."""
        return _FIXED_GROUP[self] or n

    def groups(self, n: int) -> int:
        """Scales per row of `n` elements: 1 for ROWWISE, n / group otherwise."""
        g = _FIXED_GROUP[self]
        return 1 if g is None else n // g


_BY_NAME = {g.value: g for g in FoldGranularity}
_FIXED_GROUP = {FoldGranularity.ROWWISE: None, FoldGranularity.BLOCKWISE: BLOCKWISE_GROUP,
                FoldGranularity.EXACT: MX_BLOCK}
