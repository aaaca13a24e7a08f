"""Register bitcasts between fp32 and int32 for the numba CPU kernels.

The kernels work on the bits of fp32 values (exponents, integer rounding). numba has no scalar
bitcast, and going through a one-element array view stores and reloads the value, which stops
LLVM from vectorizing the loop around it; these intrinsics are a plain LLVM `bitcast`.
Import only where numba is installed.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic

__all__ = ["bits_f32", "f32_bits"]


@intrinsic
def f32_bits(typingctx, x):
    """The int32 bits of an fp32 value."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.int32))

    return types.int32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    """The fp32 value of int32 bits."""
    if x != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.int32), codegen
