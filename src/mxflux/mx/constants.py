"""Numbers fixed by the OCP MX spec and by the FP8 tensor cores that run the MX GEMMs.

Every module of mxflux takes these from here, so each number has one definition
(docs/design.md, "Element formats and E8M0 scales").
"""

from __future__ import annotations

__all__ = [
    "BLOCKWISE_GROUP",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL_EXP",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FP8_GEMM_ALIGN",
    "MX_BLOCK",
]

# Elements that share one E8M0 scale, along the axis a GEMM contracts over; also the length of
# the Hadamard rotation (docs/design.md, "The Hadamard block rotation").
MX_BLOCK = 32

# An E8M0 code c is the scale 2^(c - E8M0_BIAS); the all-ones code is NaN.
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# The FP8 format the fold writes: its largest finite value and the exponent of its smallest
# subnormal (2^-9), which bound the fold's shift and window (docs/design.md, "The exact FP8
# fold and its window").
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL_EXP = -9

# Elements per scale of cuBLAS's 1x128 block-scaled FP8 GEMM (docs/design.md, "Fold granularity").
BLOCKWISE_GROUP = 128

# cuBLAS FP8 GEMMs need K and N in multiples of 16 (16-byte leading dimensions).
FP8_GEMM_ALIGN = 16
