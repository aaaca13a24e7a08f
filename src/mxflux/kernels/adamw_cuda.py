"""AdamW with the clipping factor applied in the same pass: one Triton kernel per large parameter.

Why not torch's fused AdamW alone: gradient clipping adds a pass of its own over the gradients
(8.3 ms for the 3.8 B fp32 parameters of the 6+12-block model on the H200), and folding the clip
factor into the fused kernel's `grad_scale` makes it write every gradient back (5.5 ms more;
benchmarks/RESULTS.md). This kernel reads parameter, gradient and both moments once and writes
parameter and moments once (28 bytes per element), the gradient multiplied by the clip factor on
the way in, as `clip_grad_norm_` multiplies it: 25.6 ms there, 97.5 % of the card's copy bandwidth
(torch's fused kernel without the factor: 30.6 ms, 82 %).

The arithmetic is AdamW's as torch writes it (decoupled weight decay p ← p − lr·wd·p, then
m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², p ← p − (lr / (1 − β1^t)) · m / (√v / √(1 − β2^t) + ε)),
in fp32 per element with IEEE square root and division; the per-parameter scalars (step size and
√(1 − β2^t), from the parameter's own step count) are computed in fp64 by torch ops on the device,
so that nothing is read on the host and a step can be captured in a CUDA graph. torch's fused
kernel evaluates some of the same terms in fp64, so the two agree to fp32 rounding, not bit for bit
(tests/gpu/test_adamw_cuda.py holds both to an fp64 AdamW).

The optimizer object stays torch's `AdamW` (fused): its parameter groups, state tensors (step as a
float32 device scalar, exp_avg, exp_avg_sq) and state_dict are exactly torch's, so checkpoints and
resumes do not depend on which kernel ran. Parameters below `LARGE` elements (biases, norms) are
updated by torch's fused kernel after their gradients are multiplied by the factor: their bytes are
negligible and one launch covers all of them.
"""

from __future__ import annotations

from .triton_common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .operands_device import tile_exponent_maxima, tile_operands
    from .triton_common import f32_rounded_to_bf16

__all__ = ["BLOCK", "HAS_TRITON", "LARGE", "NUM_WARPS", "OperandTile"]

LARGE = 1 << 16  # elements: below this a parameter goes through torch's fused kernel with the others
# elements per program and its warps: the fastest of those benchmarks/bench_optimizer.py timed on the
# H200 (97.5 % of copy over the 6+12-block model against 94.4 % for 2048 x 8; RESULTS.md)
BLOCK, NUM_WARPS = 1024, 4



class OperandTile:
    """The launch shape of the steps that also write an MX weight's e_ref (`adamw_erefs_kernel`) and
    operands (`adamw_operands_kernel`), and of their fix-up pass.

    Tiles of 64 rows x 64 columns, 4 warps (one row block and one column block per thread, as in
    the packer's pass 1), updated in 4 row slices: 106 registers on sm_90 (230 in one piece), four
    programs per SM. The fastest of the tiles benchmarks/bench_optimizer.py timed on the H200: the
    step 0.5 ms slower than without the e_ref on the 6+12-block model, where the packer's pass 1
    over the same weights takes 5.3 ms (RESULTS.md)."""

    BR, NB, NUM_WARPS, SLICES = 64, 2, 4, 4
    HEADROOM = 1  # binades above the previous e_ref: a row or column may double its largest block
    FIXUP_PROGRAMS = 128  # per weight: all return after one load unless a fix-up is due


if HAS_TRITON:

    @triton.jit
    def _adamw(p, g, m, v, lr, step_size, bc2_sqrt, weight_decay, beta1, beta2, eps):
        """AdamW on fp32 values (g already multiplied by the clip factor): (p, m, v) updated."""
        p = p - (lr * weight_decay) * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        return p - tl.div_rn(step_size * m, denom), m, v

    @triton.jit
    def _adamw_in_place(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, factor, lr, step_size, bc2_sqrt, weight_decay,
                        beta1, beta2, eps):
        """Read parameter, gradient (times the factor) and moments at `offs`, update, write back
        parameter and moments; returns the updated parameters."""
        p, m, v = _adamw(tl.load(p_ptr + offs, mask=mask), tl.load(g_ptr + offs, mask=mask) * factor,
                         tl.load(m_ptr + offs, mask=mask), tl.load(v_ptr + offs, mask=mask),
                         lr, step_size, bc2_sqrt, weight_decay, beta1, beta2, eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        return p

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
                      weight_decay, beta1, beta2, eps, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        factor = tl.load(factor_ptr)
        lr = tl.load(lr_ptr)
        step_size = tl.load(step_size_ptr)
        bc2_sqrt = tl.load(bc2_sqrt_ptr)
        _adamw_in_place(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, factor, lr, step_size, bc2_sqrt, weight_decay,
                        beta1, beta2, eps)

    @triton.jit
    def _adamw_slice(p_ptr, g_ptr, m_ptr, v_ptr, R, C, row0, col0, factor, lr, step_size, bc2_sqrt,
                     weight_decay, beta1, beta2, eps, BS: tl.constexpr, BC: tl.constexpr):
        """`adamw_kernel` on rows row0 .. row0 + BS of a weight [R, C], columns col0 .. col0 + BC:
        the updated parameters ([BS, BC], zero outside the weight)."""
        r2 = tl.arange(0, BS)[:, None]
        c2 = tl.arange(0, BC)[None, :]
        mask = ((row0 + r2) < R) & ((col0 + c2) < C)
        offs = (row0 + r2).to(tl.int64) * C + col0 + c2
        p = _adamw_in_place(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, factor, lr, step_size, bc2_sqrt, weight_decay,
                            beta1, beta2, eps)
        return tl.where(mask, p, 0.0)

    @triton.jit
    def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, R, C, row0, col0, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
                    weight_decay, beta1, beta2, eps, BR: tl.constexpr, BC: tl.constexpr, SLICES: tl.constexpr):
        """`adamw_kernel` on one [BR, BC] tile of a weight [R, C] (contiguous): the updated fp32
        parameters, zero outside the weight. The update runs in SLICES (1, 2 or 4) row slices: each
        slice's stores come before the next slice's loads (the pointers may alias, so the compiler
        cannot hoist them), which divides the registers the loads hold (sm_90: 231 per thread in one
        piece, 106 in four)."""
        S: tl.constexpr = BR // SLICES
        factor = tl.load(factor_ptr)
        lr = tl.load(lr_ptr)
        step_size = tl.load(step_size_ptr)
        bc2_sqrt = tl.load(bc2_sqrt_ptr)
        q = ()
        for k in tl.static_range(SLICES):
            q = q + (_adamw_slice(p_ptr, g_ptr, m_ptr, v_ptr, R, C, row0 + k * S, col0, factor, lr, step_size,
                                  bc2_sqrt, weight_decay, beta1, beta2, eps, S, BC),)
        if SLICES == 1:
            p = q[0]
        elif SLICES == 2:
            p = tl.reshape(tl.permute(tl.join(q[0], q[1]), (2, 0, 1)), (BR, BC))
        else:  # element [s, c, i, j] of the joins is slice 2i + j
            p = tl.reshape(tl.permute(tl.join(tl.join(q[0], q[2]), tl.join(q[1], q[3])), (2, 3, 0, 1)), (BR, BC))
        return p

    @triton.jit
    def adamw_erefs_kernel(p_ptr, g_ptr, m_ptr, v_ptr, R, C, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
                            row_eref_ptr, col_eref_ptr, weight_decay, beta1, beta2, eps,
                            HADAMARD: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
                            SLICES: tl.constexpr):
        """`_adamw_tile` on one [BR, NB·32] tile, then the row granularity's pass 1 on the updated
        tile (`tile_exponent_maxima`): the e_ref the packer needs for this weight, from values still
        in registers, where the packer's own pass 1 would read the 4-byte weight again."""
        BC: tl.constexpr = NB * 32
        row0 = tl.program_id(1) * BR
        col0 = tl.program_id(0) * BC
        p = _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, R, C, row0, col0, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
                        weight_decay, beta1, beta2, eps, BR, BC, SLICES)
        t = f32_rounded_to_bf16(p, HW)  # what the packer reads: x.to(bfloat16), rows past R zero
        cmax = tile_exponent_maxima(t, row0, R, row_eref_ptr, HADAMARD, BR, NB, HW)
        cols = col0 + tl.arange(0, BC)
        tl.atomic_max(col_eref_ptr + cols, cmax, mask=(cols < C) & (cmax > 0), sem="relaxed")

    @triton.jit
    def adamw_operands_kernel(p_ptr, g_ptr, m_ptr, v_ptr, R, C, Rp, factor_ptr, lr_ptr, step_size_ptr,
                               bc2_sqrt_ptr, held_row_ptr, held_col_ptr, row_eref_ptr, col_eref_ptr,
                               row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, unheld_ptr,
                               weight_decay, beta1, beta2, eps, HEADROOM: tl.constexpr, HADAMARD: tl.constexpr,
                               HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, SLICES: tl.constexpr,
                               COL: tl.constexpr = True):
        """`_adamw_tile` on one [BR, NB·32] tile, then the packer's pass 2 on the updated tile
        (`tile_operands`): the weight's MX operands in both orientations, encoded against the e_ref
        of the weight before this step (held_row_ptr / held_col_ptr) raised by HEADROOM binades, and
        the e_ref of the updated weight by atomic max (row_eref_ptr / col_eref_ptr: pass 1). Blocks
        that e_ref does not hold are added to unheld_ptr; `operands_fixup_kernel` then encodes the
        weight again against its own e_ref. Without COL the row operand alone (the column e_ref still
        found): backward packs Wᵀ from the weight (`precision.kept_weight_cols: false`)."""
        BC: tl.constexpr = NB * 32
        row0 = tl.program_id(1) * BR
        col0 = tl.program_id(0) * BC
        p = _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, R, C, row0, col0, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
                        weight_decay, beta1, beta2, eps, BR, BC, SLICES)
        unheld, _ = tile_operands(f32_rounded_to_bf16(p, HW), row0, col0, R, C, Rp, held_row_ptr, held_col_ptr,
                                  row_eref_ptr, col_eref_ptr, row_data_ptr, row_scale_ptr, col_data_ptr,
                                  col_scale_ptr, True, HEADROOM, HADAMARD, BR, NB, HW, COL)
        if unheld > 0:
            tl.atomic_add(unheld_ptr, unheld, sem="relaxed")

    @triton.jit
    def operands_fixup_kernel(p_ptr, R, C, Rp, unheld_ptr, row_eref_ptr, col_eref_ptr, row_data_ptr, row_scale_ptr,
                               col_data_ptr, col_scale_ptr, outside_ptr, fixups_ptr, n_col_tiles, n_tiles,
                               HADAMARD: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
                               COL: tl.constexpr = True):
        """Where `adamw_operands_kernel` found blocks its e_ref did not hold (unheld_ptr > 0): the
        weight's operands again, against its own e_ref (the packer's pass 2 on the stored weight),
        the blocks outside the window added to outside_ptr, and one fix-up to fixups_ptr. Otherwise
        every program returns after one load (a few microseconds per weight)."""
        BC: tl.constexpr = NB * 32
        if tl.load(unheld_ptr) > 0:
            r2 = tl.arange(0, BR)[:, None]
            c2 = tl.arange(0, BC)[None, :]
            outside = tl.zeros((), dtype=tl.int32)
            for i in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                row0 = (i // n_col_tiles) * BR
                col0 = (i % n_col_tiles) * BC
                mask = ((row0 + r2) < R) & ((col0 + c2) < C)
                p = tl.load(p_ptr + (row0 + r2).to(tl.int64) * C + col0 + c2, mask=mask, other=0.0)
                _, n = tile_operands(f32_rounded_to_bf16(p, HW), row0, col0, R, C, Rp, row_eref_ptr, col_eref_ptr,
                                     row_eref_ptr, col_eref_ptr, row_data_ptr, row_scale_ptr, col_data_ptr,
                                     col_scale_ptr, False, 0, HADAMARD, BR, NB, HW, COL)
                outside += n
            tl.atomic_add(outside_ptr, outside.to(tl.int64), sem="relaxed")
            if tl.program_id(0) == 0:
                tl.atomic_add(fixups_ptr, 1, sem="relaxed")
