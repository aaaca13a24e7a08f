"""MX numerics, pure PyTorch (any device): the reference semantics of mxflux.

Every fast kernel in mxflux must reproduce these codes, scales and GEMM results bit for bit
(docs/design.md, "Kernels, backends and the reference"). This package imports nothing else of
mxflux: `kernels` and `ops` build on it, never the reverse.
"""

from .bitpack import pack_bits6, unpack_bits6
from .compact import SHIFT_NAN, compact_operand, compactable_blocks, expand_operand
from .constants import BLOCKWISE_GROUP, E4M3_MAX, E8M0_BIAS, E8M0_NAN, FP8_GEMM_ALIGN, MX_BLOCK
from .fold import fold_to_e4m3
from .formats import FORMATS, ElementFormat, get_format
from .granularity import FoldGranularity
from .hadamard import hadamard32
from .matmul import mx_matmul, true_fp32
from .metrics import snr_db
from .operands import PROLOGUES, MXOperands, apply_prologue, mx_operands_reference, padded_rows, rowwise_erefs_reference
from .quantize import MXTensor, dequantize, quantize
from .scaled_gemm import dequantize_operand, scaled_gemm_reference

__all__ = [
    "BLOCKWISE_GROUP",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FORMATS",
    "FP8_GEMM_ALIGN",
    "MX_BLOCK",
    "PROLOGUES",
    "SHIFT_NAN",
    "ElementFormat",
    "FoldGranularity",
    "MXOperands",
    "MXTensor",
    "apply_prologue",
    "compact_operand",
    "compactable_blocks",
    "dequantize",
    "dequantize_operand",
    "expand_operand",
    "fold_to_e4m3",
    "get_format",
    "hadamard32",
    "mx_matmul",
    "mx_operands_reference",
    "pack_bits6",
    "padded_rows",
    "quantize",
    "rowwise_erefs_reference",
    "scaled_gemm_reference",
    "snr_db",
    "true_fp32",
    "unpack_bits6",
]
