"""The MX steps as torch.library custom ops (`torch.ops.mxflux.*`) and the backend choice behind
them; see `custom_ops`. Imports `mxflux.kernels` and `mxflux.mx`, never the reverse."""

from .custom_ops import mx_operands, scaled_gemm, use_kernels

__all__ = ["mx_operands", "scaled_gemm", "use_kernels"]
