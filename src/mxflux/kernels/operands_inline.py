"""The MX operand packer as inductor launches it: `mx_operands_cuda_inline`, the body of the
`torch.library.triton_op` that compiled regions call instead of the opaque packer op
(docs/design.md, "The step without a captured graph: traced GEMMs and per-block CUDA graphs").

Why: the opaque op costs ~60 us of host time per call (dispatch into Python, the plan lookup,
allocations, launches), five calls per MX linear per step, and without a whole-step CUDA graph the
device waits for it (benchmarks/NOTES.md, "The host path"). Written with `torch.library.wrap_triton`
and traced, the same kernel with the same constexprs becomes a node of the compiled graph:
inductor allocates the outputs and launches the passes from its generated code, and nothing of
this module runs per call.

What it takes for the same bits as `mx_operands_cuda`:
- The same kernel and constexprs, the same grids (sized here, while tracing, as a plan sizes them
  on its first launch) and the same lane-pair check, done on stand-in tensors outside the trace.
- Inductor compiles user kernels with its own options (FMA contraction on, flush-to-zero
  libdevice, debug): for the prologue-free kernels the sm_90 code is the same instruction for
  instruction (tests/gpu/test_triton_compile.py checks it), so only "none" is inlined; the
  prologues (tanh-GELU, whose libdevice tanhf changes with flush-to-zero) keep the opaque op.
- The E4M3 outputs go to the kernel as they are (it casts their pointers to the int32 words it
  stores), so the graph has no views to make of them; every buffer the kernel accumulates into is
  its own zero tensor (a kernel argument that is a view of another would make the functionalised
  graph copy it).
- Inductor's mutation analysis reads the kernel's TTIR and finds exactly the outputs, the e_ref
  maxima and the counter written (checked on the CPU); were it to fail, it would assume every
  argument written and copy x each call. It runs once per kernel variant (`inductor_analysis`),
  not at every call site.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from ..mx.granularity import FoldGranularity
from .inductor_analysis import memoize_access_analysis
from .operands_cuda import _paired_stores_hold, _size_grids_per_pass, usable_erefs
from .operands_plan import LaunchPlan, counts_in_place, pack_io_mode
from .triton_common import HAS_TRITON, interpreting
from .weight_erefs import rows_and_columns

if HAS_TRITON:
    from .operands_cuda import _pack_kernel

__all__ = ["inline_packable", "mx_operands_cuda_inline"]

_F8 = torch.float8_e4m3fn


def inline_packable(x: torch.Tensor, counter: torch.Tensor, prologue: str) -> bool:
    """Whether `mx_operands_cuda_inline` takes this call: no prologue (see the module docstring) and
    a counter the kernels add into (`counts_in_place`)."""
    return prologue == "none" and counts_in_place(counter, x.device)


_TRACED_PLANS: dict[tuple, LaunchPlan] = {}


def _plan(x, counter, row, col, granularity, hadamard, colsum, erefs, hw) -> LaunchPlan:
    """The launch plan of a traced call, with its lane-pair check and per-pass grids settled on
    stand-in tensors (x may be a FakeTensor here; the compiles need real device pointers).
    Traced buffers are 16-byte aligned (inductor's own, and graph inputs it checks), as the
    stand-ins are, so the kernel is specialised the same way."""
    key = (tuple(x.shape), tuple(x.stride()), x.dtype, x.device, row, col, colsum, hadamard, granularity,
           erefs is not None, hw)
    plan = _TRACED_PLANS.get(key)
    if plan is not None:
        return plan
    plan = LaunchPlan(x, None, counter, row, col, granularity, hadamard, "e2m3", "none", colsum, hw, pack_io_mode(),
                      erefs)
    if plan.launch and hw and not interpreting():
        with torch._C._DisableTorchDispatch():
            dev = plan.device
            stand = {dt: torch.empty(64, dtype=dt, device=dev) for dt in (x.dtype, _F8, torch.int32, torch.float32,
                                                                        torch.int64)}
            f8, i32, f32 = stand[_F8], stand[torch.int32], stand[torch.float32]
            args = (stand[x.dtype], stand[x.dtype], plan.C, plan.C, plan.R, plan.C, plan.Rp, f8, f32, f8, f32, f32,
                    stand[torch.int64], i32, i32, plan.n_rt, plan.grid[1])
            plan.meta["PAIRS"] = _paired_stores_hold(plan, args)
            _size_grids_per_pass(plan, args)
    plan.pairs_checked = True
    _TRACED_PLANS[key] = plan
    return plan


def mx_operands_cuda_inline(
    x: torch.Tensor,
    blocks_outside_window: torch.Tensor,
    row: bool,
    col: bool,
    granularity: str,
    hadamard: bool,
    colsum: bool,
    erefs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mx_operands_cuda` without a prologue, written for tracing (the module docstring): the same
    five outputs as the `mxflux::mx_operands` op (empty fp32 tensors for what was not asked), the
    fold-window count added into `blocks_outside_window` (int64, one element, on x's device)."""
    if not HAS_TRITON:
        raise RuntimeError("mx_operands_cuda_inline: Triton is not installed")
    memoize_access_analysis(_pack_kernel)  # before inductor analyses the launches traced below
    g = FoldGranularity.from_mx_gemm(granularity)
    erefs = usable_erefs(x, g, erefs)
    hw = not interpreting()
    plan = _plan(x, blocks_outside_window, row, col, g, hadamard, colsum, erefs, hw)
    if plan.copy_x or (x.storage_offset() * x.element_size()) % 16:  # (a view not starting 16-byte aligned)
        x = x.clone(memory_format=torch.contiguous_format)
    R, C, Rp = plan.R, plan.C, plan.Rp
    i32, f32 = torch.int32, torch.float32

    def none():  # one per output: an op's outputs may not alias each other
        return x.new_empty(0, dtype=f32)

    row_data = x.new_empty((R, C), dtype=_F8) if row else none()
    row_scale = x.new_empty(plan.row_scale_shape, dtype=f32) if row else none()
    col_data = x.new_empty((C, Rp), dtype=_F8) if col else none()
    col_scale = x.new_empty(plan.col_scale_shape, dtype=f32) if col else none()
    sums = x.new_zeros(C, dtype=f32) if colsum else none()
    if plan.launch:
        unused = x.new_empty(4, dtype=i32)  # stands in for the pointers this call's kernels never touch
        if plan.given_erefs:
            row_eref, col_eref = rows_and_columns(erefs, R, C)
        else:
            row_eref = x.new_zeros(R, dtype=i32) if plan.rowwise and row else unused
            col_eref = x.new_zeros(C, dtype=i32) if plan.rowwise and col else unused
        # the plan's warps; its other compile options are inductor's to choose (the module docstring)
        warps = {"num_warps": plan.options["num_warps"]} if "num_warps" in plan.options else {}
        kernel = wrap_triton(_pack_kernel)  # (by this name: how triton_op finds the kernels it launches)
        for p in plan.passes:
            grid = plan.grids[p]
            kernel[grid](
                x, x, x.stride(0), x.stride(0), R, C, Rp,
                row_data if row else unused, row_scale if row else unused,
                col_data if col else unused, col_scale if col else unused,
                sums if colsum else unused, blocks_outside_window, row_eref, col_eref, plan.n_rt, grid[1],
                PASS=p, **plan.meta, **warps)
    return row_data, row_scale, col_data, col_scale, sums
