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


def _bitcast(src, dst, doc: str):
    """A numba intrinsic reinterpreting a `src` value's bits as `dst` (same width)."""

    @intrinsic
    def cast(typingctx, x):
        if x != src:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    cast.__doc__ = doc
    return cast


f32_bits = _bitcast(types.float32, types.int32, "The int32 bits of an fp32 value.")
bits_f32 = _bitcast(types.int32, types.float32, "The fp32 value of int32 bits.")
