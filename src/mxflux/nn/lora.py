"""LoRA adapters: y = base(x) + (alpha / rank) · up(down(dropout(x))) on chosen linears of a frozen base.

`apply_lora` wraps the linears a recipe's `lora:` block chooses (fnmatch patterns over module names,
as `precision:` chooses) in `LoRALinear`. The adapters are the only trainable parameters: `down`
[rank, in] initialised as peft does (Kaiming-uniform), `up` [out, rank] zero, so the adapted model
starts as the base. They are fp32 master weights like every trained parameter here, computed in the
autocast dtype (bf16); the base runs in its own precision (a `FrozenMXFP6Linear`, or a frozen bf16
nn.Linear). `merge_lora` folds them into a plain model's weights (W + scale · up·down), which is what
the adapters mean to any other loader (`mxflux.model.lora_file`).
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn
from torch.nn import functional as F

from .frozen import FrozenMXFP6Linear

__all__ = ["LoRALinear", "adapted_linears", "add_deltas", "apply_lora", "lora_targets", "merge_lora"]

ADAPTABLE = (nn.Linear, FrozenMXFP6Linear)


class LoRALinear(nn.Module):
    """A frozen `base` linear plus a low-rank update: base(x) + scale · up(down(dropout(x))),
    scale = alpha / rank."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank
        device = next(iter(base.buffers()), None)
        device = device.device if device is not None else next(base.parameters()).device
        self.lora_down = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_up = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))  # peft's default for lora_A
        nn.init.zeros_(self.lora_up.weight)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y + self.lora_up(self.lora_down(self.dropout(x))) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """The update to the base's weight, scale · up · down, fp32 [out, in]."""
        return (self.lora_up.weight.float() @ self.lora_down.weight.float()) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def lora_targets(model: nn.Module, include, exclude=()) -> list[str]:
    """Names of the linears (nn.Linear or FrozenMXFP6Linear) that `include` matches and `exclude` does
    not. ValueError naming the pattern when one matches no linear (a typo would otherwise train
    nothing there), or when nothing is chosen."""
    linears = [name for name, m in model.named_modules() if isinstance(m, ADAPTABLE) and name]
    for field, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
                raise ValueError(f"lora.{field}: pattern {pattern!r} matches no linear of this model (its "
                                 f"linears are named like {', '.join(linears[:4])})")
    chosen = [name for name in linears if any(fnmatch.fnmatchcase(name, p) for p in include)
              and not any(fnmatch.fnmatchcase(name, p) for p in exclude)]
    if not chosen:
        raise ValueError("lora.exclude: excludes every linear lora.include chose; no adapter would be trained")
    return chosen


def apply_lora(model: nn.Module, names, rank: int, alpha: float, dropout: float = 0.0) -> list[str]:
    """Wrap each linear of `names` (`lora_targets`) in a LoRALinear, in place; returns the names."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    return list(names)


def adapted_linears(model: nn.Module) -> dict[str, LoRALinear]:
    """{name of the adapted linear (the base's name before wrapping): its LoRALinear}."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def add_deltas(model: nn.Module, deltas) -> list[str]:
    """Add each (linear's name, weight update [out, in]) of `deltas` to that linear's weight in a plain
    model, in place (one update alive at a time); returns the names. ValueError naming a linear that
    is not there or whose shape the update does not fit."""
    names = []
    for name, delta in deltas:
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{name}: the LoRA adapts a linear this model does not have") from None
        if not isinstance(linear, nn.Linear) or tuple(delta.shape) != tuple(linear.weight.shape):
            raise ValueError(f"{name}: a LoRA update of shape {tuple(delta.shape)} does not fit "
                             f"{type(linear).__name__} {tuple(getattr(linear, 'weight', delta).shape)}")
        linear.weight.add_(delta.to(device=linear.weight.device, dtype=linear.weight.dtype))
        names.append(name)
    return names


def merge_lora(model: nn.Module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> list[str]:
    """Fold adapters {linear's name: (down [rank, in], up [out, rank], scale)} into a plain model's
    weights (W + scale · up · down), in place: what the adapters mean to any other loader, and the
    reference they are tested against."""
    return add_deltas(model, ((name, (up.float() @ down.float()) * scale) for name, (down, up, scale) in adapters.items()))
