"""Triton 3.6's interpreter under numpy >= 2.4, for the processes that run our kernels under
`TRITON_INTERPRET=1` (the FSDP workers of tests/gpu/test_adamw_fsdp.py, and tests in this process).

The interpreter turns a tensor used as a Python index (a loop bound: the packer's `range(pid_r,
n_row_tiles, n_prog_r)`) into an int with `int()` of its one-element numpy array, which numpy 2.4 refuses
("only 0-dimensional arrays can be converted to Python scalars"). Triton's own fix
(triton-lang/triton#9172) converts the squeezed array; this installs the same conversion where the
installed Triton predates it. It changes nothing compiled: only the interpreter's patching of `tl.tensor`.
"""

from __future__ import annotations

import os


def apply() -> bool:
    """Install the conversion when the interpreter is on and Triton is present; whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter._patch_lang_tensor, "_squeezes_index", False):
        return True
    original = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # after the original's own `__index__`, so that the scope's restore (last in, first out) undoes both
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._squeezes_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True
