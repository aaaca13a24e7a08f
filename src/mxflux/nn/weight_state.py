"""The one owner of what an optimizer step keeps of the MX weights between steps.

For each row-granularity MX weight the AdamW step can compute, as it updates the weight, the e_ref
that the packer's first pass would otherwise find at the next forward (`kernels.weight_erefs`: the
layout), and
for the weights of MXFP6Linear layers that run their own forward even the packed operands
themselves, which the layer then uses instead of packing its weight (docs/design.md, "The weights'
operands from the optimizer step"). `MXWeightState` holds those tensors, attaches them to the layers
as plain tensors (`MXFP6Linear.weight_erefs`, `.weight_operands`) with the weight's version they
belong to, and recomputes them through `mxflux.ops` for any weight written by something else (a
load, an EMA swap, torch's own optimizer): a layer never calls back into it, and the packer gets
its e_ref as an argument.

What keeps them honest is the parameter's autograd version counter. Every in-place write through
torch bumps it; the Triton step, which writes parameters behind torch's back, records the version
it leaves (`mark_current`). An eager forward uses them only while the version matches
(`MXFP6Linear.kept_weight_state`); a compiled one cannot read it, so `install` registers a forward
pre-hook on the model that calls `refresh` (a captured step calls it before each replay). Writes
through `.data` are the one kind torch does not count: they are not seen
(`precision.weight_exponents_in_optimizer: false` turns the whole mechanism off).

FSDP2 weights (DTensors sharded by rows) keep their e_ref only: each rank finds its rows' and its
share of every column's, and the ranks' maxima are reduced (`reduce_sharded` after a step, per weight
in a refresh), so every rank holds the whole weight's, which the gathered weight's forward packs
with. The version that counts is the shard's (the parameter the owner holds), not the gathered
weight's that forward sees, and of the shard both its own and its local tensor's (`weight_version`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..mx.granularity import FoldGranularity
from ..mx.operands import padded_rows
from ..ops import eref_buffer_words, eref_rows_and_columns, mx_operands, weight_exponents, weight_exponents_available
from .linear import MXFP6Linear, rowwise_mx_linears, weight_version
from .mlp import linears_with_own_forward

__all__ = ["MXWeightState", "row_shard_start"]


def _rows_per_shard(p: DTensor) -> int:
    """Rows of each shard of an FSDP2 weight sharded by rows but the last (torch.chunk's split, FSDP2's)."""
    return -(-p.shape[0] // p.device_mesh.size())


def row_shard_start(p: DTensor) -> int:
    """The first row of this rank's shard of an FSDP2 weight sharded by rows."""
    return p.device_mesh.get_local_rank() * _rows_per_shard(p)


class Kept(NamedTuple):
    """What the step keeps for a weight whose operands it writes."""
    # row data [R, C] E4M3, row scale [R, 1], col data [C, Rp] E4M3, col scale [C, 1]; the col pair None
    # where the state keeps the rows alone (backward packs Wᵀ from the weight)
    operands: tuple
    held: torch.Tensor  # the e_ref the operands were encoded against (before the headroom): a view of `held`
    unheld: torch.Tensor  # int32 [1]: blocks the step's e_ref did not hold (then the fix-up pass runs)
    counter: torch.Tensor  # the layer's blocks_outside_window


class MXWeightState:
    """The e_ref of the weights of `layers` (row-granularity MXFP6Linear modules), and the packed
    operands of those of `keep` (layers running their own forward: not the fc1 / fc2 of a fused
    MLP, whose Function packs their weights): both orientations, or with `keep_cols=False` the
    row operands alone, forward's (1 byte per weight element less between steps; each backward
    then packs Wᵀ from the weight with the kept e_ref, `precision.kept_weight_cols`). One int32
    buffer for all e_ref, a view per weight. Only contiguous 2-D fp32 weights of at least
    `min_elements` elements on a device where the kernels run qualify (`qualifies`); the others are
    packed by their layers as always."""

    def __init__(self, layers: Sequence[MXFP6Linear], keep: Sequence[MXFP6Linear] = (), *, keep_cols: bool = True,
                 min_elements: int = 1):
        for m in (*layers, *keep):
            if not isinstance(m, MXFP6Linear) or m.cfg.granularity is not FoldGranularity.ROWWISE:
                raise ValueError(f"layers: the e_ref and operands kept are the row granularity's; got "
                                 f"{type(m).__name__} with mx_gemm={getattr(getattr(m, 'cfg', None), 'mx_gemm', None)!r}")
        self.min_elements, self.keep_cols = min_elements, keep_cols
        self.layers: dict[torch.Tensor, list[MXFP6Linear]] = {}
        for m in layers:
            if self.qualifies(m.weight):
                self.layers.setdefault(m.weight, []).append(m)
        ps = list(self.layers)
        sizes = [eref_buffer_words(*p.shape) for p in ps]
        device = ps[0].device if ps else None
        self.buffer = torch.empty(sum(sizes), dtype=torch.int32, device=device) if ps else None
        self.of: dict[torch.Tensor, tuple[bool, torch.Tensor]] = {}
        spans, start = {}, 0
        for p, n in zip(ps, sizes):
            hadamard = self.layers[p][0].cfg.hadamard
            view = self.buffer[start:start + n]
            spans[p], start = (start, n), start + n
            self.of[p] = (hadamard, view)
            for m in self.layers[p]:
                m.weight_erefs, m.weight_state_version = view, None
                # the tensor whose version the state belongs to (under FSDP2 the sharded parameter, not
                # the gathered one forward sees); set past nn.Module's attribute hook, which would
                # register a Parameter as one of the module's own
                object.__setattr__(m, "weight_state_param", p)
        # (sharded weights keep their e_ref only: their operands would have to be gathered in place of them)
        kept_layers = [m for m in keep if m.weight in self.of and not isinstance(m.weight, DTensor)]
        self.kept: dict[torch.Tensor, Kept] = {}
        self.held = torch.empty_like(self.buffer) if kept_layers else None
        self.unheld = torch.zeros(len(kept_layers), dtype=torch.int32, device=device) if kept_layers else None
        self.fixups = torch.zeros(1, dtype=torch.int64, device=device)  # fix-up passes run, summed over steps
        for i, m in enumerate(kept_layers):
            p = m.weight
            (R, C), (a, n) = p.shape, spans[p]
            f8 = torch.float8_e4m3fn
            operands = (torch.empty(R, C, dtype=f8, device=device), torch.empty(R, 1, device=device),
                        *((torch.empty(C, padded_rows(R), dtype=f8, device=device), torch.empty(C, 1, device=device))
                          if keep_cols else (None, None)))
            for t in (t for t in operands if t is not None):
                # Rewritten in place by every step, so their addresses never change: compiled with
                # CUDA graphs (`model.compile_mode: reduce-overhead`) the replays read them where they
                # are instead of copying them into the graph's own input buffers each time.
                torch._dynamo.mark_static_address(t)
            self.kept[p] = Kept(operands, self.held[a:a + n], self.unheld[i:i + 1], m.blocks_outside_window)
            m.weight_operands = operands
        self.refresh()

    @classmethod
    def of_model(cls, model: torch.nn.Module, *, keep_operands: bool, keep_cols: bool = True,
                 min_elements: int = 1) -> "MXWeightState":
        """The state of every row-granularity MX weight of `model`, with the operands of the layers
        that run their own forward when `keep_operands` (their col operands too when `keep_cols`)."""
        return cls(rowwise_mx_linears(model), linears_with_own_forward(model) if keep_operands else (),
                   keep_cols=keep_cols, min_elements=min_elements)

    def qualifies(self, p: torch.Tensor) -> bool:
        """A 2-D fp32 weight, contiguous, whose rows hold whole blocks, on a device where the kernels run, of
        at least `min_elements` elements: a plain tensor, or an FSDP2 shard by rows (its local rows then,
        the step updating each rank's shard)."""
        if isinstance(p, DTensor):
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),) or p.dim() != 2:
                return False
            local = p.to_local()
            # Decided alike on every rank (their states must hold the same weights: the maxima are reduced
            # over one buffer), on the smallest shard, so that every rank's goes through the step's kernel.
            size = max(0, p.shape[0] - (p.device_mesh.size() - 1) * _rows_per_shard(p)) * p.shape[1]
        elif type(p.data) is torch.Tensor:
            local, size = p, p.numel()
        else:
            return False
        return (weight_exponents_available(local) and local.dtype == torch.float32 and p.dim() == 2
                and local.is_contiguous() and size >= self.min_elements and p.shape[1] % 32 == 0)

    def install(self, model: torch.nn.Module) -> None:
        """Bring everything up to date before each forward of `model` (compiled layers use what is
        attached unchecked)."""
        if self.of:
            model.register_forward_pre_hook(lambda module, args: self.refresh())

    def is_current(self, p: torch.Tensor) -> bool:
        return all(m.weight_state_version == weight_version(p) for m in self.layers[p])

    def mark_current(self, p: torch.Tensor) -> None:
        """What is kept for `p` now belongs to its current values (queued on the device before any
        later use): record the version the parameter has."""
        for m in self.layers[p]:
            m.weight_state_version = weight_version(p)

    def release_rows(self) -> int:
        """Free the kept row operands' data (1 B per weight element) until the next step or refresh
        writes them again; the bytes freed. For the time between a training forward and its backward,
        where the peak of a step lies: forward has read the row operands and backward reads Wᵀ alone
        (docs/design.md, "The weights' operands from the optimizer step"). The layers count as not
        current meanwhile, so an eager forward packs its weight itself and `refresh` writes the rows
        again where no step has; the step writes them where it updates the weight. Frozen weights
        (`requires_grad` false), which no step writes, keep theirs."""
        freed = 0
        for p, kept in self.kept.items():
            storage = kept.operands[0].untyped_storage()
            if storage.nbytes() and p.requires_grad:
                freed += storage.nbytes()
                storage.resize_(0)
                for m in self.layers[p]:
                    m.weight_state_version = None
        return freed

    def free(self) -> int:
        """Free every kept operand's memory, row and col, for good (a finished run's state, whose layers
        may still be held by compiled code); the bytes freed. No step or refresh may follow."""
        freed = 0
        for kept in self.kept.values():
            for t in kept.operands:
                if t is None:
                    continue
                freed += t.untyped_storage().nbytes()
                t.untyped_storage().resize_(0)
        return freed

    def restore_rows(self, p: torch.Tensor) -> None:
        """Give `p`'s kept row operand its memory back after `release_rows`, for a writer to fill."""
        rows = self.kept[p].operands[0]
        storage = rows.untyped_storage()
        if storage.nbytes() < rows.numel() * rows.element_size():
            storage.resize_(rows.numel() * rows.element_size())

    def refresh(self) -> None:
        """Recompute what the step computes (e_ref, and the operands it keeps) for every weight written
        by something other than the step since, or never computed: the packer's two passes."""
        for p in self.of:
            self.ensure_current(p)

    def ensure_current(self, p: torch.Tensor) -> None:
        """`refresh` for one weight: a version comparison when nothing is due."""
        if self.is_current(p):
            return
        hadamard, view = self.of[p]
        x = p.detach()
        if isinstance(x, DTensor):
            self._sharded_exponents(x, hadamard, view)
            self.mark_current(p)
            return
        weight_exponents(x, hadamard, view)
        kept = self.kept.get(p)
        if kept is not None:
            self.restore_rows(p)
            got = mx_operands(x, None, kept.counter, True, self.keep_cols, FoldGranularity.ROWWISE.value, hadamard,
                              "none", False, view)
            for dst, src in zip(kept.operands, got[:4]):
                if dst is not None:
                    dst.copy_(src)
            kept.held.copy_(view)
        self.mark_current(p)

    @staticmethod
    def _sharded_exponents(x: DTensor, hadamard: bool, view: torch.Tensor) -> None:
        """The e_ref of an FSDP2 weight sharded by rows: each rank finds its rows' (whole rows: complete)
        and its rows' share of every column's, the ranks' maxima are reduced (a collective: every rank
        refreshes the same weights, their versions moving alike)."""
        local = x.to_local()
        n, c = local.shape
        first = row_shard_start(x)
        rows, cols = eref_rows_and_columns(view, *x.shape)
        view.zero_()
        if n:
            mine = weight_exponents(local, hadamard, torch.empty(eref_buffer_words(n, c), dtype=torch.int32,
                                                                 device=local.device))
            mine_rows, mine_cols = eref_rows_and_columns(mine, n, c)
            rows[first:first + n].copy_(mine_rows[:n])
            cols.copy_(mine_cols)
        dist.all_reduce(view, op=dist.ReduceOp.MAX, group=x.device_mesh.get_group())

    def reduce_sharded(self) -> None:
        """After a step that updated sharded weights (each rank its rows' e_ref and its share of the
        columns'): every rank's maxima, for every weight at once (one collective)."""
        meshes = {p.device_mesh for p in self.of if isinstance(p, DTensor)}
        for mesh in meshes:
            dist.all_reduce(self.buffer, op=dist.ReduceOp.MAX, group=mesh.get_group())

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
