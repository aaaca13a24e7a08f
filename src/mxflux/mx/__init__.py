"""MX numerics, pure PyTorch (any device): the reference semantics of mxflux (DESIGN.md §1–§2).

Every fast kernel in mxflux must reproduce these codes and scales bit for bit.
"""

from .fold import fold_to_e4m3
from .formats import FORMATS, ElementFormat, get_format
from .hadamard import hadamard32
from .matmul import mx_matmul
from .metrics import snr_db
from .packing import pack6, unpack6
from .quantize import MXTensor, dequantize, quantize

__all__ = [
    "FORMATS",
    "ElementFormat",
    "MXTensor",
    "dequantize",
    "fold_to_e4m3",
    "get_format",
    "hadamard32",
    "mx_matmul",
    "pack6",
    "quantize",
    "snr_db",
    "unpack6",
]
