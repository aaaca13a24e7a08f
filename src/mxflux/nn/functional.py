"""The autograd Functions behind MXFP6Linear and FusedMXFP6MLP.

Each GEMM quantizes both operands along its own contraction axis (docs/design.md, "The three
GEMMs and their operands"):

    fprop  Y  = X  · Wᵀ     A = X [M,K] along K        B = W [N,K] along K
    dgrad  dX = dY · W      A = dY [M,N] along N       B = Wᵀ [K,N] along N
    wgrad  dW = dYᵀ · X     A = dYᵀ [N,M] along M      B = Xᵀ [K,M] along M

so every tensor is packed once into both orientations ("row" = along its last axis, "col" =
the transposed copy along its first). Forward saves only the quantized col copies that
backward needs (Xᵀ, Wᵀ), never bf16 activations; with `saved_operands="e2m3"` as 6-bit codes
that backward expands back to the same FP8 bytes. With `repack_weights` forward keeps no Wᵀ:
it packs W's row operand only, and backward packs Wᵀ again from the parameter, which is alive
anyway (the same bytes: the packer is deterministic). With the weight's operands kept by the
optimizer step (`mx_linear(..., weight_operands)`, docs/design.md, "The weights' operands from the
optimizer step"), forward packs no weight and saves the kept Wᵀ, which lives anyway, or, where the
step keeps the row operand alone (`precision.kept_weight_cols: false`), the parameter, from which
backward packs Wᵀ with the kept e_ref; with only their e_ref kept (`weight_erefs`), the packer runs
its second pass alone. The bias is
added in the GEMM's fp32 epilogue and its gradient is the column sum the dY packer produces while
it quantizes dY.

Weights and biases come in their own dtype (fp32 master parameters, or bf16 under FSDP's
mixed precision). The packer reads an fp32 weight directly and rounds it to bf16 as it loads it
(no cast kernel, no bf16 copy of the weights), and the gradients leave in the parameters' dtype
straight from the wgrad GEMM's fp32 accumulator and the dY packer's fp32 column sums: no bf16
rounding of the gradient and no cast kernel either (docs/design.md, "The three GEMMs and their
operands").
Every packer call adds the blocks it finds outside the FP8 fold window to the module's
`blocks_outside_window` counter (docs/design.md, "The exact FP8 fold and its window").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..mx.granularity import FoldGranularity
from ..mx.hadamard import hadamard32_by_gemm
from ..ops.custom_ops import (compact_operand, expand_operand, frozen_weight_col, mx_erefs, mx_operands,
                              mx_operands_held, scaled_gemm, use_kernels)

__all__ = ["HELD_HEADROOM", "SAVED_OPERANDS", "MXConfig", "frozen_mx_linear", "fused_mx_mlp", "mx_linear"]

# How forward keeps the col operands for backward (docs/design.md, "Saved operands in six bits").
SAVED_OPERANDS = ("e4m3", "e2m3")

# The default binades above the last call's column maxima at which `held_cols` places a column's fold
# window, for the input X and the output gradient dY (`MXConfig.held_headroom`; the recipe's
# precision.held_headroom_x / _dy): a feature's activations keep their range from step to step (one binade
# up re-encodes <= 0.1 % of the columns), its gradients less so (two: 0.2-0.6 %; counted by
# benchmarks/probe_eref_drift.py, benchmarks/NOTES.md). Each binade takes one from the exact window.
HELD_HEADROOM = {"x": 1, "dy": 2}


class MXConfig(NamedTuple):
    """Static settings of one MX module (hashable, so compile treats them as constants).

    `mx_gemm` is the recipe's name of the fold granularity ("rowwise", "blockwise", "exact").
    `saved_operands` is how forward keeps the col operands for backward: "e4m3" (the FP8 bytes,
    1 B per element) or "e2m3" (6-bit codes plus a shift byte per block, 25/32 B per element,
    expanded back to the same bytes in backward; docs/design.md, "Saved operands in six bits").
    `repack_weights`: forward packs only the weights' row operands and backward packs Wᵀ again
    from the parameter, instead of keeping Wᵀ from forward (one more read of each weight per
    step, 1 B per weight element less kept; docs/design.md, "The three GEMMs and their operands").
    `recomputed`: forward's packer calls may run again in backward (the module is inside a block
    under any `activation_checkpointing` but none), so they count into a fresh counter that is
    added to the module's once (`_forward_counter`).
    `pack_apart`: forward packs its input's two orientations by separate calls after a call that
    finds its e_ref alone (`_pack_apart`; where the packer has two passes), so that a
    selective-recompute policy re-runs only the col operand's (one orientation, the packer's second
    pass) in backward (`mxflux.nn.recompute`).
    `repack_input`: forward packs only the input's row operand and keeps the input itself, and backward
    packs Xᵀ from it (for a fused MLP, fc2's: the activation's from h, which it keeps anyway). Meant for
    inputs backward keeps anyway or that the partitioner rebuilds from such (a tensor saved twice is
    stored once): then the 1 B per element of Xᵀ is not kept (docs/design.md, "Inputs packed again in
    backward").
    `held_cols`: the input's and the output gradient's col operands (the weight gradient's) are
    encoded against each column's e_ref from the last call, raised by `held_headroom` binades, in the
    same read of the tensor as the row operand (`mx_operands_held`; docs/design.md, "The one-pass
    packer"); the module keeps those e_ref. Only where both orientations are packed in one call.
    `held_headroom`: those binades for X and for dY.
    """

    mx_gemm: str = "rowwise"
    hadamard: bool = True
    saved_operands: str = "e4m3"
    repack_weights: bool = False
    recomputed: bool = False
    pack_apart: bool = False
    repack_input: bool = False
    held_cols: bool = False
    held_headroom: tuple[int, int] = (HELD_HEADROOM["x"], HELD_HEADROOM["dy"])

    @property
    def granularity(self) -> FoldGranularity:
        """The fold granularity `mx_gemm` names (ValueError naming `mx_gemm` if it names none)."""
        return FoldGranularity.from_mx_gemm(self.mx_gemm)


class Operand(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor


def _pack(x, cfg: MXConfig, blocks_outside_window, *, row=True, col=True, prologue="none", aux=None,
          colsum=False, erefs=None):
    # a recomputed call stays the opaque op, which the selective-recompute policy recognises
    rd, rs, cd, cs, sums = mx_operands(x, aux, blocks_outside_window, row, col, cfg.granularity.value,
                                       cfg.hadamard, prologue, colsum, erefs, inline=not cfg.recomputed)
    return Operand(rd, rs), Operand(cd, cs), sums


def _pack_held(x, cfg: MXConfig, counter, held, headroom: int, colsum: bool = False):
    """`_pack`'s both orientations with the col windows at `held`'s e_ref (`mx_operands_held`), which
    then holds x's own maxima."""
    rd, rs, cd, cs, sums = mx_operands_held(x, held, counter, headroom, cfg.hadamard, colsum)
    return Operand(rd, rs), Operand(cd, cs), sums


def _pack_apart(x, cfg: MXConfig, counter) -> tuple[Operand, Operand]:
    """x's row and col operands by three calls instead of one: its e_ref (the row granularity's first
    pass alone, a few words per row and column), then each orientation's second pass. The same bytes
    and the same count as one call. Backward needs only the col operand; a selective-recompute policy
    marks the packer calls on activations for recompute, and the partitioner then re-runs just that
    call in backward (one orientation, one pass, from the kept e_ref) where a single call would run
    both passes for both orientations again."""
    erefs = mx_erefs(x, cfg.hadamard)
    x_row = _pack(x, cfg, counter, col=False, erefs=erefs)[0]
    # The col call counts into a counter of its own: a recomputed call is re-run from its inputs, and
    # had it taken the counter the row call had just added into, the row call would be re-run too.
    col_count = torch.zeros_like(counter)
    x_col = _pack(x, cfg, col_count, row=False, erefs=erefs)[1]
    counter.add_(col_count)
    return x_row, x_col


def _packs_apart(x, cfg: MXConfig, col: bool) -> bool:
    """Whether forward packs x apart (`_pack_apart`): asked for (`cfg.pack_apart`), the col operand
    needed, the row granularity, and a packer that finds the e_ref in a pass of its own, which the
    split then runs once (the CUDA kernels; the CPU packers do everything in one pass per call, so
    there the split would only add work)."""
    return cfg.pack_apart and col and _erefs_pass_of_its_own(x, cfg)


def _erefs_pass_of_its_own(x, cfg: MXConfig) -> bool:
    """Whether x's packer finds the e_ref in a first pass that can run alone (`mx_erefs`) and be skipped
    by later calls given its result: the row granularity on the two-pass packers."""
    return cfg.granularity is FoldGranularity.ROWWISE and _two_pass_packer(x)


def _repack_erefs(x, cfg: MXConfig):
    """For an input whose Xᵀ backward packs again (`cfg.repack_input`): its e_ref (the row granularity's
    first pass alone, a few words per row and column), found once in forward where the packer has two
    passes, so that forward's row call and backward's col call are each the second pass alone: backward
    reads the input once instead of twice. None elsewhere (the CPU packers: one pass per call)."""
    return mx_erefs(x, cfg.hadamard) if _erefs_pass_of_its_own(x, cfg) else None


def _two_pass_packer(x) -> bool:
    """x's packer runs the row granularity in two passes (the CUDA kernels). Tests of what the split
    does to the compiled graph replace this, to run it on the CPU."""
    return use_kernels(x)


def _forward_counter(blocks_outside_window, cfg: MXConfig):
    """The counter forward's packer calls add their fold-window blocks into: the module's own, or,
    where those calls may run again in backward (`cfg.recomputed`), a fresh zero one, which
    forward adds to the module's once after packing (`_add_forward_count`).

    Why: compiled, the partitioner re-runs a recomputed packer call in backward with the same
    counter argument, and inductor then adds into that tensor in place; were it the module's
    counter, every block the call finds would be counted twice (measured: exactly twice). Into the
    fresh counter, the recomputed call's count goes nowhere: the add to the module's counter is an
    ordinary op, which backward does not need and so does not re-run.
    """
    return torch.zeros_like(blocks_outside_window) if cfg.recomputed else blocks_outside_window


def _add_forward_count(blocks_outside_window, counter) -> None:
    if counter is blocks_outside_window:
        return
    # Eager, full activation checkpointing re-runs forward inside backward (an autograd graph task
    # is running then, and never in forward): forward has counted these blocks already. Compiled,
    # this add is an ordinary op that backward does not re-run, and the check is not traced.
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        return
    blocks_outside_window.add_(counter)


def _gemm(a: Operand, b: Operand, cfg: MXConfig, bias=None, out_dtype=torch.bfloat16):
    return scaled_gemm(a.data, a.scale, b.data, b.scale, cfg.granularity.value, bias, out_dtype)


def _stash(op: Operand, cfg: MXConfig) -> tuple:
    """What forward saves of a col operand: always three entries (data or packed codes, shifts or
    None, scale), so backward unpacks one layout. An operand that was not packed (empty) stays.
    (`cfg.saved_operands` is one of SAVED_OPERANDS, checked where the module is built.)"""
    if cfg.saved_operands == "e2m3" and op.data.numel():
        packed, shifts = compact_operand(op.data)
        return packed, shifts, op.scale
    return op.data, None, op.scale


def _unstash(data, shifts, scale) -> Operand:
    """The col operand `_stash` saved, as the GEMM takes it: expanded back byte for byte."""
    return Operand(data if shifts is None else expand_operand(data, shifts), scale)


def _packable(weight):
    """The weight as the packer reads it: fp32 and bf16 directly (fp32 rounded to bf16 as it is
    loaded), any other dtype cast to bf16 first."""
    return weight if weight.dtype in (torch.float32, torch.bfloat16) else weight.to(torch.bfloat16)


def _compute(param, dtype):
    """A bias in the compute dtype for the GEMM's epilogue. The cast happens inside forward, out
    of autograd's view: the Function returns the gradient in the parameter's own dtype."""
    return None if param is None else param.to(dtype)


def _pack_weight(weight, cfg: MXConfig, blocks_outside_window, col: bool, erefs=None) -> tuple:
    """Forward's packing of a weight (with its current e_ref where the optimizer step keeps them:
    `erefs`): (row operand, what forward saves for Wᵀ: the col operand's `_stash`, or the parameter
    itself where backward re-packs it, or nothing where no dX is due)."""
    w_row, w_col, _ = _pack(_packable(weight), cfg, blocks_outside_window, col=col and not cfg.repack_weights,
                            erefs=erefs)
    if col and cfg.repack_weights:
        return w_row, (weight, None, None)
    return w_row, _stash(w_col, cfg)


def _weight_col(saved, cfg: MXConfig, blocks_outside_window, *, repacked: bool, erefs=None) -> Operand:
    """Wᵀ for dgrad from what forward saved: unstashed, or (`repacked`: forward saved the parameter)
    packed again from the parameter (col only; the row operand is not needed in backward), with
    forward's e_ref (no optimizer step runs between forward and backward)."""
    if repacked:
        return _pack(_packable(saved[0]), cfg, blocks_outside_window, row=False, erefs=erefs)[1]
    return _unstash(*saved)


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, blocks_outside_window, cfg: MXConfig, grad: bool, w_erefs, w_row_data,
                w_row_scale, w_col_data, w_col_scale, x_held=None, dy_held=None):
        # `grad`: whether autograd records this call (`mx_linear`); forward runs with it off whatever the caller's
        w_grad, x_grad = grad and weight.requires_grad, grad and x.requires_grad
        counter = _forward_counter(blocks_outside_window, cfg)
        ctx.x_repacked = cfg.repack_input and w_grad
        if ctx.x_repacked:  # Xᵀ packed in backward from x itself, with x's e_ref from here (`_repack_erefs`)
            erefs = _repack_erefs(x, cfg)
            x_row, x_saved = _pack(x, cfg, counter, col=False, erefs=erefs)[0], (x, erefs, None)
        elif x_held is not None and w_grad:
            x_row, x_col, _ = _pack_held(x, cfg, counter, x_held, cfg.held_headroom[0])
            x_saved = _stash(x_col, cfg)
        else:
            x_row, x_col = (_pack_apart(x, cfg, counter) if _packs_apart(x, cfg, w_grad)
                            else _pack(x, cfg, counter, col=w_grad)[:2])
            x_saved = _stash(x_col, cfg)
        if w_row_data is not None:  # the weight's operands as the optimizer step left them: nothing to pack
            w_row = Operand(w_row_data, w_row_scale)
            # Wᵀ kept by the step too, or (the rows kept alone) packed in backward from the parameter
            ctx.w_repacked = w_col_data is None
            w_saved = (weight, None, None) if ctx.w_repacked else (w_col_data, None, w_col_scale)
        else:
            w_row, w_saved = _pack_weight(weight, cfg, counter, col=x_grad, erefs=w_erefs)
            ctx.w_repacked = x_grad and cfg.repack_weights
        _add_forward_count(blocks_outside_window, counter)
        y = _gemm(x_row, w_row, cfg, _compute(bias, x.dtype), x.dtype)
        ctx.save_for_backward(*x_saved, *w_saved)
        ctx.cfg, ctx.blocks_outside_window, ctx.w_erefs = cfg, blocks_outside_window, w_erefs
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        ctx.dy_held = dy_held
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        cfg = ctx.cfg
        dy = dy.contiguous()
        colsum = need_b and ctx.b_dtype is not None
        if ctx.dy_held is not None and need_x and need_w:
            dy_row, dy_col, dbias = _pack_held(dy, cfg, ctx.blocks_outside_window, ctx.dy_held, cfg.held_headroom[1],
                                               colsum)
        else:
            dy_row, dy_col, dbias = _pack(dy, cfg, ctx.blocks_outside_window, row=need_x, col=need_w, colsum=colsum)
        # each saved operand is expanded right before the GEMM that reads it (one at a time alive)
        if need_x:
            w_col = _weight_col(saved[3:6], cfg, ctx.blocks_outside_window, repacked=ctx.w_repacked,
                                erefs=ctx.w_erefs)
            dx = _gemm(dy_row, w_col, cfg, None, dy.dtype)
        else:
            dx = None
        if need_w:
            x_col = (_pack(saved[0], cfg, ctx.blocks_outside_window, row=False, erefs=saved[1])[1]
                     if ctx.x_repacked else _unstash(*saved[0:3]))
            dw = _gemm(dy_col, x_col, cfg, None, ctx.w_dtype)
        else:
            dw = None
        db = dbias.to(ctx.b_dtype) if need_b and ctx.b_dtype is not None else None
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


def mx_linear(x, weight, bias, blocks_outside_window, cfg: MXConfig, weight_operands=None, weight_erefs=None,
              held=None):
    """Y = X·Wᵀ + b in MXFP6 for bf16 2-D `x`; `blocks_outside_window` (int64 [1]) collects the
    count of blocks outside the fold window, in place. From the optimizer step, for the weight's
    current values (`mxflux.nn.weight_state`): `weight_operands`, its row-granularity operands (row
    data, row scale, col data, col scale; the col pair None where the step keeps the rows alone, and
    backward then packs Wᵀ from `weight` with `weight_erefs`), used as they are instead of packing
    `weight`; or `weight_erefs`, its e_ref, with which the packer skips its first pass. The gradients
    are computed as without them. `held` (`cfg.held_cols`): the int32 e_ref of x's and of dY's columns
    from the last call (e_ref + 128, 0 for none), which the packers encode those col operands against
    and then overwrite with the tensors' own.

    Where autograd records nothing (`torch.no_grad`, inference mode: validation, sampling) only the row
    operands are packed, no backward reading the col ones, and `held` is neither used nor overwritten:
    what an evaluation sees does not become the next training step's prediction."""
    w = (None,) * 4 if weight_operands is None else weight_operands
    grad = torch.is_grad_enabled()
    return _MXLinear.apply(x, weight, bias, blocks_outside_window, cfg, grad, weight_erefs, *w,
                           *(held if grad and held else (None, None)))


class _FrozenMXLinear(torch.autograd.Function):
    """Y = X·Wᵀ + b for a frozen weight held only as its fprop operand (row data, row scale): forward
    packs X's row operand alone (no dW is due, so no Xᵀ is kept); backward computes dX = dY·Wq with
    Wq the values those bytes hold, in the basis the fold rotated them into (docs/design.md, "LoRA on
    a frozen MXFP6 base"): Wᵀ's operand is the same values re-scaled per column (`frozen_weight_col`,
    exact), dY is packed along N unrotated, and the rotation is undone on dX (activation-sized)."""

    @staticmethod
    def forward(ctx, x, w_data, w_scale, w_column_scale, bias, blocks_outside_window, cfg: MXConfig):
        counter = _forward_counter(blocks_outside_window, cfg)
        x_row = _pack(x, cfg, counter, col=False)[0]
        _add_forward_count(blocks_outside_window, counter)
        y = _gemm(x_row, Operand(w_data, w_scale), cfg, _compute(bias, x.dtype), x.dtype)
        ctx.save_for_backward(w_data, w_scale, w_column_scale)
        ctx.cfg, ctx.blocks_outside_window = cfg, blocks_outside_window
        return y

    @staticmethod
    def backward(ctx, dy):
        w_data, w_scale, w_column_scale = ctx.saved_tensors
        cfg = ctx.cfg
        # hadamard=False: Wq's columns are not rotated along N, so neither may dY's rows be
        dy_row = Operand(*mx_operands(dy.contiguous(), None, ctx.blocks_outside_window, True, False,
                                      cfg.granularity.value, False, "none", False, inline=not cfg.recomputed)[:2])
        w_col = frozen_weight_col(w_data, w_scale, w_column_scale, cfg.granularity.value)
        dx = _gemm(dy_row, Operand(*w_col), cfg, None, dy.dtype)
        return hadamard32_by_gemm(dx) if cfg.hadamard else dx, None, None, None, None, None, None


def frozen_mx_linear(x, w_data, w_scale, w_column_scale, bias, blocks_outside_window, cfg: MXConfig):
    """Y = X·Wᵀ + b in MXFP6 for bf16 2-D `x` and a frozen weight held as its fprop operand (`w_data`
    E4M3 [N, K], `w_scale`) and the power of two per column its dgrad operand divides by
    (`w_column_scale`, `mx.operands.transposed_column_scale`); only dX is computed in backward
    (`bias` is a frozen tensor too)."""
    return _FrozenMXLinear.apply(x, w_data, w_scale, w_column_scale, bias, blocks_outside_window, cfg)


class _FusedMXMLP(torch.autograd.Function):
    """fc1 → GELU(tanh) → fc2 as one Function (docs/design.md, "Fusions").

    The activation exists only inside the packer: it is computed from the pre-activation h by
    the "gelu_tanh" prologue and written straight out as FP8 operands, never as a bf16 tensor.
    In backward the pre-activation gradient likewise exists only inside the "gelu_tanh_grad"
    prologue, whose column sums are fc1's bias gradient. h (the fc1 output, bias included by
    the GEMM epilogue) is kept, exactly as the unfused module's GELU keeps it.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, blocks_outside_window, cfg: MXConfig, grad: bool, erefs1, erefs2):
        # `grad` false (`fused_mx_mlp`): no backward follows, so the row operands alone
        counter = _forward_counter(blocks_outside_window, cfg)
        if _packs_apart(x, cfg, grad):
            x_row, x_col = _pack_apart(x, cfg, counter)
        else:
            x_row, x_col, _ = _pack(x, cfg, counter, col=grad)
        w1_row, w1_saved = _pack_weight(w1, cfg, counter, col=grad, erefs=erefs1)
        w2_row, w2_saved = _pack_weight(w2, cfg, counter, col=grad, erefs=erefs2)
        h = _gemm(x_row, w1_row, cfg, _compute(b1, x.dtype), x.dtype)
        act_row, act_col, _ = _pack(h, cfg, counter, col=grad and not cfg.repack_input, prologue="gelu_tanh")
        _add_forward_count(blocks_outside_window, counter)
        y = _gemm(act_row, w2_row, cfg, _compute(b2, x.dtype), x.dtype)
        ctx.save_for_backward(h, *_stash(x_col, cfg), *w1_saved, *_stash(act_col, cfg), *w2_saved)
        ctx.cfg, ctx.blocks_outside_window, ctx.erefs = cfg, blocks_outside_window, (erefs1, erefs2)
        ctx.dtypes = tuple(None if p is None else p.dtype for p in (w1, b1, w2, b2))
        return y

    @staticmethod
    def backward(ctx, dy):
        h, *saved = ctx.saved_tensors
        x_col, w1_saved, act_col, w2_saved = (saved[i:i + 3] for i in range(0, 12, 3))
        cfg, outside = ctx.cfg, ctx.blocks_outside_window
        w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        dy = dy.contiguous()
        dy_row, dy_col, db2 = _pack(dy, cfg, outside, colsum=b2_dtype is not None)
        erefs1, erefs2 = ctx.erefs
        w2_col = _weight_col(w2_saved, cfg, outside, repacked=cfg.repack_weights, erefs=erefs2)
        dact = _gemm(dy_row, w2_col, cfg, None, dy.dtype)
        # the activation's Xᵀ: kept, or packed from h as forward packed its row operand
        act_t = (_pack(h, cfg, outside, row=False, prologue="gelu_tanh")[1] if cfg.repack_input
                 else _unstash(*act_col))
        dw2 = _gemm(dy_col, act_t, cfg, None, w2_dtype)
        dh_row, dh_col, db1 = _pack(dact, cfg, outside, prologue="gelu_tanh_grad", aux=h,
                                    colsum=b1_dtype is not None)
        w1_col = _weight_col(w1_saved, cfg, outside, repacked=cfg.repack_weights, erefs=erefs1)
        dx = _gemm(dh_row, w1_col, cfg, None, dy.dtype)
        dw1 = _gemm(dh_col, _unstash(*x_col), cfg, None, w1_dtype)
        db1 = db1.to(b1_dtype) if b1_dtype is not None else None
        db2 = db2.to(b2_dtype) if b2_dtype is not None else None
        return dx, dw1, db1, dw2, db2, None, None, None, None, None


def fused_mx_mlp(x, w1, b1, w2, b2, blocks_outside_window, cfg: MXConfig, erefs=(None, None)):
    """fc2(GELU_tanh(fc1(x))) in MXFP6 with the activation fused into the packers; `erefs`: the two
    weights' current e_ref where the optimizer step keeps them (`mx_linear`). Where autograd records
    nothing, only the row operands are packed (as in `mx_linear`)."""
    return _FusedMXMLP.apply(x, w1, b1, w2, b2, blocks_outside_window, cfg, torch.is_grad_enabled(), *erefs)
