"""The MX steps as torch.library custom ops (`torch.ops.mxflux.*`) and the backend choice behind
them; see `custom_ops`. Imports `mxflux.kernels` and `mxflux.mx`, never the reverse."""

from .custom_ops import compact_operand, expand_operand, mx_operands, scaled_gemm, use_kernels

__all__ = ["compact_operand", "expand_operand", "mx_operands", "scaled_gemm", "use_kernels"]
