"""An exponential moving average (EMA) of the weights, for sampling (`train.ema_decay`).

After optimizer step n (1-based) every fp32 master weight w updates its average a as
a ← a + (1 − d_n)·(w − a), with d_n = min(decay, (1 + n) / (10 + n)): the warm-up keeps the
early average from dwelling on the random initialisation (a short run reaches `decay` only
after 9/(1 − decay) − 1 steps; 0.99: after step 890). The average starts as the initial weights.

The averages are fp32 tensors shaped and placed as their parameters: whole alone and under
DDP, FSDP2 shards (DTensors) under FSDP2, so a rank updates only its own shard. A checkpoint
holds them under "ema", keyed by parameter name like the weights: whole tensors in a single
file, shards in a sharded directory, and either loads onto any world size (`Trainer`). They are
a pure function of the weights' history, so a resumed run's averages match the uninterrupted
run's bit for bit.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["WeightEMA", "ema_decay_at", "plain_name"]

# Wrapper prefixes in parameter names (activation checkpointing, torch.compile): the EMA keys
# are the plain names, the same as the checkpoint's "model" keys.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter's name as state dicts key it: without the wrappers' prefixes."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def ema_decay_at(decay: float, step: int) -> float:
    """The decay applied at optimizer step `step` (1-based): min(decay, (1 + step) / (10 + step))."""
    return min(decay, (1 + step) / (10 + step))


class WeightEMA:
    """The moving averages of a model's trainable parameters (fp32 copies, same placement)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay}: expected 0 < decay < 1")
        self.decay = decay
        self.params = {plain_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.averages = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after optimizer step `step` (1-based)."""
        weight = 1.0 - ema_decay_at(self.decay, step)
        names = list(self.params)
        torch._foreach_lerp_([_local(self.averages[n]) for n in names],
                             [_local(self.params[n].detach()) for n in names], weight)

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self, *, full: bool) -> dict[str, torch.Tensor]:
        """{name: average}: the tensors themselves (shards under FSDP2), or (`full`) whole tensors
        on the CPU, gathered from the shards (a collective under FSDP2: call on every rank)."""
        if not full:
            return dict(self.averages)
        out = {}
        for n, a in self.averages.items():
            whole = a.full_tensor() if hasattr(a, "full_tensor") else a
            out[n] = whole.detach().to("cpu", copy=True)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (a single-file checkpoint, any world size) or tensors placed as
        the averages are (a sharded checkpoint read into `state_dict(full=False)`)."""
        missing, extra = set(self.averages) - set(state), set(state) - set(self.averages)
        if missing or extra:
            raise ValueError(f"EMA state does not fit the model: missing {sorted(missing)[:4]}, "
                             f"unexpected {sorted(extra)[:4]}")
        for n, a in self.averages.items():
            src = state[n]
            if src is a:
                continue
            if hasattr(a, "device_mesh") and not hasattr(src, "device_mesh"):  # whole → this rank's shard
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(a.device, a.dtype), a.device_mesh, a.placements, src_data_rank=None)
            _local(a).copy_(_local(src))

    # --- sampling with the averages --------------------------------------------------------------

    @contextlib.contextmanager
    def swapped_in(self):
        """The model's parameters hold the averages inside the block, their own values after it."""
        with torch.no_grad():
            saved = {n: _local(p).detach().clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                _local(p).copy_(_local(self.averages[n]))
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    _local(p).copy_(saved[n])
