"""The launch plans of the MX operand packers (`operands_cuda`): everything about a packer call
that depends only on its arguments' shapes, strides, dtypes, devices, alignment and flags, worked
out once and cached (validation, geometry, output shapes, the workspace layout, the grid and the
kernel's compile-time constants). A training step repeats the same few hundred calls, and host
time per call is what bounds a large model at small micro-batches (benchmarks/NOTES.md, "The host
path").

Host code only: it never touches the kernel, so it imports (and its tests run) without Triton. The
steps that need the compiled kernel (the lane-pair check, per-pass grid sizing, the compiled
launchers) are `operands_cuda`'s.
"""

from __future__ import annotations

import os

import torch

from ..mx.constants import MX_BLOCK
from ..mx.granularity import FoldGranularity
from ..mx.operands import PROLOGUES, padded_rows
from .triton_common import HAS_TRITON, PROLOGUE_IDS, interpreting, launch_options, num_sms
from .weight_erefs import buffer_words

__all__ = ["RUNTIME_ARGS", "LaunchPlan", "cached_plan", "check_input", "clear_launch_plans", "coalesced_loads",
           "counts_in_place",
           "kernel_constexprs", "kernel_num_warps", "pack_io_mode", "persistent_row_programs", "plan_key",
           "resident_programs"]

_BR = 128  # rows per tile (4 column blocks: one 1x128 group of the column orientation)
# (blocks along C per tile, warps): one row block and one column block per thread in both.
# 1x128 groups need 4 blocks along C in the tile; the others take half as wide a tile so that
# two CTAs fit on an SM.
_TILE = {FoldGranularity.ROWWISE: (2, 8), FoldGranularity.EXACT: (2, 8), FoldGranularity.BLOCKWISE: (4, 16)}



def counts_in_place(counter: torch.Tensor | None, device: torch.device) -> bool:
    """Whether the kernels add their fold-window count straight into `counter`: one int64 element
    on the packed tensor's device."""
    return (counter is not None and counter.dtype == torch.int64 and counter.numel() == 1
            and counter.device == device)


def check_input(x: torch.Tensor, name: str, dtypes=(torch.bfloat16,)) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: mx_operands_cuda reads {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if not (x.is_cuda or interpreting()):
        raise ValueError(f"{name}: mx_operands_cuda needs a CUDA tensor, got device {x.device}")


def _grid(n_col_tiles: int, n_row_tiles: int, device: torch.device, warps: int) -> tuple[int, int]:
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return (n_col_tiles, persistent_row_programs(n_col_tiles, n_row_tiles, (2 if warps <= 8 else 1) * sms))


def persistent_row_programs(n_col_tiles: int, n_row_tiles: int, resident: int, max_waves: int = 4) -> int:
    """Programs per column strip, p: each walks every p-th row tile of its strip (prefetching the
    next one). All programs do about the same work, so a launch lasts about (waves of `resident`
    programs) x (row tiles of the busiest program); this picks the p that minimises that product,
    the smallest such p (fewer, longer programs keep the prefetch pipeline full), among grids of at
    least one full wave (a partial single wave leaves SMs half used all along: pass 1 of
    [32768 x 15360] on 240 programs was 12 % slower than on 720) and at most `max_waves` waves. A fixed ~2 waves
    left a partial wave at the end of wide tensors: [16384 x 12288] ran 576 programs on 264 slots
    (3 waves, the last a fifth full) in 204 + 351 µs (pass 1 + 2), 4 programs per strip run 768 in
    3 full waves of 32 tiles each in 183 + 319 µs (benchmarks/RESULTS.md)."""
    best_cost, best_p = None, 1
    p_min = min(n_row_tiles, -(-resident // n_col_tiles))
    p_max = max(p_min, min(n_row_tiles, -(-max_waves * resident // n_col_tiles)))
    for p in range(p_min, p_max + 1):
        cost = -(-n_col_tiles * p // resident) * -(-n_row_tiles // p)
        if best_cost is None or cost < best_cost:
            best_cost, best_p = cost, p
    return best_p


def resident_programs(n_regs: int, num_warps: int, shared_bytes: int, *, regs_per_sm: int = 65536,
                      threads_per_sm: int = 2048, shared_per_sm: int = 233472, programs_per_sm: int = 32) -> int:
    """Programs of a compiled kernel one SM holds at once (Hopper's limits by default): registers are
    allocated per warp in units of 256 (8 per thread), each program reserves 1 KB of shared memory
    besides its own. The passes differ (Triton 3.6: 80 registers for pass 1, 2 x 8 warps fit 3
    programs; ~126 for pass 2, 2 programs), so each pass gets its own grid."""
    regs = -(-max(n_regs, 1) // 8) * 8 * 32 * num_warps
    fit = min(regs_per_sm // regs, threads_per_sm // (32 * num_warps), programs_per_sm)
    if shared_bytes > 0:
        fit = min(fit, shared_per_sm // (shared_bytes + 1024))
    return max(1, fit)


def coalesced_loads(prologue: str, mode: str | None = None) -> bool:
    """How tiles are read. "coalesced": [128, 64] bf16 tile loads, re-laid out once through
    shared memory into whole-blocks-per-thread (8-12 % faster measured without a prologue);
    "blocks": each thread loads its own blocks' 16-byte quarters (faster with a prologue, whose
    col-orientation rebuild adds layout conversions to the coalesced variant). MXFLUX_PACK_IO
    (auto | coalesced | blocks) overrides the choice for A/B runs; both are tested. `mode`: that
    setting as already read."""
    mode = pack_io_mode() if mode is None else mode
    if mode not in ("auto", "coalesced", "blocks"):
        raise ValueError(f"MXFLUX_PACK_IO: expected auto, coalesced or blocks, got {mode!r}")
    return mode == "coalesced" or (mode == "auto" and prologue == "none")


def pack_io_mode() -> str:
    """MXFLUX_PACK_IO as `coalesced_loads` reads it, per call but without `os.environ.get`'s key
    encoding (a measurable part of a call's host time): the environment mapping's own store."""
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None or type(env) is not _ENV_TYPE:
        return env.get("MXFLUX_PACK_IO", "auto")
    v = data.get(_PACK_IO_KEY)
    return "auto" if v is None else env.decodevalue(v)


_ENV_TYPE = type(os.environ)
try:
    _PACK_IO_KEY = os.environ.encodekey("MXFLUX_PACK_IO")
except AttributeError:  # not CPython's os._Environ: the plain lookup above
    _ENV_TYPE = None


def kernel_constexprs(granularity: FoldGranularity, prologue: str, io_mode: str | None = None,
                      x_f32: bool = False) -> dict:
    """The compile-time constants a launch for this granularity, prologue and input dtype uses
    (besides the per-call flags): what the ahead-of-time compile tests build. PAIRS (lane-pair
    block stores) is where every plan starts; `_paired_stores_hold` may turn it off."""
    nb, _ = _TILE[granularity]
    return dict(GRAN=granularity.kernel_id, PROLOGUE=PROLOGUE_IDS[prologue], BR=_BR, NB=nb,
                COAL=coalesced_loads(prologue, io_mode), X_F32=x_f32, PAIRS=True)


def kernel_num_warps(granularity: FoldGranularity) -> int:
    return _TILE[granularity][1]


# The runtime parameters of _pack_kernel, in order (the constexprs follow them).
RUNTIME_ARGS = ("x_ptr", "aux_ptr", "stride_x", "stride_aux", "R", "C", "Rp", "row_data_ptr", "row_scale_ptr",
                 "col_data_ptr", "col_scale_ptr", "colsum_ptr", "outside_ptr", "row_eref_ptr", "col_eref_ptr",
                 "n_row_tiles", "n_prog_r")


class LaunchPlan:
    """Everything about a packer call that depends only on its key (`plan_key`): validated once,
    geometry, output shapes, the zero-filled workspace's layout, grid and constexprs computed once.
    A training step repeats the same few hundred calls, and host time per call is what bounds a
    large model at small micro-batches (benchmarks/NOTES.md, "The host path").

    The workspace (int32 words, zero-filled only when some part is there) holds, each part on a
    16-byte boundary: the outside-window count (int64; only without a caller's counter), the column
    sums (fp32 [C]; only with colsum), and for ROWWISE the per-row and per-column e_ref (int32
    [R] and [C]; e + 128 for a live block, 0 where none was seen).

    `launches` holds, per kernel pass, the `CompiledLaunch` built after that pass's first normal
    launch under this plan (None until then, or for good where unavailable)."""

    __slots__ = ("R", "C", "Rp", "row", "col", "colsum", "hw", "rowwise", "given_erefs", "direct_counter",
                 "row_scale_shape",
                 "col_scale_shape", "ws_len", "ws_zero", "off_outside", "off_sums", "off_row_eref", "off_col_eref",
                 "copy_x", "copy_aux", "launch", "grid", "n_rt", "passes", "meta", "options", "device", "launches",
                 "fast", "pairs_checked", "grids")

    def __init__(self, x, aux, counter, row, col, granularity, hadamard, fmt, prologue, colsum, hw, io_mode,
                 erefs=None):
        if not HAS_TRITON:
            raise RuntimeError("mx_operands_cuda: Triton is not installed; use mx_operands_reference on this machine")
        if not (torch.cuda.is_available() or interpreting()):
            raise RuntimeError("mx_operands_cuda: no CUDA device; use mx_operands_reference on this machine")
        # fp32 x (master weights) is rounded to bf16 in the kernel as it is read: the same operands
        # as packing x.to(torch.bfloat16), without a cast kernel and a bf16 copy of the weights
        check_input(x, "x", (torch.bfloat16, torch.float32) if prologue == "none" else (torch.bfloat16,))
        if fmt != "e2m3":
            raise ValueError(f"fmt: mx_operands_cuda has kernels for 'e2m3' only, got {fmt!r}")
        if not isinstance(granularity, FoldGranularity):
            raise ValueError(f"granularity: expected a FoldGranularity, got {granularity!r}")
        if prologue not in PROLOGUES:
            raise ValueError(f"prologue: expected one of {PROLOGUES}, got {prologue!r}")
        if prologue == "gelu_tanh_grad":
            if aux is None:
                raise ValueError(f"aux: the gelu_tanh_grad prologue needs the pre-activation, shape {tuple(x.shape)}")
            check_input(aux, "aux")
            if aux.shape != x.shape or aux.device != x.device:
                raise ValueError(f"aux: expected shape {tuple(x.shape)} on {x.device}, got {tuple(aux.shape)} on "
                                 f"{aux.device}")
        for name, flag in (("row", row), ("col", col), ("hadamard", hadamard), ("colsum", colsum)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {flag!r}")
        R, C = x.shape
        if C % MX_BLOCK:
            raise ValueError(f"x: {C} columns is not a multiple of the block size {MX_BLOCK}")
        if row and C % granularity.row_multiple:
            raise ValueError(f"granularity: {granularity.value} needs the row length to be a multiple of "
                             f"{granularity.row_multiple}, got C={C}")
        dev = x.device
        # the kernels add into the caller's counter when it is one int64 element on x's device
        # (one launch less per call than adding this call's count afterwards)
        self.direct_counter = counts_in_place(counter, dev)
        self.R, self.C, self.row, self.col, self.colsum, self.hw = R, C, row, col, colsum, hw
        self.Rp = Rp = padded_rows(R, granularity)  # whole blocks, and whole 1x128 groups for BLOCKWISE
        self.rowwise = rowwise = granularity is FoldGranularity.ROWWISE
        self.row_scale_shape = (R, granularity.groups(C))
        self.col_scale_shape = (C, granularity.groups(Rp))
        self.launch = R > 0 and (row or col or colsum)
        # ROWWISE with the e_ref given (a weight's, from the optimizer step: `weight_erefs`): pass 2 only
        self.given_erefs = rowwise and erefs is not None
        if self.given_erefs:
            want = buffer_words(R, C)
            if erefs.dtype != torch.int32 or erefs.shape != (want,) or erefs.device != x.device:
                raise ValueError(f"erefs: expected int32 [{want}] on {x.device}, got {erefs.dtype} "
                                 f"{tuple(erefs.shape)} on {erefs.device}")
        words = 0
        self.off_outside = self.off_sums = self.off_row_eref = self.off_col_eref = None
        if not self.direct_counter:
            self.off_outside, words = words, words + 4
        if colsum:
            self.off_sums, words = words, words + C  # C is a multiple of 32: the next part stays aligned
        if rowwise and row and not self.given_erefs:
            self.off_row_eref, words = words, words + -(-R // 4) * 4
        if rowwise and col and not self.given_erefs:
            self.off_col_eref, words = words, words + C
        self.ws_zero = words > 0  # every part present is read before it is written (or returned)
        self.ws_len = max(words, 4)
        # The kernels read 16-byte pieces of rows: contiguous along C, rows 16-byte aligned. Else
        # they read a contiguous copy (x's address is part of the key; a fresh copy is aligned).
        self.copy_x = x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 != 0
        self.copy_aux = prologue == "gelu_tanh_grad" and (aux.stride(1) != 1 or aux.stride(0) % 8 != 0)
        nb, warps = _TILE[granularity]
        self.n_rt = -(-Rp // _BR)
        self.grid = _grid(-(-C // (nb * MX_BLOCK)), self.n_rt, dev, warps)
        self.passes = (1, 2) if rowwise and (row or col) and not self.given_erefs else (2,)
        # per pass: sized for the pass's own occupancy once its compiled kernel is known (first launch)
        self.grids = dict.fromkeys(self.passes, self.grid)
        self.meta = dict(DO_ROW=row, DO_COL=col, DO_COLSUM=colsum, HADAMARD=hadamard, HW=hw,
                         **kernel_constexprs(granularity, prologue, io_mode, x.dtype == torch.float32))
        self.pairs_checked = False  # PAIRS confirmed (or turned off) on the compiled kernel: `_paired_stores_hold`
        self.options = launch_options(warps)
        self.device = dev
        self.launches = dict.fromkeys(self.passes)
        self.fast = None  # the CompiledLaunch of every pass once built; False where none could be


_PLANS: dict[tuple, LaunchPlan] = {}
_MAX_PLANS = 4096  # far more than the distinct calls of a training step; cleared whole when reached


def clear_launch_plans() -> None:
    """Forget every launch plan (tests; benchmarks that stub the kernels)."""
    _PLANS.clear()


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a plan depends on in a tensor argument: shape, strides, dtype, device and whether its
    address is 16-byte aligned (the kernels' pointer specialisation, and the contiguous-copy rule)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def plan_key(x, aux, counter, row, col, granularity, hadamard, fmt, prologue, colsum, hw, io_mode,
              erefs=None) -> tuple:
    # the flags by value and by type (True == 1 must not reuse a plan that validated a bool)
    return (_tensor_key(x), _tensor_key(aux) if prologue == "gelu_tanh_grad" else None, _tensor_key(counter),
            row, col, colsum, hadamard, type(row), type(col), type(colsum), type(hadamard),
            granularity, type(granularity), fmt, prologue, hw, io_mode, _tensor_key(erefs))


def cached_plan(key: tuple, *args, first_pass_only: bool = False) -> LaunchPlan:
    """The plan for `key`, built from `args` (LaunchPlan's) the first time. `first_pass_only`: a plan
    that launches the row granularity's pass 1 alone (`operands_cuda.mx_erefs_cuda`), cached apart."""
    if first_pass_only:
        key = ("first pass only", *key)
    plan = _PLANS.get(key)
    if plan is None:
        plan = LaunchPlan(*args)
        if first_pass_only:
            plan.passes, plan.grids, plan.launches = (1,), {1: plan.grid}, {1: None}
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan
