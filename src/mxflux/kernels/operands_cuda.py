"""Triton MX operand packers for Hopper: `mx_operands_cuda`, bit-identical to
`mxflux.mx.operands.mx_operands_reference`.

One bf16 matrix x [R, C] goes in; it is rotated, quantized to E2M3 with E8M0 block scales and
folded into FP8 GEMM operands (docs/design.md, "The exact FP8 fold and its window" and "The three
GEMMs and their operands"): the row orientation (blocks of MX_BLOCK along C) and the column
orientation (the transposed copy, blocks along R, R zero-padded to Rp), each as E4M3 data plus
fp32 group scales, optional column sums of the prologue output and a device-side count of blocks
outside the fold window.

Design (numbers and measurements in benchmarks/NOTES.md and RESULTS.md):

- Persistent programs walk a column strip in tiles of 128 rows x 64 columns (x 128 columns and
  16 warps for 1x128 groups), prefetching the next tile while computing this one; how many
  programs share a strip is sized per pass to whole waves (`persistent_row_programs`,
  `resident_programs`). Each tile is
  read from DRAM once. Every thread then holds one whole row block and one whole column block in
  registers (a tuple of MX_BLOCK tensors): the butterflies, the amax and the encoding are
  register code with no shuffles. Getting there costs one re-layout of the bf16 tile through
  shared memory per orientation (the column one is the transpose). Prologues (tanh-GELU, its
  gradient) run once per element, in registers, before both orientations.
- EXACT and BLOCKWISE granularity need nothing outside the tile: one pass, 2 B read + 2 B written
  per element (+ scales). ROWWISE needs the largest block exponent of a whole row (C long) and of
  a whole column (R long) before any byte can be written, so it runs two passes over x: pass 1
  only rotates and takes block exponents (per-row / per-column maxima by atomic max), pass 2 is
  the one-pass kernel reading those maxima (6 B/element in all).
- Encoding: y·2^(-e-6) is converted to E4M3 with the hardware's round-to-nearest-even. That is
  exactly E2M3 rounding (E4M3's subnormal step 2^-9 lines up with E2M3's 2^-3 at this shift,
  and both have 3 mantissa bits above it). The byte is decoded to f16 (exact), clamped to
  ±7.5·2^-6 (E2M3 saturation), multiplied by 2^(d+11) (d = e_block - e_ref; NaN for NaN blocks)
  and converted to E4M3 again: q·2^(d+5), the folded element, rounded to nearest even when the
  block lies below the exact window, as `fold_to_e4m3` does. On the GPU that is one inline-asm
  sequence per four elements whose result is the four bytes as one int32 word; the blocks are
  stored as words (the kernels are issue-bound: byte tensors cost a quarter more instructions).
  Under the CPU interpreter the conversions are emulated bit for bit in integer arithmetic
  (`triton_common`).
- The register layout (5 butterfly stages, 5 binary splits of a block, 16-byte quarters) is
  written for the OCP MX block of 32 elements; importing this module with another MX_BLOCK fails.

This module holds the packer kernel, its launches and the API; the device helpers the kernel is
built of are `operands_device`, the launch plans cached per call signature `operands_plan`. Everything that touches Triton is guarded: without Triton (or
without CUDA) this module imports and `mx_operands_cuda` raises a RuntimeError that says why.
"""

from __future__ import annotations

import torch

from ..mx.constants import MX_BLOCK
from ..mx.granularity import FoldGranularity
from ..mx.operands import MXOperands
from .operands_plan import (
    RUNTIME_ARGS,
    LaunchPlan,
    cached_plan,
    check_input,
    clear_launch_plans,
    pack_io_mode,
    persistent_row_programs,
    plan_key,
    resident_programs,
)
from .weight_erefs import buffer_words, rows_and_columns
from .triton_common import (
    HAS_TRITON,
    PAIR_SHUFFLE_ASM,
    PROLOGUE_IDS,
    compiled_launch,
    interpreting,
    lane_pair_shuffles_hold,
    launch_options,
    num_sms,
)

if MX_BLOCK != 32:
    raise ImportError(f"operands_cuda: the kernels' register layout is written for MX_BLOCK = 32, got {MX_BLOCK}")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import (
        bf16_to_f32,
        f32_rounded_to_bf16,
        f32_to_bf16,
        pow2_f32,
        prologue_f32,
        unzip,
        zip_tuple,
    )

__all__ = ["clear_launch_plans", "cuda_kernel_available", "mx_erefs_cuda", "mx_operands_cuda", "mx_operands_cuda_counted",
           "prologue_cuda", "weight_exponents_cuda"]

def cuda_kernel_available() -> bool:
    """True when mx_operands_cuda can run here: Triton importable and a CUDA device (or the interpreter)."""
    return HAS_TRITON and (torch.cuda.is_available() or interpreting())


if HAS_TRITON:
    from .operands_device import (
        _BLOCK,
        _SHIFT,
        _WINDOW,
        _amax_only,
        _block_info,
        _blocks_of_rows,
        _encode_words,
        _load_rows,
        _load_tile,
        _nb_major,
        _prologue_kernel,
        _quarters,
        _rotate_amax,
        _as_words,
        _store_blocks,
        _word_halves,
        _word_stride,
    )

    @triton.jit(do_not_specialize=["R", "n_row_tiles", "n_prog_r"])
    def _pack_kernel(
        x_ptr, aux_ptr, stride_x, stride_aux, R, C, Rp,
        row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
        colsum_ptr, outside_ptr, row_eref_ptr, col_eref_ptr,
        n_row_tiles, n_prog_r,
        PASS: tl.constexpr,  # 1: block exponents only (ROWWISE); 2: encode
        DO_ROW: tl.constexpr, DO_COL: tl.constexpr, DO_COLSUM: tl.constexpr,
        GRAN: tl.constexpr,  # FoldGranularity.kernel_id: 0 (a whole row), 128 or 32
        HADAMARD: tl.constexpr, PROLOGUE: tl.constexpr, HW: tl.constexpr,
        BR: tl.constexpr, NB: tl.constexpr,
        COAL: tl.constexpr,  # coalesced [BR, BC] tile loads, re-laid out once through shared memory
        X_F32: tl.constexpr = False,  # x is fp32 (master weights): rounded to bf16 as loaded
        PAIRS: tl.constexpr = False,  # blocks stored by lane pairs (whole 32-byte sectors)
    ):
        RB: tl.constexpr = BR // _BLOCK
        BC: tl.constexpr = NB * _BLOCK
        pid_c = tl.program_id(0)
        pid_r = tl.program_id(1)
        col0 = pid_c * BC

        r3 = tl.arange(0, BR)[:, None, None]
        c3 = (tl.arange(0, NB) * _BLOCK)[None, :, None] + tl.arange(0, 8)[None, None, :]
        cblk3 = col0 + (tl.arange(0, NB) * _BLOCK)[None, :, None]  # first column of each block
        rr = tl.arange(0, BR)
        nb2 = tl.arange(0, NB)[:, None]
        cc = tl.arange(0, BC)
        cmask = (col0 + cc) < C
        rb2 = tl.arange(0, RB)[:, None] * _BLOCK
        cc2 = col0 + cc[None, :]
        r2 = tl.arange(0, BR)[:, None]
        c2 = tl.arange(0, BC)[None, :]

        # per-thread accumulators in the block layouts, reduced once after the loop
        row_cnt = tl.zeros([NB, BR], dtype=tl.int32)
        col_cnt = tl.zeros([RB, BC], dtype=tl.int32)
        colmax = tl.zeros([RB, BC], dtype=tl.int32)
        csum = tl.zeros([RB, BC], dtype=tl.float32)

        if PASS == 2 and GRAN == 0 and DO_COL:
            cv = tl.load(col_eref_ptr + cc2, mask=cc2 < C, other=0)
            col_eref = tl.where(cv > 0, cv - 128, 0)  # [1, BC]
            if pid_r == 0:
                tl.store(col_scale_ptr + cc2, pow2_f32(col_eref - _SHIFT), mask=cc2 < C)

        # software pipeline: the next tile's loads are in flight while this one is computed
        if COAL:
            tn = _load_rows(x_ptr, pid_r * BR, stride_x, R, C, col0, r2, c2)
            if PROLOGUE == 2:
                an = _load_rows(aux_ptr, pid_r * BR, stride_aux, R, C, col0, r2, c2)
        else:
            v0, v1, v2, v3 = _load_tile(x_ptr, pid_r * BR, stride_x, R, C, col0, r3, c3, cblk3)
            if PROLOGUE == 2:
                a0, a1, a2, a3 = _load_tile(aux_ptr, pid_r * BR, stride_aux, R, C, col0, r3, c3, cblk3)
        for rt in range(pid_r, n_row_tiles, n_prog_r):
            row0 = rt * BR
            nxt = row0 + n_prog_r * BR
            if COAL:
                if X_F32:
                    t_in = f32_rounded_to_bf16(tn, HW)
                else:
                    t_in = tn
                pv = _blocks_of_rows(t_in, BR, NB, HW)
                if PROLOGUE == 2:
                    pa = _blocks_of_rows(an, BR, NB, HW)
                tn = _load_rows(x_ptr, nxt, stride_x, R, C, col0, r2, c2)
                if PROLOGUE == 2:
                    an = _load_rows(aux_ptr, nxt, stride_aux, R, C, col0, r2, c2)
            else:
                if X_F32:
                    q0 = f32_rounded_to_bf16(v0, HW)
                    q1 = f32_rounded_to_bf16(v1, HW)
                    q2 = f32_rounded_to_bf16(v2, HW)
                    q3 = f32_rounded_to_bf16(v3, HW)
                else:
                    q0 = v0
                    q1 = v1
                    q2 = v2
                    q3 = v3
                pv = _quarters(q0, q1, q2, q3, BR, NB, HW)
                if PROLOGUE == 2:
                    pa = _quarters(a0, a1, a2, a3, BR, NB, HW)
                pv = _nb_major(pv)
                if PROLOGUE == 2:
                    pa = _nb_major(pa)
                v0, v1, v2, v3 = _load_tile(x_ptr, nxt, stride_x, R, C, col0, r3, c3, cblk3)
                if PROLOGUE == 2:
                    a0, a1, a2, a3 = _load_tile(aux_ptr, nxt, stride_aux, R, C, col0, r3, c3, cblk3)

            # 32-tuple of [BR, NB] fp32 values: element j of each row block (after the prologue)
            xs = ()
            for j in tl.static_range(_BLOCK):
                xj = pv[j]
                if PROLOGUE != 0:
                    if PROLOGUE == 2:
                        aj = pa[j]
                    else:
                        aj = xj
                    # padding rows stay exactly +0 (the reference pads after the prologue)
                    xj = tl.where(((row0 + rr) < R)[None, :], prologue_f32(xj, aj, PROLOGUE, HW), 0.0)
                xs = xs + (xj,)

            # ---------------- row orientation: blocks along C, a whole block in each thread
            if DO_ROW:
                if PASS == 1:
                    ab = _amax_only(xs, HADAMARD)
                else:
                    ys, ab = _rotate_amax(xs, HADAMARD)  # [NB, BR] per block
                e, bad, live = _block_info(ab)
                rows = row0 + rr
                if PASS == 1:
                    rmax = tl.max(tl.where(live, e + 128, 0), axis=0)
                    tl.atomic_max(row_eref_ptr + rows, rmax, mask=(rows < R) & (rmax > 0), sem="relaxed")
                else:
                    if GRAN == 0:
                        rv = tl.load(row_eref_ptr + rows, mask=rows < R, other=0)
                        e_ref = tl.where(rv > 0, rv - 128, 0)[None, :]
                    elif GRAN == _BLOCK:
                        e_ref = tl.where(live, e, 0)
                    else:
                        g = tl.max(tl.reshape(tl.where(live, e, -1024), (NB // 4, 4, BR)), axis=1)
                        g = tl.reshape(tl.broadcast_to(g[:, None, :], (NB // 4, 4, BR)), (NB, BR))
                        e_ref = tl.where(g == -1024, 0, g)
                    words = _encode_words(ys, e, e_ref, bad, HW)
                    row_cnt += (live & ((e - e_ref) < -_WINDOW)).to(tl.int32)
                    zl, zh = _word_halves(words)  # [NB, BR, 4] -> [BR, NB, 4]
                    zl = tl.permute(zl, (1, 0, 2))
                    zh = tl.permute(zh, (1, 0, 2))
                    rest = (tl.arange(0, NB) * (_BLOCK // 4))[None, :, None] + tl.arange(0, 4)[None, None, :]
                    _store_blocks(_as_words(row_data_ptr) + col0 // 4, row0 + r3, _word_stride(C, pid_r), R, rest, zl,
                                  zh, cblk3 < C, PAIRS, HW)
                    if GRAN == 0:
                        if pid_c == 0:
                            tl.store(row_scale_ptr + rows[None, :], pow2_f32(e_ref - _SHIFT), mask=rows[None, :] < R)
                    else:
                        rows2 = rows[None, :]
                        cblk = col0 + nb2 * _BLOCK
                        so = rows2.to(tl.int64) * (C // GRAN) + cblk // GRAN
                        sm = (rows2 < R) & (cblk < C) & ((cblk % GRAN) == 0)
                        tl.store(row_scale_ptr + so, pow2_f32(e_ref - _SHIFT), mask=sm)

            # ---------------- column orientation: blocks along R, a whole block in each thread
            if DO_COL or (DO_COLSUM and PASS == 2):
                # one transpose of the bf16 tile through shared memory
                if PROLOGUE != 0:
                    tb = ()
                    for j in tl.static_range(_BLOCK):
                        tb = tb + (f32_to_bf16(xs[j], HW),)
                    t = tl.reshape(tl.permute(zip_tuple(tb, 5), (1, 0, 2, 3, 4, 5, 6)), (BR, BC))
                elif COAL:
                    t = t_in
                else:
                    t = tl.join(tl.join(q0, q2), tl.join(q1, q3))  # [BR, NB, 8, q1, q0]
                    t = tl.reshape(tl.permute(t, (0, 1, 3, 4, 2)), (BR, BC))  # column = 32·nb + 8·q + t
                t = tl.permute(tl.reshape(t, (RB, _BLOCK, BC)), (0, 2, 1))  # [RB, BC, 32]: row = 32·rb + j
                tc = unzip(tl.reshape(t, (RB, BC, 2, 2, 2, 2, 2)), 5)  # re-laid out as bf16 (2 B/element)
                xc = ()
                for j in tl.static_range(_BLOCK):
                    xc = xc + (bf16_to_f32(tc[j], HW),)
                if DO_COLSUM and PASS == 2:
                    for j in tl.static_range(_BLOCK):
                        csum += xc[j]
                if DO_COL:
                    if PASS == 1:
                        ab = _amax_only(xc, HADAMARD)
                    else:
                        ys, ab = _rotate_amax(xc, HADAMARD)  # [RB, BC] per block
                    e, bad, live = _block_info(ab)
                    if PASS == 1:
                        colmax = tl.maximum(colmax, tl.where(live, e + 128, 0))
                    else:
                        if GRAN == 0:
                            e_ref = col_eref
                        elif GRAN == _BLOCK:
                            e_ref = tl.where(live, e, 0)
                        else:
                            g = tl.max(tl.reshape(tl.where(live, e, -1024), (RB // 4, 4, BC)), axis=1)
                            g = tl.reshape(tl.broadcast_to(g[:, None, :], (RB // 4, 4, BC)), (RB, BC))
                            e_ref = tl.where(g == -1024, 0, g)
                        words = _encode_words(ys, e, e_ref, bad, HW)
                        col_cnt += (live & ((e - e_ref) < -_WINDOW)).to(tl.int32)
                        zl, zh = _word_halves(words)
                        # [BC, RB, 4] so that lanes run along columns, as in the data layout
                        zl = tl.permute(zl, (1, 0, 2))
                        zh = tl.permute(zh, (1, 0, 2))
                        ct = col0 + tl.arange(0, BC)[:, None, None]
                        rt3 = row0 + tl.arange(0, RB)[None, :, None] * _BLOCK
                        _store_blocks(_as_words(col_data_ptr), ct, _word_stride(Rp, pid_r), C,
                                      rt3 // 4 + tl.arange(0, 4)[None, None, :], zl, zh, rt3 < Rp, PAIRS, HW)
                        if GRAN != 0:
                            rbg = row0 + rb2
                            so = cc2.to(tl.int64) * (Rp // GRAN) + rbg // GRAN
                            sm = (cc2 < C) & (rbg < Rp) & ((rbg % GRAN) == 0)
                            tl.store(col_scale_ptr + so, pow2_f32(e_ref - _SHIFT), mask=sm)

        if PASS == 1:
            if DO_COL:
                cmax = tl.max(colmax, axis=0)
                tl.atomic_max(col_eref_ptr + col0 + cc, cmax, mask=cmask & (cmax > 0), sem="relaxed")
        else:
            if DO_COLSUM:
                tl.atomic_add(colsum_ptr + col0 + cc, tl.sum(csum, axis=0), mask=cmask, sem="relaxed")
            total = tl.sum(tl.sum(row_cnt, axis=0), axis=0) + tl.sum(tl.sum(col_cnt, axis=1), axis=0)
            tl.atomic_add(outside_ptr, total.to(tl.int64), sem="relaxed")


# -------------------------------------------------------------------- host side: the API and the launches
def mx_operands_cuda(
    x: torch.Tensor,
    *,
    row: bool = True,
    col: bool = True,
    granularity: FoldGranularity = FoldGranularity.ROWWISE,
    hadamard: bool = True,
    fmt: str = "e2m3",
    prologue: str = "none",
    aux: torch.Tensor | None = None,
    colsum: bool = False,
    counter: torch.Tensor | None = None,
    erefs: torch.Tensor | None = None,
    _hw: bool | None = None,
    _poison: bool = False,
) -> MXOperands:
    """Triton twin of `mxflux.mx.operands.mx_operands_reference` (same signature and outputs,
    bit for bit).

    x is a CUDA bfloat16 [R, C] matrix (C a multiple of MX_BLOCK, R any), or float32 without a
    prologue, packed as x.to(torch.bfloat16) would be (rounded as read). Only fmt "e2m3" has
    kernels. colsum equals the reference up to fp32 summation order; blocks_outside_window is a
    0-d int64 CUDA tensor (no host synchronisation). With `counter` (a tensor of one element) the
    count is added into it instead, in place, and `blocks_outside_window` is `counter`: when it is
    int64 on x's device the kernels add into it directly (the custom op's path, one launch less).

    Validation, geometry and constexprs come from a launch plan cached per (shapes, strides,
    dtypes, devices, alignment, flags); on a GPU with a known Triton, launches after a plan's first
    go straight to the compiled kernel (`triton_common.CompiledLaunch`; MXFLUX_COMPILED_LAUNCH=0
    turns that off).

    `erefs` (ROWWISE only; ignored otherwise): x's per-row and per-column e_ref, as
    `weight_exponents_cuda` computes them (`weight_erefs`' layout); the packer then skips its pass 1.
    Given e_ref that are not x's, the operands are wrong: the caller vouches for them
    (`mxflux.nn.weight_state`).
    """
    return MXOperands(*_pack(x, aux, counter, row, col, granularity, hadamard, fmt, prologue, colsum, _hw, _poison,
                             erefs))


def mx_operands_cuda_counted(x, aux, counter, row, col, granularity, hadamard, prologue, colsum, erefs=None) -> tuple:
    """`mx_operands_cuda` as the custom op calls it: positional arguments, the count added into
    `counter`, and a plain tuple (row_data, row_scale, col_data, col_scale, colsum, counter) with
    None for what was not asked (host time per call is what a small micro-batch is bound by). An x
    without a prologue whose current e_ref are given (`erefs`: a weight's from the optimizer step, an
    activation's from the first pass run on its own) is packed by pass 2 alone; `erefs` is ignored at
    another granularity or with a prologue."""
    return _pack(x, aux, counter, row, col, granularity, hadamard, "e2m3", prologue, colsum, None, False,
                 usable_erefs(x, granularity, erefs, prologue))


def usable_erefs(x: torch.Tensor, granularity: FoldGranularity, erefs, prologue: str = "none"):
    """`erefs` where the packer can use them (the row granularity, no prologue: the e_ref are those of
    x itself), else None."""
    if erefs is not None and (granularity is not FoldGranularity.ROWWISE or prologue != "none"):
        return None
    return erefs


_NO_COUNT: dict[torch.device, torch.Tensor] = {}  # per device: the counter pass 1 is handed and never writes


def mx_erefs_cuda(x: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """The row granularity's pass 1 alone, as a call on an activation (`mxflux::mx_erefs`): x's rows'
    and columns' e_ref in a fresh int32 buffer of `weight_erefs`' layout, which `mx_operands_cuda`
    takes as `erefs` to pack either orientation with pass 2 alone. The same kernel and grid as the
    packer's own pass 1, through a launch plan cached per call signature, with the compiled launch
    after its first call (host time per call is the packer's). The plan is a packer plan whose
    workspace is exactly that buffer: a counter the pass never writes (no count words), no column
    sums, so the rows' part (R padded to 4 words) and the columns' follow each other."""
    hw = not interpreting()
    io_mode = pack_io_mode()
    check_input(x, "x", (torch.bfloat16, torch.float32))
    no_count = _NO_COUNT.get(x.device)
    if no_count is None:
        no_count = _NO_COUNT[x.device] = torch.zeros(1, dtype=torch.int64, device=x.device)
    g = FoldGranularity.ROWWISE
    key = plan_key(x, None, no_count, True, True, g, hadamard, "e2m3", "none", False, hw, io_mode)
    plan = cached_plan(key, x, None, no_count, True, True, g, hadamard, "e2m3", "none", False, hw, io_mode,
                       first_pass_only=True)
    buf = torch.zeros(buffer_words(plan.R, plan.C), dtype=torch.int32, device=x.device)
    if plan.R == 0:
        return buf
    xw = x.clone(memory_format=torch.contiguous_format) if plan.copy_x or not key[0][4] else x
    fast = plan.fast
    if fast and fast[0].usable():
        xp, bp = xw.data_ptr(), buf.data_ptr()
        grid = plan.grids[1]
        fast[0](grid, (xp, xp, xw.stride(0), xw.stride(0), plan.R, plan.C, plan.Rp, bp, bp, bp, bp, bp,
                       no_count.data_ptr(), bp, bp + 4 * plan.off_col_eref, plan.n_rt, grid[1]))
    else:
        _launch_normally(plan, xw, xw, buf, buf, buf, buf, buf, no_count)
    return buf


def weight_exponents_cuda(x: torch.Tensor, hadamard: bool, out: torch.Tensor) -> torch.Tensor:
    """`mx_erefs_cuda` into `out` (int32 [weight_erefs.buffer_words(R, C)], overwritten): the e_ref of a
    weight written by anything but the optimizer's step, whose kernel computes them on its own
    (`mxflux.nn.weight_state`)."""
    check_input(x, "x", (torch.bfloat16, torch.float32))
    want = buffer_words(*x.shape)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or out.shape != (want,) \
            or out.device != x.device:
        raise ValueError(f"out: expected int32 [{want}] on {x.device}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    return out.copy_(mx_erefs_cuda(x, hadamard))


def _pack(x, aux, counter, row, col, granularity, hadamard, fmt, prologue, colsum, _hw, _poison, erefs=None) -> tuple:
    hw = (not interpreting()) if _hw is None else bool(_hw)
    io_mode = pack_io_mode()
    if not isinstance(x, torch.Tensor) or (aux is not None and not isinstance(aux, torch.Tensor)) \
            or (counter is not None and not isinstance(counter, torch.Tensor)):
        if counter is not None and not isinstance(counter, torch.Tensor):
            raise ValueError(f"counter: expected a torch.Tensor or None, got {type(counter).__name__}")
        LaunchPlan(x, aux, None, row, col, granularity, hadamard, fmt, prologue, colsum, hw, io_mode)  # raises
    if erefs is not None and not isinstance(erefs, torch.Tensor):
        raise ValueError(f"erefs: expected a torch.Tensor or None, got {type(erefs).__name__}")
    key = plan_key(x, aux, counter, row, col, granularity, hadamard, fmt, prologue, colsum, hw, io_mode, erefs)
    plan = cached_plan(key, x, aux, counter, row, col, granularity, hadamard, fmt, prologue, colsum, hw, io_mode,
                        erefs)

    dev = plan.device
    R, C = plan.R, plan.C
    f8 = torch.float8_e4m3fn
    row_data = torch.empty((R, C), dtype=f8, device=dev) if row else None
    row_scale = torch.empty(plan.row_scale_shape, dtype=torch.float32, device=dev) if row else None
    col_data = torch.empty((C, plan.Rp), dtype=f8, device=dev) if col else None
    col_scale = torch.empty(plan.col_scale_shape, dtype=torch.float32, device=dev) if col else None
    if _poison:  # tests: 0xFF bytes are NaN in fp32 and E4M3, so an unwritten element shows
        for t in (row_data, row_scale, col_data, col_scale):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)
    ws = torch.zeros(plan.ws_len, dtype=torch.int32, device=dev) if plan.ws_zero else None

    if plan.launch:
        xw = x.clone(memory_format=torch.contiguous_format) if plan.copy_x or not key[0][4] else x
        if key[1] is None:
            aw = xw
        else:
            aw = aux.clone(memory_format=torch.contiguous_format) if plan.copy_aux or not key[1][4] else aux
        fast = plan.fast
        if fast and fast[0].usable():
            xp = xw.data_ptr()
            wp = xp if ws is None else ws.data_ptr()  # any device address where nothing is read
            args = (
                xp, aw.data_ptr(), xw.stride(0), aw.stride(0), R, C, plan.Rp,
                row_data.data_ptr() if row else wp, row_scale.data_ptr() if row else wp,
                col_data.data_ptr() if col else wp, col_scale.data_ptr() if col else wp,
                wp + 4 * plan.off_sums if colsum else wp,
                counter.data_ptr() if plan.direct_counter else wp + 4 * plan.off_outside,
                *_eref_addresses(plan, wp, erefs),
                plan.n_rt,
            )
            for launch, p in zip(fast, plan.passes):
                grid = plan.grids[p]
                launch(grid, args + (grid[1],))
        else:
            if ws is None:
                ws = torch.empty(plan.ws_len, dtype=torch.int32, device=dev)  # stands in for unused pointers
            _launch_normally(plan, xw, aw, ws, row_data, row_scale, col_data, col_scale, counter, erefs)

    if plan.direct_counter:
        outside = counter
    else:
        outside = ws[plan.off_outside:plan.off_outside + 2].view(torch.int64).view(())
        if counter is not None:
            counter.add_(outside.reshape(counter.shape))
            outside = counter
    return (row_data, row_scale, col_data, col_scale,
            ws[plan.off_sums:plan.off_sums + C].view(torch.float32) if colsum else None, outside)


def _eref_addresses(plan, wp: int, erefs) -> tuple[int, int]:
    """Device addresses of the rows' and the columns' e_ref: in the given buffer, or in the
    workspace (at `wp`), or `wp` where the plan has none (nothing reads them)."""
    if plan.given_erefs:
        return erefs.data_ptr(), erefs.data_ptr() + 4 * (buffer_words(plan.R, plan.C) - plan.C)
    return (wp + 4 * plan.off_row_eref if plan.off_row_eref is not None else wp,
            wp + 4 * plan.off_col_eref if plan.off_col_eref is not None else wp)


def _launch_normally(plan, xw, aw, ws, row_data, row_scale, col_data, col_scale, counter, erefs=None) -> None:
    """Triton's normal launch path (`kernel[grid](...)`), with tensor arguments. After a pass's
    first launch under a plan, builds its `CompiledLaunch` where this Triton allows one."""

    def part(off, n):
        return ws if off is None else ws[off:off + n]

    R, C = plan.R, plan.C
    if plan.given_erefs:
        row_eref, col_eref = rows_and_columns(erefs, R, C)
    else:
        row_eref, col_eref = part(plan.off_row_eref, R), part(plan.off_col_eref, C)
    i32 = torch.int32  # the kernels store the E4M3 data as 4-byte words
    args = (
        xw, aw, xw.stride(0), aw.stride(0), R, C, plan.Rp,
        row_data.view(i32) if plan.row else ws, row_scale if plan.row else ws,
        col_data.view(i32) if plan.col else ws, col_scale if plan.col else ws,
        ws[plan.off_sums:plan.off_sums + C].view(torch.float32) if plan.colsum else ws,
        counter if plan.direct_counter else ws[plan.off_outside:plan.off_outside + 2].view(torch.int64),
        row_eref, col_eref, plan.n_rt,
    )
    if not plan.pairs_checked:  # before the plan's first launch: compiles only, under the default grid
        compile_args = args + (plan.grid[1],)
        if 2 in plan.passes:
            plan.meta["PAIRS"] = _paired_stores_hold(plan, compile_args)
        _size_grids_per_pass(plan, compile_args)
        plan.pairs_checked = True
    device = _compiled_launch_device(plan) if plan.fast is None else None
    for p in plan.passes:
        grid = plan.grids[p]
        args_p = args + (grid[1],)
        compiled = _pack_kernel[grid](*args_p, PASS=p, **plan.meta, **plan.options)
        if device is not None:
            plan.launches[p] = compiled_launch(compiled, RUNTIME_ARGS, args_p, dict(PASS=p, **plan.meta), device)
    if device is not None:  # built once per plan: every pass's launcher, or False (normal launches for good)
        launches = tuple(plan.launches[p] for p in plan.passes)
        plan.fast = launches if all(launches) else False


_PAIRS_HOLD: dict[str, bool] = {}  # compiled pass-2 kernel (its hash) -> whether its layout carries the pair swap


def _paired_stores_hold(plan, args) -> bool:
    """Whether pass 2 may store by lane pairs under this plan: the warp shuffle of
    `_swap_lane_pairs` is only right where the compiled layout puts dim 0's lowest bit on lane
    bit 0. That is what Triton 3.6 picks for the 16-byte block stores (every pointer and row
    length 16-byte aligned, as here), but the layout is the compiler's choice, so the pass-2
    kernel is compiled first (no launch) and its layouts are read; where they do not hold, the
    plan stores each thread's own block instead (correct in any layout, about as slow as before).
    The emulation (HW=False) swaps by reshaping, correct in any layout."""
    if not plan.hw or interpreting() or not (plan.row or plan.col):
        return True
    compiled = _pack_kernel.warmup(*args, grid=plan.grid, PASS=2, **dict(plan.meta, PAIRS=True), **plan.options)
    key = getattr(compiled, "hash", None)
    hold = _PAIRS_HOLD.get(key) if key is not None else None
    if hold is None:
        found = lane_pair_shuffles_hold(compiled.asm["ttgir"], PAIR_SHUFFLE_ASM)
        hold = len(found) == int(plan.row) + int(plan.col) and all(found)
        if key is not None:
            _PAIRS_HOLD[key] = hold
    return hold


_RESIDENT: dict[str, int] = {}  # compiled kernel (its hash) -> programs per SM


def _size_grids_per_pass(plan, args) -> None:
    """Before a plan's first launch on a GPU: compile each pass (no launch), read its registers and
    shared memory, and size that pass's grid for the programs an SM really holds
    (`resident_programs`): the default grid assumes two, where pass 1 fits three."""
    # (pass 2 alone keeps the default grid, sized for the two programs an SM holds of it)
    if not plan.hw or interpreting() or plan.device.type != "cuda" or plan.passes == (2,):
        return
    sms = num_sms(plan.device.index if plan.device.index is not None else torch.cuda.current_device())
    warps = plan.options["num_warps"]
    for p in plan.passes:
        compiled = _pack_kernel.warmup(*args, grid=plan.grid, PASS=p, **plan.meta, **plan.options)
        key = getattr(compiled, "hash", None)
        resident = _RESIDENT.get(key) if key is not None else None
        if resident is None:
            try:
                compiled._init_handles()
                resident = resident_programs(compiled.n_regs, warps, compiled.metadata.shared)
            except (AttributeError, RuntimeError):  # another Triton: keep the default grid
                return
            if key is not None:
                _RESIDENT[key] = resident
        plan.grids[p] = (plan.grid[0], persistent_row_programs(plan.grid[0], plan.n_rt, resident * sms))


def _compiled_launch_device(plan) -> int | None:
    """The device index a plan's compiled launchers may be built for: x's CUDA device when it is
    the current one (the device Triton just loaded the kernel on); None otherwise."""
    dev = plan.device
    return dev.index if dev.type == "cuda" and dev.index == torch.cuda.current_device() else None


def prologue_cuda(x: torch.Tensor, prologue: str, aux: torch.Tensor | None = None, *, _hw: bool | None = None):
    """The packer's in-register prologue as a standalone bf16 -> bf16 map (tests, numerics reports)."""
    if not HAS_TRITON:
        raise RuntimeError("prologue_cuda: Triton is not installed")
    check_input(x, "x")
    if prologue not in PROLOGUE_IDS:
        raise ValueError(f"prologue: expected one of {tuple(PROLOGUE_IDS)}, got {prologue!r}")
    if prologue == "gelu_tanh_grad":
        if aux is None or aux.shape != x.shape:
            raise ValueError(f"aux: the gelu_tanh_grad prologue needs the pre-activation, shape {tuple(x.shape)}")
        aux = aux.contiguous()
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    hw = (not interpreting()) if _hw is None else bool(_hw)
    block = 1024
    _prologue_kernel[(max(1, -(-n // block)),)](
        x, aux if aux is not None else x, out, n, PROLOGUE=PROLOGUE_IDS[prologue], HW=hw, BLOCK=block,
        **launch_options(4)
    )
    return out
