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

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..kernels import weight_erefs
from ..kernels.operands_cuda import mx_operands_cuda, weight_exponents_cuda
from ..mx.operands import padded_rows

try:
    import triton
    import triton.language as tl

    from ..kernels.operands_cuda import tile_exponent_maxima, tile_operands
    from ..kernels.triton_common import f32_rounded_to_bf16, interpreting

    HAS_TRITON = True
except Exception:  # no Triton, or one that cannot initialise here
    triton = tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "LARGE", "WeightErefs", "adamw_clipped_step", "eligible"]

LARGE = 1 << 16  # elements: below this a parameter goes through torch's fused kernel with the others
# elements per program and its warps: the fastest of those benchmarks/bench_optimizer.py timed on the
# H200 (97.5 % of copy over the 6+12-block model against 94.4 % for 2048 x 8; RESULTS.md)
BLOCK, NUM_WARPS = 1024, 4

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
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
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
        """`_adamw_kernel` on rows row0 .. row0 + BS of a weight [R, C], columns col0 .. col0 + BC:
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
        """`_adamw_kernel` on one [BR, BC] tile of a weight [R, C] (contiguous): the updated fp32
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
    def _adamw_erefs_kernel(p_ptr, g_ptr, m_ptr, v_ptr, R, C, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
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
    def _adamw_operands_kernel(p_ptr, g_ptr, m_ptr, v_ptr, R, C, Rp, factor_ptr, lr_ptr, step_size_ptr,
                               bc2_sqrt_ptr, held_row_ptr, held_col_ptr, row_eref_ptr, col_eref_ptr,
                               row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, unheld_ptr,
                               weight_decay, beta1, beta2, eps, HEADROOM: tl.constexpr, HADAMARD: tl.constexpr,
                               HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, SLICES: tl.constexpr):
        """`_adamw_tile` on one [BR, NB·32] tile, then the packer's pass 2 on the updated tile
        (`tile_operands`): the weight's MX operands in both orientations, encoded against the e_ref
        of the weight before this step (held_row_ptr / held_col_ptr) raised by HEADROOM binades, and
        the e_ref of the updated weight by atomic max (row_eref_ptr / col_eref_ptr: pass 1). Blocks
        that e_ref does not hold are added to unheld_ptr; `_operands_fixup_kernel` then encodes the
        weight again against its own e_ref."""
        BC: tl.constexpr = NB * 32
        row0 = tl.program_id(1) * BR
        col0 = tl.program_id(0) * BC
        p = _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, R, C, row0, col0, factor_ptr, lr_ptr, step_size_ptr, bc2_sqrt_ptr,
                        weight_decay, beta1, beta2, eps, BR, BC, SLICES)
        unheld, _ = tile_operands(f32_rounded_to_bf16(p, HW), row0, col0, R, C, Rp, held_row_ptr, held_col_ptr,
                                  row_eref_ptr, col_eref_ptr, row_data_ptr, row_scale_ptr, col_data_ptr,
                                  col_scale_ptr, True, HEADROOM, HADAMARD, BR, NB, HW)
        if unheld > 0:
            tl.atomic_add(unheld_ptr, unheld, sem="relaxed")

    @triton.jit
    def _operands_fixup_kernel(p_ptr, R, C, Rp, unheld_ptr, row_eref_ptr, col_eref_ptr, row_data_ptr, row_scale_ptr,
                               col_data_ptr, col_scale_ptr, outside_ptr, fixups_ptr, n_col_tiles, n_tiles,
                               HADAMARD: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
        """Where `_adamw_operands_kernel` found blocks its e_ref did not hold (unheld_ptr > 0): the
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
                                     col_scale_ptr, False, 0, HADAMARD, BR, NB, HW)
                outside += n
            tl.atomic_add(outside_ptr, outside.to(tl.int64), sem="relaxed")
            if tl.program_id(0) == 0:
                tl.atomic_add(fixups_ptr, 1, sem="relaxed")


def eligible(optimizer: torch.optim.Optimizer, params_with_grads: Sequence[torch.Tensor]) -> bool:
    """This kernel can take `optimizer`'s step: torch's AdamW (fused, no amsgrad, not maximising)
    over fp32 parameters and gradients on one CUDA device, plain (not sharded) and contiguous."""
    if not HAS_TRITON or not isinstance(optimizer, torch.optim.AdamW):
        return False
    if any(g.get("amsgrad") or g.get("maximize") or not g.get("fused") for g in optimizer.param_groups):
        return False
    devices = {p.device for p in params_with_grads}
    if len(devices) > 1:
        return False
    for p in params_with_grads:
        g = p.grad
        if type(p.data) is not torch.Tensor or type(g) is not torch.Tensor or not p.is_cuda:
            return False
        if p.dtype != torch.float32 or g.dtype != torch.float32 or not (p.is_contiguous() and g.is_contiguous()):
            return False
    return True


def _state(optimizer: torch.optim.AdamW, p: torch.Tensor) -> dict:
    """The parameter's AdamW state, created as torch's fused AdamW creates it."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _lr_tensor(group: dict, scalars: dict, index: int, device: torch.device) -> torch.Tensor:
    """The group's learning rate as a float32 device scalar: the tensor a captured step swaps in,
    or a scalar kept in `scalars` and refilled from the float (a fill kernel, no synchronisation)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        return lr.to(device=device, dtype=torch.float32)
    t = scalars.get(index)
    if t is None or t.device != device:
        t = scalars[index] = torch.empty((), dtype=torch.float32, device=device)
    return t.fill_(lr)


class _Kept(NamedTuple):
    """What the step keeps for a weight whose operands it writes (`WeightErefs`)."""
    operands: tuple  # row data [R, C] E4M3, row scale [R, 1], col data [C, Rp] E4M3, col scale [C, 1]
    held: torch.Tensor  # the e_ref the operands were encoded against (before the headroom): a view of `held`
    unheld: torch.Tensor  # int32 [1]: blocks the step's e_ref did not hold (then the fix-up pass runs)
    counter: torch.Tensor  # the layer's blocks_outside_window


class WeightErefs:
    """The MX weights whose row-granularity e_ref the step computes (`mxflux.kernels.weight_erefs`):
    one int32 buffer for all of them, a view per weight registered with the packer's side. Only
    contiguous 2-D fp32 CUDA weights of at least LARGE elements qualify (the others go through
    torch's kernel, whose writes the packer sees by their version).

    For the weights of `linears` (MXFP6Linear modules whose own forward runs) the step writes the
    packed operands themselves (`_adamw_operands_kernel`), which the layer then uses instead of
    packing its weight at each forward (`MXFP6Linear.keep_weight_operands`): pass 2 runs on values
    still in registers, against the e_ref of the weight before the step raised by HEADROOM binades
    (a group's largest block exponent is known only once the whole row and column are updated; an
    e_ref above it gives the same MX values while every block stays within the window, and AdamW
    moves a weight by a small fraction of its size per step). Where a block falls outside that
    e_ref, `_operands_fixup_kernel` encodes the weight again against its own (docs/design.md, "The
    weights' operands from the optimizer step")."""

    # Tiles of 64 rows x 64 columns, 4 warps (one row block and one column block per thread, as in
    # the packer's pass 1), updated in 4 row slices: 106 registers on sm_90 (230 in one piece), four
    # programs per SM. The fastest of the tiles benchmarks/bench_optimizer.py timed on the H200:
    # the step 0.5 ms slower than without the e_ref on the 6+12-block model, where the packer's
    # pass 1 over the same weights takes 5.3 ms (RESULTS.md).
    BR, NB, NUM_WARPS, SLICES = 64, 2, 4, 4
    HEADROOM = 1  # binades above the previous e_ref: a row or column may double its largest block
    FIXUP_PROGRAMS = 128  # per weight: all return after one load unless a fix-up is due

    def __init__(self, weights: Sequence[tuple[torch.Tensor, bool]], linears: Sequence[torch.nn.Module] = ()):
        ok = [(p, bool(h)) for p, h in weights if self.qualifies(p)]
        sizes = [weight_erefs.buffer_words(*p.shape) for p, _ in ok]
        device = ok[0][0].device if ok else None
        self.buffer = torch.empty(sum(sizes), dtype=torch.int32, device=device) if ok else None
        self.of: dict[torch.Tensor, tuple[bool, torch.Tensor]] = {}
        spans = {}
        start = 0
        for (p, hadamard), n in zip(ok, sizes):
            view = self.buffer[start:start + n]
            spans[p] = (start, n)
            start += n
            weight_erefs.track(p, hadamard, view)
            self.of[p] = (hadamard, view)
        keep = [m for m in linears if m.weight in self.of]
        self.kept: dict[torch.Tensor, _Kept] = {}
        self.held = torch.empty_like(self.buffer) if keep else None
        self.unheld = torch.zeros(len(keep), dtype=torch.int32, device=device) if keep else None
        self.fixups = torch.zeros(1, dtype=torch.int64, device=device)  # fix-up passes run, summed over steps
        for i, m in enumerate(keep):
            p = m.weight
            (R, C), (a, n) = p.shape, spans[p]
            f8 = torch.float8_e4m3fn
            operands = (torch.empty(R, C, dtype=f8, device=device), torch.empty(R, 1, device=device),
                        torch.empty(C, padded_rows(R), dtype=f8, device=device), torch.empty(C, 1, device=device))
            self.kept[p] = _Kept(operands, self.held[a:a + n], self.unheld[i:i + 1], m.blocks_outside_window)
            m.keep_weight_operands(operands, self)
        self.refresh()

    @staticmethod
    def qualifies(p: torch.Tensor) -> bool:
        on_device = p.is_cuda or (HAS_TRITON and interpreting())  # the interpreter: CPU tensors (tests)
        return (HAS_TRITON and on_device and type(p.data) is torch.Tensor and p.dtype == torch.float32
                and p.dim() == 2 and p.is_contiguous() and p.numel() >= LARGE and p.shape[1] % 32 == 0)

    def refresh(self) -> None:
        """Recompute what the step computes (e_ref, and the operands it keeps) for every weight written
        by something other than this step since, or never computed: the packer's two passes."""
        for p in self.of:
            self.ensure_current(p)

    def ensure_current(self, p: torch.Tensor) -> None:
        """`refresh` for one weight: a version comparison when nothing is due."""
        if weight_erefs.is_current(p):
            return
        hadamard, view = self.of[p]
        x = p.detach()
        weight_exponents_cuda(x, hadamard, view)
        kept = self.kept.get(p)
        if kept is not None:
            got = mx_operands_cuda(x, hadamard=hadamard, erefs=view, counter=kept.counter)
            for dst, src in zip(kept.operands, (got.row_data, got.row_scale, got.col_data, got.col_scale)):
                dst.copy_(src)
            kept.held.copy_(view)
        weight_erefs.mark_current(p)

    def zero(self, updated: set) -> None:
        """Zero the buffers of the weights this step updates (atomic maxima start from 0): one fill
        for all of them when every one is updated, the usual case."""
        if len(updated) == len(self.of):
            self.buffer.zero_()
        else:
            for p, (_, view) in self.of.items():
                if p in updated:
                    view.zero_()
        if self.unheld is not None:
            self.unheld.zero_()


def adamw_clipped_step(optimizer: torch.optim.AdamW, factor: torch.Tensor, lr_scalars: dict | None = None,
                       erefs: WeightErefs | None = None) -> None:
    """One AdamW step of `optimizer` (see `eligible`) with every gradient multiplied by the
    device scalar `factor` first; the step counts advance as torch's do. Gradients are read, not
    written. `lr_scalars`: where the learning rates' device scalars are kept between steps (the
    optimizer's own dict, so that they live and die with it). `erefs`: weights whose e_ref the
    step computes as it updates them (`_adamw_erefs_kernel`), and whose operands too where it keeps
    them (`_adamw_operands_kernel`, then `_fix_up_operands`)."""
    lr_scalars = {} if lr_scalars is None else lr_scalars
    tracked = erefs.of if erefs is not None else {}
    fixups = []  # the weights whose operands the step wrote: each gets its (usually empty) fix-up pass
    if tracked:
        erefs.zero({p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and p in tracked})
    for index, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        device = params[0].device
        beta1, beta2 = group["betas"]
        lr = _lr_tensor(group, lr_scalars, index, device)
        states = [_state(optimizer, p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        large = [i for i, p in enumerate(params) if p.numel() >= LARGE]
        small = [i for i, p in enumerate(params) if p.numel() < LARGE]
        if large:
            t = torch.stack([steps[i] for i in large]).double()
            step_size = (lr.double() / (1.0 - torch.pow(beta1, t))).float()
            bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t)).float()
            for j, i in enumerate(large):
                p, s = params[i], states[i]
                n = p.numel()
                if p in tracked:
                    hadamard, view = tracked[p]
                    R, C = p.shape
                    W = WeightErefs
                    grid = (triton.cdiv(C, W.NB * 32), triton.cdiv(R, W.BR))
                    hyper = (float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]))
                    kept = erefs.kept.get(p)
                    if kept is None:
                        _adamw_erefs_kernel[grid](
                            p, p.grad, s["exp_avg"], s["exp_avg_sq"], R, C, factor, lr, step_size[j:], bc2_sqrt[j:],
                            *_rows_and_columns(view, p), *hyper, HADAMARD=hadamard, HW=not interpreting(), BR=W.BR,
                            NB=W.NB, SLICES=W.SLICES, num_warps=W.NUM_WARPS)
                    else:
                        rd, rs, cd, cs = kept.operands
                        _adamw_operands_kernel[grid](
                            p, p.grad, s["exp_avg"], s["exp_avg_sq"], R, C, cd.shape[1], factor, lr, step_size[j:],
                            bc2_sqrt[j:], *_rows_and_columns(kept.held, p), *_rows_and_columns(view, p),
                            rd.view(torch.int32), rs, cd.view(torch.int32), cs, kept.unheld, *hyper,
                            HEADROOM=W.HEADROOM, HADAMARD=hadamard, HW=not interpreting(), BR=W.BR, NB=W.NB,
                            SLICES=W.SLICES, num_warps=W.NUM_WARPS)
                        fixups.append(p)
                    weight_erefs.mark_current(p)
                    continue
                _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                    p, p.grad, s["exp_avg"], s["exp_avg_sq"], n, factor, lr, step_size[j:], bc2_sqrt[j:],
                    float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]),
                    BLOCK=BLOCK, num_warps=NUM_WARPS)
        if small:
            grads = torch._foreach_mul([params[i].grad for i in small], factor)  # small copies
            torch._fused_adamw_([params[i] for i in small], grads, [states[i]["exp_avg"] for i in small],
                                [states[i]["exp_avg_sq"] for i in small], [], [steps[i] for i in small],
                                lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
    if fixups:
        _fix_up_operands(erefs, fixups)


def _rows_and_columns(erefs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's e_ref buffer (`weight_erefs` layout) as its rows' part and its columns' part."""
    rows = weight_erefs.buffer_words(*p.shape) - p.shape[1]
    return erefs[:rows], erefs[rows:]


def _fix_up_operands(erefs: WeightErefs, updated: list) -> None:
    """After the step wrote the operands of `updated`: the fix-up pass of each (it writes only where
    the step's e_ref did not hold a block), then the new e_ref become what the next step encodes
    against."""
    W = WeightErefs
    for p in updated:
        hadamard, view = erefs.of[p]
        kept = erefs.kept[p]
        R, C = p.shape
        rd, rs, cd, cs = kept.operands
        n_col_tiles = triton.cdiv(C, W.NB * 32)
        n_tiles = n_col_tiles * triton.cdiv(R, W.BR)
        _operands_fixup_kernel[(min(n_tiles, W.FIXUP_PROGRAMS),)](
            p, R, C, cd.shape[1], kept.unheld, *_rows_and_columns(view, p), rd.view(torch.int32), rs,
            cd.view(torch.int32), cs, kept.counter, erefs.fixups, n_col_tiles, n_tiles, HADAMARD=hadamard,
            HW=not interpreting(), BR=W.BR, NB=W.NB, num_warps=W.NUM_WARPS)
    erefs.held.copy_(erefs.buffer)
