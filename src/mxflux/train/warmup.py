"""Warm-up steps that leave no trace: compile caches and allocators get warm, the run does not
change (an MLPerf run's untimed warm-up before `run_start`; docs/design.md, "MLPerf").

The snapshot is each rank's own shards of the weights and optimizer state, copied to the CPU
(no collective, nothing gathered), together with the LR schedule, the data position, every
RNG state and the MX layers' held column e_refs; restoring it makes the timed run exactly the run
without the warm-up.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from .checkpoint import rng_state, set_rng_state
from .held_erefs import held_snapshot, restore_held

__all__ = ["warmup_without_trace"]


def warmup_without_trace(trainer, steps: int) -> None:
    """Run `steps` optimizer steps of `trainer`, then restore everything they touched."""
    if steps <= 0:
        return
    snapshot = _snapshot(trainer)
    batches = trainer.batches()
    for _ in range(steps):
        trainer.train_step([next(batches) for _ in range(trainer.accum)])
    del batches
    _restore(trainer, snapshot)
    if trainer.captured is not None:
        # the restore dropped the optimizer state the warm-up created, which a graph captured
        # during the warm-up would still write to: the timed run captures its own
        trainer.captured.invalidate()
    for counter in trainer.window_counters:  # the warm-up's blocks outside the window are not the run's
        counter.zero_()


def _local_copy(t):
    if not isinstance(t, torch.Tensor):
        return copy.deepcopy(t)
    return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def _snapshot(trainer) -> dict:
    params = list(trainer.model.parameters())
    optimizer = trainer.optimizer
    return {
        "params": [_local_copy(p) for p in params],
        "optim": [{k: _local_copy(v) for k, v in optimizer.state[p].items()} if p in optimizer.state else None
                  for p in params],
        "groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": copy.deepcopy(trainer.scheduler.state_dict()),
        "progress": (trainer.step, trainer.samples, trainer.epoch, trainer.batch_in_epoch, trainer.last_eval),
        "rng": rng_state(),
        "held": held_snapshot(trainer.model),  # the MX layers' held column e_refs (`precision.held_col_erefs`)
    }


@torch.no_grad()
def _restore(trainer, snap: dict) -> None:
    def copy_into(dst, src):
        (dst.to_local() if isinstance(dst, DTensor) else dst).copy_(src)

    optimizer = trainer.optimizer
    for p, saved, opt in zip(trainer.model.parameters(), snap["params"], snap["optim"]):
        copy_into(p, saved)
        if opt is None:
            optimizer.state.pop(p, None)
            continue
        state = optimizer.state[p]
        for k, v in opt.items():
            if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor):
                copy_into(state[k], v)
            else:
                state[k] = v
    for g, saved in zip(optimizer.param_groups, snap["groups"]):
        g.update(saved)
    trainer.scheduler.load_state_dict(snap["scheduler"])
    trainer.step, trainer.samples, trainer.epoch, trainer.batch_in_epoch, trainer.last_eval = snap["progress"]
    set_rng_state(snap["rng"])
    restore_held(trainer.model, snap["held"])
