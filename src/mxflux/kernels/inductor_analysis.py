"""Inductor's analysis of which arguments a user-defined Triton kernel writes, done once per kernel
variant instead of once per call site and compile stage, for the kernels `memoize_access_analysis`
is given (the packer kernel that `operands_inline` launches).

Why: to know what a `wrap_triton` launch mutates, torch converts the whole kernel to TTIR with
Triton's code generator and walks it (`torch._higher_order_ops.triton_kernel_wrap`), and it does so
afresh at every call site of every graph it compiles: when functionalising the graph, when
propagating mutations and again when building the launch's IR node; nothing is cached. For the
packer kernel one conversion takes ~0.4 s on a 2-core CPU, a Flux block has 20-odd packer launches,
and a 6+12-block model with the packers inlined did not finish compiling in the time the opaque op
compiled and ran it (benchmarks/NOTES.md, "In a whole model the inline packers cost too much compile
time").

What the analysis depends on is exactly what its TTIR is generated from: the kernel, the target,
each tensor argument's dtype, each other argument's value (symbolic sizes all become 2). The memo
is keyed on those and answers only calls whose every argument it can key (tensors, inductor's
tensor boxes, symbolic values, plain scalars and strings) and that have no TMA descriptors; every
other call, and every other kernel, goes to torch's analysis as before. Each caller gets its own
copy of the answer.

This wraps a torch-internal function by name (torch 2.11 `identify_mutated_tensors`, 2.13
`identify_accessed_tensors`); where neither exists the memo is not installed and torch's own
analysis runs (`memoize_access_analysis` returns False).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["analysis_key", "memoize_access_analysis", "memoized_kernels"]

# the module-level function torch's callers look up by name, per torch version
_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_SCALARS = (bool, int, float, str, type(None))

_lock = threading.Lock()
_kernels: set[int] = set()  # id() of the kernels the memo answers for (kept alive by their modules)
_memo: dict[tuple, Any] = {}


def memoized_kernels() -> frozenset[int]:
    """The ids of the kernels whose analysis is memoised (tests)."""
    return frozenset(_kernels)


def _tensor_like(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    from torch._inductor import ir  # imported by then: only inductor passes its boxes

    return isinstance(v, ir.TensorBox)


def analysis_key(kernel, kwargs: dict, tma_descriptor_metadata) -> tuple | None:
    """What torch generates the kernel's TTIR from, as a hashable key; None where a call carries an
    argument the key cannot describe (the call then goes to torch's analysis)."""
    if tma_descriptor_metadata:
        return None
    import sympy

    from .triton_common import triton

    parts = []
    for name in sorted(kwargs):
        v = kwargs[name]
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
            parts.append((name, "symbolic"))
        elif isinstance(v, _SCALARS):
            parts.append((name, type(v).__name__, v))
        elif _tensor_like(v):
            parts.append((name, "tensor", v.dtype))
        else:
            return None
    target = triton.runtime.driver.active.get_current_target()
    return (id(kernel), repr(target), tuple(parts))


def _memoizing(analyse: Callable) -> Callable:
    def analyse_once(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        key = analysis_key(kernel, kwargs, tma_descriptor_metadata) if id(kernel) in _kernels else None
        if key is None:
            return analyse(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        with _lock:
            if key not in _memo:
                _memo[key] = analyse(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
            return copy.deepcopy(_memo[key])

    analyse_once.memoizes = analyse
    return analyse_once


def memoize_access_analysis(kernel) -> bool:
    """Answer inductor's write analysis of `kernel` (a Triton JITFunction) from a memo from now on
    (idempotent). False where this torch has no analysis function by a known name."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    with _lock:
        for name in _ANALYSES:
            fn = getattr(wrap, name, None)
            if fn is None:
                continue
            if not hasattr(fn, "memoizes"):
                setattr(wrap, name, _memoizing(fn))
            _kernels.add(id(kernel))
            return True
    return False
