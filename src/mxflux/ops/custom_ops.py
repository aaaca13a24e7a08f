"""torch.library custom ops for the MX steps, with fake (meta) implementations, and the one place
that picks a backend for them (docs/design.md, "Kernels, backends and the reference").

Being opaque custom ops with fake impls is what lets `torch.compile` trace MX linears with no
graph breaks. They are defined with the low-level `torch.library.Library` API (a schema string
and one Python kernel for every backend) rather than the `custom_op` decorator: the decorator's
Python wrapper costs ~100 us of host time per call (measured with an empty body: 120 us vs
28 us), and a training step of Flux-12B makes thousands of these calls, so the step would be
host-bound (benchmarks/RESULTS.md). The ops are only ever called inside the autograd Functions
of `mxflux.nn.functional`, so they need no autograd formula of their own.

Backends, chosen per call from the input's device:

- CUDA: the Triton packer `mx_operands_cuda`, the cuBLAS GEMMs `scaled_gemm_cuda` and the
  saved-operand compaction kernels `compact_operand_cuda` / `expand_operand_cuda`;
- CPU: the compiled packer `mx_operands_cpu` and the GEMM `scaled_gemm_cpu` (numba
  dequantization, then the reference's fp32 matmul; both bit-identical), and the reference
  compaction (a few torch ops per tensor: no CPU kernel is needed);
- anything else, or numba missing: the pure-PyTorch references of `mxflux.mx`, which are also
  the definitions the kernels are tested against.

`MXFLUX_REFERENCE=1` in the environment forces the references everywhere (for A/B numerics
checks). It is read once, when this module is imported, into `FORCE_REFERENCE`.

Compiled, the row-granularity GEMM on CUDA is not this op but torch's `_scaled_mm` traced into the
graph (`scaled_gemm`): inductor then launches it from its generated code, as it launches a bf16
GEMM, instead of calling back into Python for each GEMM. The packer can be inlined likewise
(opt-in, `MXFLUX_INLINE_PACK=1`): compiled on CUDA, a call without a prologue is then the
`torch.library.triton_op` `mxflux::mx_operands_inline`, whose body (`kernels.operands_inline`)
inductor traces into a launch of the same Triton kernel from its own code while inductor launches
user kernels statically (`mx_operands`, `static_kernel_launch`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch

from ..kernels import (HAS_TRITON, compact_operand_cuda, cpu_kernel_available, expand_operand_cuda, mx_operands_cpu,
                       mx_operands_cuda_counted, scaled_gemm_cpu, scaled_gemm_cuda, scaled_gemm_cuda_traceable)
from ..kernels.gemm import DEFER_MIN_DIM, DEFER_MIN_TOKENS, DEFER_SCALES
from ..kernels.operands_cuda import mx_erefs_cuda, weight_exponents_cuda
from ..kernels.operands_inline import inline_packable, mx_operands_cuda_inline
from ..kernels.operands_onepass import mx_operands_onepass_cuda
from ..kernels.operands_plan import counts_in_place
from ..kernels.triton_common import interpreting
from ..kernels.weight_erefs import buffer_words as eref_buffer_words
from ..kernels.weight_erefs import rows_and_columns as eref_rows_and_columns
from ..mx.compact import compact_operand as compact_operand_reference
from ..mx.compact import compacted_shapes
from ..mx.compact import expand_operand as expand_operand_reference
from ..mx.granularity import FoldGranularity
from ..mx.operands import mx_operands_reference, padded_rows, rowwise_erefs_reference, transposed_operand
from ..mx.scaled_gemm import scaled_gemm_reference

__all__ = ["DEFER_MIN_DIM", "DEFER_MIN_TOKENS", "DEFER_SCALES", "FORCE_REFERENCE", "INLINE_GEMM", "INLINE_PACK", "compact_operand",
           "eref_buffer_words", "eref_rows_and_columns",
           "expand_operand", "frozen_weight_col", "mx_erefs", "mx_erefs_op", "mx_operands", "mx_operands_held",
           "mx_operands_inline", "mx_operands_op", "scaled_gemm",
           "scaled_gemm_op", "static_kernel_launch", "static_launch_on", "use_kernels", "weight_exponents",
           "weight_exponents_available"]

FORCE_REFERENCE = os.environ.get("MXFLUX_REFERENCE", "0") == "1"
# MXFLUX_INLINE_GEMM=0 keeps compiled regions on the opaque GEMM op (A/B runs of host time; the
# numerics are the same either way). Read once, at import.
INLINE_GEMM = os.environ.get("MXFLUX_INLINE_GEMM", "1") != "0"
# MXFLUX_INLINE_PACK=1 traces the packers into compiled regions as `mx_operands_inline` (the same
# bits either way). Off by default: with it the 6+12-block model did not finish compiling in the time
# the opaque op compiled and ran it, inductor converting the packer kernel to TTIR at every call site
# (benchmarks/NOTES.md); that analysis is now done once per kernel variant
# (`kernels.inductor_analysis`: its traced GPU tests pass, tests/gpu/test_operands_inline.py), but what that
# does to the deep model's compile time is not measured.
INLINE_PACK = os.environ.get("MXFLUX_INLINE_PACK", "0") == "1"

_EMPTY_DTYPE = torch.float32


def use_kernels(t: torch.Tensor) -> bool:
    """Fast kernels run on CUDA unless the reference is forced."""
    return t.is_cuda and not FORCE_REFERENCE


def weight_exponents_available(t: torch.Tensor) -> bool:
    """Whether the kernels that keep a weight's e_ref and operands between steps run for `t`: Triton
    on CUDA (or its CPU interpreter, in tests), and the reference not forced (it has no such state:
    its packer always reads the weight itself)."""
    return HAS_TRITON and (t.is_cuda or interpreting()) and not FORCE_REFERENCE


def weight_exponents(x: torch.Tensor, hadamard: bool, out: torch.Tensor) -> torch.Tensor:
    """The row granularity's pass 1 alone: the fp32 weight x's per-row and per-column e_ref into
    `out` (int32 [kernels.weight_erefs.buffer_words(R, C)], overwritten), what `mx_operands` takes as
    `erefs` (`weight_exponents_available(x)` must hold)."""
    return weight_exponents_cuda(x, hadamard, out)


def _cpu_kernels(t: torch.Tensor) -> bool:
    """The compiled CPU kernels run on CPU tensors where numba is present, unless the reference
    is forced."""
    return t.device.type == "cpu" and cpu_kernel_available() and not FORCE_REFERENCE


def _empty(device) -> torch.Tensor:
    return torch.empty(0, dtype=_EMPTY_DTYPE, device=device)


_LIB = torch.library.Library("mxflux", "DEF")  # kept alive for the process: it owns the registrations
_LIB.define("mx_operands(Tensor x, Tensor? aux, Tensor(a!) blocks_outside_window, bool row, bool col, "
            "str granularity, bool hadamard, str prologue, bool colsum, Tensor? erefs=None) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("scaled_gemm(Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, str granularity, "
            "Tensor? bias, ScalarType out_dtype) -> Tensor")
_LIB.define("mx_erefs(Tensor x, bool hadamard) -> Tensor")
_LIB.define("mx_operands_held(Tensor x, Tensor(a!) held, Tensor(b!) blocks_outside_window, int headroom, "
            "bool hadamard, bool colsum) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("compact_operand(Tensor data) -> (Tensor, Tensor)")
_LIB.define("expand_operand(Tensor packed, Tensor shifts) -> Tensor")
_LIB.define("frozen_weight_col(Tensor row_data, Tensor row_scale, Tensor column_scale, str granularity) -> (Tensor, Tensor)")


def _register(name: str, kernel, fake):
    """One Python kernel for every backend (it dispatches on the device itself), and the fake."""
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"mxflux::{name}", fake, lib=_LIB)
    return getattr(torch.ops.mxflux, name)


def _mx_operands(
    x: torch.Tensor,
    aux: torch.Tensor | None,
    blocks_outside_window: torch.Tensor,
    row: bool,
    col: bool,
    granularity: str,
    hadamard: bool,
    prologue: str,
    colsum: bool,
    erefs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate, quantize to E2M3 and fold a 2-D tensor into FP8 GEMM operands
    (`mxflux.mx.operands`). x is bf16, or fp32 (master weights), which is packed as its bf16
    rounding, x.to(torch.bfloat16), without that cast as a separate pass. `granularity` is a
    `FoldGranularity` value ("rowwise", "blockwise", "exact"). Blocks outside the fold window are
    added to `blocks_outside_window` (int64, one element) on the device: no host sync. Unrequested
    outputs are empty. `erefs`: x's current row-granularity e_ref (`mx_erefs`' layout; a weight's from
    the optimizer step, `mxflux.nn.weight_state`, or an activation's from `mx_erefs`), vouched for by
    the caller, with which the kernels skip their first pass; the other backends compute their own
    (the same values).
    """
    g = FoldGranularity.from_mx_gemm(granularity)
    if use_kernels(x):  # the kernels add into the counter themselves (no launch for the add)
        p = mx_operands_cuda_counted(x, aux, blocks_outside_window, row, col, g, hadamard, prologue, colsum, erefs)
    else:
        if x.dtype == torch.float32:  # the CUDA kernels round fp32 to bf16 as they read it
            x = x.to(torch.bfloat16)
        if _cpu_kernels(x):
            pack = mx_operands_cpu
        else:
            pack = mx_operands_reference
        p = pack(x, row=row, col=col, granularity=g, hadamard=hadamard, prologue=prologue, aux=aux, colsum=colsum)
        blocks_outside_window.add_(p.blocks_outside_window.reshape(blocks_outside_window.shape))
    rd, rs, cd, cs, sums = p[:5]
    if rd is not None and cd is not None and sums is not None:
        return rd, rs, cd, cs, sums
    dev = x.device
    return (_empty(dev) if rd is None else rd, _empty(dev) if rs is None else rs, _empty(dev) if cd is None else cd,
            _empty(dev) if cs is None else cs, _empty(dev) if sums is None else sums)


def _mx_operands_fake(x, aux, blocks_outside_window, row, col, granularity, hadamard, prologue, colsum, erefs=None):
    g = FoldGranularity.from_mx_gemm(granularity)
    r, c = x.shape
    rp = padded_rows(r, g)
    e = x.new_empty(0, dtype=_EMPTY_DTYPE)
    fp8 = torch.float8_e4m3fn
    return (
        x.new_empty(r, c, dtype=fp8) if row else e.clone(),
        x.new_empty(r, g.groups(c), dtype=torch.float32) if row else e.clone(),
        x.new_empty(c, rp, dtype=fp8) if col else e.clone(),
        x.new_empty(c, g.groups(rp), dtype=torch.float32) if col else e.clone(),
        x.new_empty(c, dtype=torch.float32) if colsum else e.clone(),
    )


mx_operands_op = _register("mx_operands", _mx_operands, _mx_operands_fake)


def _mx_erefs(x: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """The row granularity's first pass alone: the e_ref of x's rows and of its columns (int32
    [eref_buffer_words(R, C)], `kernels.weight_erefs`' layout: e + 128 where a line has a live block, 0
    where it has none), which `mx_operands` takes as `erefs` to pack either orientation with its
    second pass only. x as `mx_operands` takes it (bf16, or fp32 packed as its bf16 rounding)."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    if use_kernels(x):
        return mx_erefs_cuda(x, hadamard)
    r, c = x.shape
    out = torch.empty(eref_buffer_words(r, c), dtype=torch.int32, device=x.device)
    rows, cols = rowwise_erefs_reference(x.to(torch.bfloat16) if x.dtype == torch.float32 else x, hadamard=hadamard)
    row_part, col_part = eref_rows_and_columns(out, r, c)
    row_part.zero_()[:r].copy_(rows)
    col_part.copy_(cols)
    return out


def _mx_erefs_fake(x, hadamard):
    return x.new_empty(eref_buffer_words(*x.shape), dtype=torch.int32)


mx_erefs_op = _register("mx_erefs", _mx_erefs, _mx_erefs_fake)


def mx_erefs(x: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """The opaque op `torch.ops.mxflux.mx_erefs` (`_mx_erefs`' contract)."""
    return mx_erefs_op(x, hadamard)


def _mx_operands_held(x: torch.Tensor, held: torch.Tensor, blocks_outside_window: torch.Tensor, headroom: int,
                      hadamard: bool, colsum: bool) -> tuple[torch.Tensor, ...]:
    """Both row-granularity operands of x (bf16 [R, C], no prologue), its columns' fold windows
    placed at the predicted e_ref `held` (int32 [C], e_ref + 128 per column or 0 for none) raised by
    `headroom` binades wherever that holds the column (`mx_operands_reference(..., col_held=,
    col_headroom=)`), and x's own column maxima then written into `held`: the next call's prediction.
    On CUDA one read of x (`mx_operands_onepass_cuda`); elsewhere the reference. Outputs as
    `mx_operands`' (row and col always; colsum empty unless asked); blocks outside the window added
    to `blocks_outside_window`."""
    if use_kernels(x):
        direct = counts_in_place(blocks_outside_window, x.device)  # (else added below)
        p, new, _ = mx_operands_onepass_cuda(x, held, headroom=headroom, hadamard=hadamard, colsum=colsum,
                                             counter=blocks_outside_window if direct else None)
        if not direct:
            blocks_outside_window.add_(p.blocks_outside_window.reshape(blocks_outside_window.shape))
    else:
        p = mx_operands_reference(x, hadamard=hadamard, colsum=colsum, col_held=held, col_headroom=headroom)
        new = rowwise_erefs_reference(x, hadamard=hadamard)[1]
        blocks_outside_window.add_(p.blocks_outside_window.reshape(blocks_outside_window.shape))
    held.copy_(new)
    return p.row_data, p.row_scale, p.col_data, p.col_scale, _empty(x.device) if p.colsum is None else p.colsum


def _mx_operands_held_fake(x, held, blocks_outside_window, headroom, hadamard, colsum):
    r, c = x.shape
    rp = padded_rows(r)
    fp8 = torch.float8_e4m3fn
    return (x.new_empty(r, c, dtype=fp8), x.new_empty(r, 1, dtype=torch.float32), x.new_empty(c, rp, dtype=fp8),
            x.new_empty(c, 1, dtype=torch.float32),
            x.new_empty(c, dtype=torch.float32) if colsum else x.new_empty(0, dtype=_EMPTY_DTYPE))


mx_operands_held = _register("mx_operands_held", _mx_operands_held, _mx_operands_held_fake)


# `mxflux::mx_operands` without a prologue, for compiled regions on CUDA: traced, its body
# (`kernels.operands_inline`) becomes inductor's own launches of the packer kernel; same outputs, same
# bits. (triton_op reads the body's source for the kernels it launches and warns where Triton is
# missing, as on a CPU-only machine, where this op never runs: that warning is silenced.)
_triton_op_log = logging.getLogger("torch._library.triton")
_level = _triton_op_log.level
_triton_op_log.setLevel(logging.ERROR)
try:
    mx_operands_inline = torch.library.triton_op("mxflux::mx_operands_inline", mx_operands_cuda_inline,
                                                 mutates_args={"blocks_outside_window"})
finally:
    _triton_op_log.setLevel(_level)


# inductor's switch for launching user-defined Triton kernels (the inlined packers) with its static CUDA
# launcher, as it launches its own; off by default in torch 2.11 and 2.13
_STATIC_LAUNCH = "static_launch_user_defined_triton_kernels"


def static_kernel_launch(on: bool = True) -> bool:
    """Turn inductor's static launch of user-defined Triton kernels on (or off) for this process;
    False where this torch has no such switch. Compiled regions inline the packers only while it is
    on: on Triton's own Python launcher an inlined packer call can cost more host time than the
    opaque op (benchmarks/NOTES.md, "Host time per compiled linear, and per op call"). The
    trainer turns it on before compiling; a user who compiles MX layers themselves calls this."""
    from torch._inductor import config

    if not hasattr(config, _STATIC_LAUNCH):
        return False
    setattr(config, _STATIC_LAUNCH, bool(on))
    return True


@torch.compiler.assume_constant_result
def static_launch_on() -> bool:
    """Whether inductor launches user-defined kernels statically in this process (read while tracing,
    as a constant; inductor's config is loaded by then, and a process that never loaded it has it off)."""
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(config, _STATIC_LAUNCH, False))


def mx_operands(x, aux, blocks_outside_window, row: bool, col: bool, granularity: str, hadamard: bool,
                prologue: str, colsum: bool, erefs=None, *, inline: bool = True):
    """The MX packer (`_mx_operands`' contract): the opaque op `torch.ops.mxflux.mx_operands`. With
    `INLINE_PACK` on and being traced by torch.compile on CUDA, a call without a prologue is
    `mx_operands_inline`, which inductor launches from its generated code, while inductor launches
    such kernels statically (`static_kernel_launch`); every eager call and any call with `inline`
    False (a packer call a selective-recompute policy must see as this op: `nn.recompute`) stays the
    opaque op."""
    if (inline and INLINE_PACK and torch.compiler.is_compiling() and use_kernels(x)
            and inline_packable(x, blocks_outside_window, prologue) and static_launch_on()):
        return mx_operands_inline(x, blocks_outside_window, row, col, granularity, hadamard, colsum, erefs)
    return mx_operands_op(x, aux, blocks_outside_window, row, col, granularity, hadamard, prologue, colsum, erefs)


def _scaled_gemm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    granularity: str,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(A ⊙ scale_a)(B ⊙ scale_b)ᵀ + bias with fp32 accumulation and one rounding
    (`mxflux.mx.scaled_gemm`), for operands folded at `granularity` (a `FoldGranularity` value)."""
    if use_kernels(a_data):
        return scaled_gemm_cuda(a_data, a_scale, b_data, b_scale, FoldGranularity.from_mx_gemm(granularity),
                                bias, out_dtype)
    if _cpu_kernels(a_data):
        return scaled_gemm_cpu(a_data, a_scale, b_data, b_scale, bias, out_dtype)
    return scaled_gemm_reference(a_data, a_scale, b_data, b_scale, bias, out_dtype)


def _scaled_gemm_fake(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype):
    return a_data.new_empty(a_data.shape[0], b_data.shape[0], dtype=out_dtype)


scaled_gemm_op = _register("scaled_gemm", _scaled_gemm, _scaled_gemm_fake)


def scaled_gemm(a_data, a_scale, b_data, b_scale, granularity: str, bias, out_dtype) -> torch.Tensor:
    """The MX GEMM (`_scaled_gemm`'s contract). Being traced by torch.compile on CUDA, the row
    granularity's GEMM goes into the graph as torch's own row-scaled FP8 GEMM
    (`scaled_gemm_cuda_traceable`: the same cuBLAS call, so the same bits), which inductor
    launches from its generated code at a plain GEMM's host cost (a large bias-free GEMM as the
    unit-scaled one with its scales applied by the next op: `kernels.gemm.deferred_scale_gemm`, the
    same bits); everything else, and every eager call, is the opaque op
    `torch.ops.mxflux.scaled_gemm` (`INLINE_GEMM` off: always)."""
    if INLINE_GEMM and torch.compiler.is_compiling() and use_kernels(a_data):
        out = scaled_gemm_cuda_traceable(a_data, a_scale, b_data, b_scale, FoldGranularity.from_mx_gemm(granularity),
                                         bias, out_dtype)
        if out is not None:
            return out
    return scaled_gemm_op(a_data, a_scale, b_data, b_scale, granularity, bias, out_dtype)


def _compact_operand(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A folded E4M3 col operand [C, Rp] as 6-bit E2M3 codes [C, 3Rp/4] plus one shift byte per block
    [C, Rp/32] (`mxflux.mx.compact`; docs/design.md, "Saved operands in six bits")."""
    if use_kernels(data):
        return compact_operand_cuda(data)
    return compact_operand_reference(data)


def _compact_operand_fake(data):
    pshape, sshape = compacted_shapes(*data.shape)
    return data.new_empty(pshape, dtype=torch.uint8), data.new_empty(sshape, dtype=torch.uint8)


compact_operand = _register("compact_operand", _compact_operand, _compact_operand_fake)


def _expand_operand(packed: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Inverse of `compact_operand`: the E4M3 operand [C, Rp] again, byte for byte."""
    if use_kernels(packed):
        return expand_operand_cuda(packed, shifts)
    return expand_operand_reference(packed, shifts)


def _expand_operand_fake(packed, shifts):
    return packed.new_empty(shifts.shape[0], 32 * shifts.shape[1], dtype=torch.float8_e4m3fn)


expand_operand = _register("expand_operand", _expand_operand, _expand_operand_fake)


def _frozen_weight_col(row_data: torch.Tensor, row_scale: torch.Tensor, column_scale: torch.Tensor,
                       granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Wᵀ's operand for dgrad (col data [K, Np], col scale) of a frozen weight kept only as its fprop
    operand (row data [N, K], row scale) and its power-of-two scale per column (fp32 [K],
    `mx.operands.transposed_column_scale`): the same values re-scaled per column, not quantized
    again (`mx.operands.transposed_operand`; docs/design.md, "LoRA on a frozen MXFP6 base").
    Opaque, so that compiled backward graphs run it as a unit; a weight-sized pass of one byte in,
    one out."""
    g = FoldGranularity.from_mx_gemm(granularity)
    if use_kernels(row_data):  # inductor's kernels for the same exact steps: the same bits
        return _transposed_operand_compiled()(row_data, row_scale, g, column_scale)
    return transposed_operand(row_data, row_scale, g, column_scale)


@functools.cache
def _transposed_operand_compiled():
    return torch.compile(transposed_operand, dynamic=False)


def _frozen_weight_col_fake(row_data, row_scale, column_scale, granularity):
    g = FoldGranularity.from_mx_gemm(granularity)
    n, k = row_data.shape
    np_ = padded_rows(n, g)
    return (row_data.new_empty(k, np_, dtype=torch.float8_e4m3fn),
            row_data.new_empty(k, g.groups(np_), dtype=torch.float32))


frozen_weight_col = _register("frozen_weight_col", _frozen_weight_col, _frozen_weight_col_fake)
