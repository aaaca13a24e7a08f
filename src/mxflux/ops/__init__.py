"""The MX steps as torch.library custom ops (`torch.ops.mxflux.*`) and the backend choice behind
them; see `custom_ops`. Imports `mxflux.kernels` and `mxflux.mx`, never the reverse."""

from .custom_ops import (compact_operand, eref_buffer_words, eref_rows_and_columns, expand_operand, frozen_weight_col,
                         mx_erefs,
                         mx_operands, scaled_gemm, static_kernel_launch, use_kernels, weight_exponents,
                         weight_exponents_available)

__all__ = ["compact_operand", "eref_buffer_words", "eref_rows_and_columns", "expand_operand", "frozen_weight_col",
           "mx_erefs", "mx_operands",
           "scaled_gemm", "static_kernel_launch", "use_kernels", "weight_exponents", "weight_exponents_available"]
