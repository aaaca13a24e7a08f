"""Weights' row-granularity reference exponents, kept from the optimizer step to the next forward.

The row granularity packs a tensor in two passes: pass 1 reads it only to find, per row and per
column, the largest block exponent e_ref; pass 2 encodes (`operands_cuda`). For a weight, pass 1
reads 4 bytes per element (fp32 master weights) for a result of a few words per row and column,
and it is the optimizer that last wrote those elements. So the AdamW kernel computes the e_ref of
the weights it has just updated (`mxflux.train.adamw_cuda`) into buffers registered here, and the
packer, handed such a weight, finds them here and runs pass 2 only (bit for bit the same operands:
the same code computes the maxima from the same bf16 rounding of the same values).

What keeps a buffer honest is the parameter's autograd version counter. Every in-place write
through torch (an optimizer of torch's, `copy_` from a checkpoint, an EMA swap, `load_state_dict`)
bumps it; the Triton AdamW, which writes parameters behind torch's back, records the version it
leaves (`mark_current`). A buffer is used only while the weight's version is the one recorded,
so any other write sends the packer back to its own pass 1. Writes through `.data` are the one
kind torch does not count: they are not seen (`optim.weight_exponents_in_optimizer: false` turns
the whole mechanism off).

Buffer layout, as the packer's workspace holds them: int32 words, the rows' e_ref first (R words,
padded to a multiple of 4), then the columns' (C words); e + 128 for a row or column with a live
block, 0 where it has none.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

__all__ = ["buffer_words", "clear", "current_erefs", "is_current", "mark_current", "track"]


class _Entry(NamedTuple):
    param: weakref.ref
    shape: torch.Size
    stride: tuple
    hadamard: bool
    erefs: torch.Tensor
    version: list  # [recorded version or None]: mutable in place


_ENTRIES: dict[int, _Entry] = {}  # a weight's data_ptr -> its entry (a live weight owns its address)


def buffer_words(rows: int, cols: int) -> int:
    """int32 words of one weight's buffer: rows padded to 4 (16-byte aligned column part), then columns."""
    return -(-rows // 4) * 4 + cols


def track(param: torch.Tensor, hadamard: bool, erefs: torch.Tensor) -> None:
    """Register `param` (2-D, contiguous) with its buffer `erefs` (int32 [buffer_words(R, C)] on its
    device); not current until `mark_current`."""
    if param.dim() != 2 or not param.is_contiguous():
        raise ValueError(f"param: expected a contiguous 2-D weight, got shape {tuple(param.shape)} "
                         f"strides {param.stride()}")
    want = buffer_words(*param.shape)
    if erefs.dtype != torch.int32 or erefs.shape != (want,) or erefs.device != param.device:
        raise ValueError(f"erefs: expected int32 [{want}] on {param.device}, got {erefs.dtype} "
                         f"{tuple(erefs.shape)} on {erefs.device}")
    _ENTRIES[param.data_ptr()] = _Entry(weakref.ref(param), param.shape, param.stride(), bool(hadamard), erefs,
                                        [None])


def _entry(x: torch.Tensor) -> _Entry | None:
    e = _ENTRIES.get(x.data_ptr())
    if e is None:
        return None
    p = e.param()
    if p is None or p.data_ptr() != x.data_ptr():  # the weight is gone, or its storage was replaced
        del _ENTRIES[x.data_ptr()]
        return None
    return e


def mark_current(param: torch.Tensor) -> None:
    """The buffer of `param` now holds the e_ref of its values (queued on the device before any
    later use): record the version the parameter has."""
    e = _entry(param)
    if e is not None:
        e.version[0] = param._version


def is_current(param: torch.Tensor) -> bool:
    e = _entry(param)
    return e is not None and e.version[0] is not None and param._version == e.version[0]


def current_erefs(x: torch.Tensor, hadamard: bool) -> torch.Tensor | None:
    """The buffer of the weight `x` is (or aliases exactly: same address, shape and strides, and so
    the same version counter) when it holds the e_ref of x's current values under `hadamard`;
    None otherwise. The packer's per-call host path: a dictionary lookup and a few comparisons."""
    e = _entry(x)
    if e is None or e.version[0] is None or e.hadamard != hadamard or x.shape != e.shape or x.stride() != e.stride:
        return None
    try:
        if x._version != e.version[0] or e.param()._version != e.version[0]:
            return None
    except RuntimeError:  # an inference tensor has no version counter
        return None
    return e.erefs


def clear() -> None:
    """Forget every registered weight (tests)."""
    _ENTRIES.clear()
