"""The AdamW step with the clipping factor applied in the same pass, on our Triton kernels
(`mxflux.kernels.adamw_cuda`: why, and the arithmetic): one kernel per large parameter, torch's fused
kernel for the small rest, and for the MX weights whose state the step keeps
(`mxflux.nn.weight_state.MXWeightState`) the kernels that also write their e_ref and operands.

The optimizer object stays torch's `AdamW` (fused): its parameter groups, state tensors (step as a
float32 device scalar, exp_avg, exp_avg_sq) and state_dict are exactly torch's, so checkpoints and
resumes do not depend on which kernel ran.

Under FSDP2 the parameters, gradients and moments are DTensors sharded alike; AdamW is elementwise,
so the kernels update each rank's local shards (the clipping factor comes from the norm of all
shards, `train.clipping`). Of a weight sharded by rows the step keeps the e_ref: each rank writes its
rows' (whole rows) and its rows' share of each column's maximum, and one all-reduce of the maxima
after the step gives every rank the whole weight's; the operands are not kept there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from ..kernels import adamw_cuda as kernels
from ..kernels.triton_common import HAS_TRITON, interpreting
from ..kernels.weight_erefs import rows_and_columns
from ..mx.operands import padded_rows
from ..nn.weight_state import MXWeightState, row_shard_start

if HAS_TRITON:
    import triton

__all__ = ["HAS_TRITON", "LARGE", "adamw_clipped_step", "eligible"]

LARGE = kernels.LARGE  # elements: below this a parameter goes through torch's fused kernel with the others

def eligible(optimizer: torch.optim.Optimizer, params_with_grads: Sequence[torch.Tensor]) -> bool:
    """This kernel can take `optimizer`'s step: torch's AdamW (fused, no amsgrad, not maximising)
    over fp32 parameters and gradients on one CUDA device, contiguous; plain tensors, or DTensors
    whose gradients are sharded as they are (FSDP2), each rank's shards then updated on their own."""
    if not HAS_TRITON or not isinstance(optimizer, torch.optim.AdamW):
        return False
    if any(g.get("amsgrad") or g.get("maximize") or not g.get("fused") for g in optimizer.param_groups):
        return False
    devices = {p.device for p in params_with_grads}
    if len(devices) > 1:
        return False
    for p in params_with_grads:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor):
            if g.placements != p.placements or g.device_mesh != p.device_mesh:
                return False
            p, g = _local(p), _local(g)
            if p.shape != g.shape:
                return False
        if type(p.data) is not torch.Tensor or type(g) is not torch.Tensor or not on_kernel_device(p):
            return False
        if p.dtype != torch.float32 or g.dtype != torch.float32 or not (p.is_contiguous() and g.is_contiguous()):
            return False
    return True


def on_kernel_device(t: torch.Tensor) -> bool:
    """Where the step's kernels run: CUDA. (Tests running Triton's interpreter on the CPU widen it.)"""
    return t.is_cuda


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: the kernels write into it), or t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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


def adamw_clipped_step(optimizer: torch.optim.AdamW, factor: torch.Tensor, lr_scalars: dict | None = None,
                       state: MXWeightState | None = None) -> None:
    """One AdamW step of `optimizer` (see `eligible`) with every gradient multiplied by the
    device scalar `factor` first; the step counts advance as torch's do. Gradients are read, not
    written. `lr_scalars`: where the learning rates' device scalars are kept between steps (the
    optimizer's own dict, so that they live and die with it). `state`: the MX weights whose e_ref the
    step computes as it updates them (`adamw_erefs_kernel`), and whose operands too where it keeps
    them (`adamw_operands_kernel`, then `_fix_up_operands`)."""
    lr_scalars = {} if lr_scalars is None else lr_scalars
    tracked = state.of if state is not None else {}
    fixups = []  # the weights whose operands the step wrote: each gets its (usually empty) fix-up pass
    sharded = False  # some sharded weight's e_ref were updated: the ranks' maxima are reduced after the step
    if tracked:
        state.zero({p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and p in tracked})
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
        # what the kernels read and write: the tensors themselves, or this rank's shards of them
        originals = params  # (the state is kept per parameter)
        params = [_local(p) for p in params]
        states = [dict(s, exp_avg=_local(s["exp_avg"]), exp_avg_sq=_local(s["exp_avg_sq"])) for s in states]
        grads = [_local(p.grad) for p in originals]
        large = [i for i, p in enumerate(params) if p.numel() >= LARGE]
        small = [i for i, p in enumerate(params) if p.numel() < LARGE]
        if large:
            t = torch.stack([steps[i] for i in large]).double()
            step_size = (lr.double() / (1.0 - torch.pow(beta1, t))).float()
            bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t)).float()
            for j, i in enumerate(large):
                p, g, s, orig = params[i], grads[i], states[i], originals[i]
                n = p.numel()
                if orig in tracked:
                    hadamard, view = tracked[orig]
                    R, C = p.shape
                    W = kernels.OperandTile
                    grid = (triton.cdiv(C, W.NB * 32), triton.cdiv(R, W.BR))
                    hyper = (float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]))
                    kept = state.kept.get(orig)
                    if kept is None:
                        rows, cols = rows_and_columns(view, *orig.shape)
                        if isinstance(orig, DTensor):  # this rank's rows; its share of the columns' maxima
                            rows, sharded = rows[row_shard_start(orig):], True
                        kernels.adamw_erefs_kernel[grid](
                            p, g, s["exp_avg"], s["exp_avg_sq"], R, C, factor, lr, step_size[j:], bc2_sqrt[j:],
                            rows, cols, *hyper, HADAMARD=hadamard, HW=not interpreting(), BR=W.BR,
                            NB=W.NB, SLICES=W.SLICES, num_warps=W.NUM_WARPS)
                    else:
                        state.restore_rows(orig)  # after `release_rows`: written whole below
                        rp, operands, col = _kernel_operands(kept, R)
                        kernels.adamw_operands_kernel[grid](
                            p, g, s["exp_avg"], s["exp_avg_sq"], R, C, rp, factor, lr, step_size[j:],
                            bc2_sqrt[j:], *rows_and_columns(kept.held, *p.shape), *rows_and_columns(view, *p.shape),
                            *operands, kept.unheld, *hyper,
                            HEADROOM=W.HEADROOM, HADAMARD=hadamard, HW=not interpreting(), BR=W.BR, NB=W.NB,
                            SLICES=W.SLICES, COL=col, num_warps=W.NUM_WARPS)
                        fixups.append(orig)
                    state.mark_current(orig)
                    continue
                kernels.adamw_kernel[(triton.cdiv(n, kernels.BLOCK),)](
                    p, g, s["exp_avg"], s["exp_avg_sq"], n, factor, lr, step_size[j:], bc2_sqrt[j:],
                    float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]),
                    BLOCK=kernels.BLOCK, num_warps=kernels.NUM_WARPS)
        if small:
            scaled = torch._foreach_mul([grads[i] for i in small], factor)  # small copies
            torch._fused_adamw_([params[i] for i in small], scaled, [states[i]["exp_avg"] for i in small],
                                [states[i]["exp_avg_sq"] for i in small], [], [steps[i] for i in small],
                                lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
    if sharded:
        state.reduce_sharded()
    if fixups:
        _fix_up_operands(state, fixups)


def _kernel_operands(kept, rows: int) -> tuple[int, tuple, bool]:
    """A weight's kept operands as the kernels take them: (the col operand's padded rows, the four
    operand pointers, whether the col operand is kept). A state keeping the rows alone
    (`precision.kept_weight_cols: false`) passes its row tensors where the col ones would go: the
    kernels, told COL=False, write nothing there."""
    rd, rs, cd, cs = kept.operands
    if cd is None:
        return padded_rows(rows), (rd.view(torch.int32), rs, rd.view(torch.int32), rs), False
    return cd.shape[1], (rd.view(torch.int32), rs, cd.view(torch.int32), cs), True


def _fix_up_operands(state: MXWeightState, updated: list) -> None:
    """After the step wrote the operands of `updated`: the fix-up pass of each (it writes only where
    the step's e_ref did not hold a block), then the new e_ref become what the next step encodes
    against."""
    W = kernels.OperandTile
    for p in updated:
        hadamard, view = state.of[p]
        kept = state.kept[p]
        R, C = p.shape
        rp, operands, col = _kernel_operands(kept, R)
        n_col_tiles = triton.cdiv(C, W.NB * 32)
        n_tiles = n_col_tiles * triton.cdiv(R, W.BR)
        kernels.operands_fixup_kernel[(min(n_tiles, W.FIXUP_PROGRAMS),)](
            p, R, C, rp, kept.unheld, *rows_and_columns(view, *p.shape), *operands, kept.counter, state.fixups,
            n_col_tiles, n_tiles, HADAMARD=hadamard, HW=not interpreting(), BR=W.BR, NB=W.NB, COL=col,
            num_warps=W.NUM_WARPS)
    state.held.copy_(state.buffer)
