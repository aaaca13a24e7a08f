"""The held column e_refs (`precision.held_col_erefs`) through a checkpoint and a warm-up.

An MX linear that packs its weight gradient's col operands against the last call's column e_ref keeps
that prediction in two buffers (`MXFP6Linear.x_col_erefs`, `dy_col_erefs`), made from the data its
rank saw. They are not in the model's state dict (an exported model has no use for them), so the
trainer's checkpoint carries them beside it: each rank's, gathered on rank 0, a byte per column
(e_ref + 128, 0 for none). A run resumed on as many ranks takes them back rank by rank and goes on
bit for bit; on another number of ranks each sees other data, and every layer starts without a
prediction, as a new run does (its first step packs the exact fold). The warm-up puts back what it
found (`mxflux.train.warmup`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..nn import MXFP6Linear

__all__ = ["gather_held", "held_snapshot", "restore_gathered_held", "restore_held"]


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live prediction buffers of every layer that packs against them, by module name."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MXFP6Linear) and m.holds_col_erefs():
            out[f"{name}.x_col_erefs"], out[f"{name}.dy_col_erefs"] = m.x_col_erefs, m.dy_col_erefs
    return out


def held_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's predictions, a uint8 copy on the CPU (anything outside [0, 255] predicts nothing: 0)."""
    return {k: torch.where((v >= 0) & (v <= 255), v, 0).to("cpu", torch.uint8) for k, v in _buffers(model).items()}


def gather_held(model: torch.nn.Module, world: int) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's `held_snapshot` in rank order (a collective under a process group: call on every
    rank), or None where no layer holds predictions."""
    mine = held_snapshot(model)
    if not mine:
        return None
    if world == 1:
        return [mine]
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return every


def restore_held(model: torch.nn.Module, mine: dict[str, torch.Tensor]) -> None:
    """Copy a snapshot into the live buffers (in place: a captured step holds their addresses); a layer
    it does not cover, or covers with another shape, starts without a prediction."""
    for k, buf in _buffers(model).items():
        v = mine.get(k)
        if v is not None and v.shape == buf.shape:
            buf.copy_(v.to(buf.device, buf.dtype))
        else:
            buf.zero_()


def restore_gathered_held(model: torch.nn.Module, every: list | None, rank: int, world: int) -> None:
    """`restore_held` with this rank's share of `gather_held`'s list where it came from as many ranks;
    otherwise (another world size, or a checkpoint without predictions) every layer starts without."""
    restore_held(model, every[rank] if every and len(every) == world else {})
