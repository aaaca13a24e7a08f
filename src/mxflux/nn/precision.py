"""The precision config and policy: which linears run in which precision.

`PrecisionConfig` makes wrong-precision runs unrepresentable, as the seed's
BaseDiffusionConfig does: MXFP6 is its own field (`fp6`), never an overload of `fp8` or
`fp4`, and combinations that would silently run some layers in another precision are rejected
with a message naming both fields. `apply_precision` swaps eligible nn.Linears (and recognised
fc1 → GELU → fc2 MLPs, for the fused path) in place, keeping the Parameters.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn

from .linear import MXFP6Linear, mx_ineligibility
from .mlp import FusedMXFP6MLP, activation_name, resolve_fused_mode

__all__ = ["PrecisionConfig", "PrecisionReport", "apply_precision"]

log = logging.getLogger(__name__)


class PrecisionConfig(BaseModel):
    """The precision block of a recipe. Everything off means bf16."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fp6: Literal["e2m3"] | None = None  # MXFP6 linears
    fp8: Literal["hybrid"] | None = None  # E4M3 forward, E5M2 gradients, row-wise scales
    fp4: Literal["mxfp4", "nvfp4"] | None = None  # not implemented; here so it can be refused
    fp4_to_fp8_switch_iter: int | None = None
    mx_gemm: Literal["rowwise", "blockwise", "exact"] = "rowwise"
    hadamard: bool = True
    fused_mlp: Literal["auto", "on", "off"] = "auto"

    @model_validator(mode="after")
    def _one_precision(self) -> "PrecisionConfig":
        if self.fp6 is not None:
            for other in ("fp8", "fp4", "fp4_to_fp8_switch_iter"):
                if getattr(self, other) is not None:
                    raise ValueError(
                        f"fp6 and {other} are both set: an MXFP6 run cannot also select {other} "
                        f"(the layers it selects would run in another precision); unset one of them"
                    )
        if self.fp4 is not None:
            raise ValueError("fp4: MXFP4/NVFP4 linears are not implemented in mxflux; use fp6 or fp8")
        if self.fp4_to_fp8_switch_iter is not None:
            raise ValueError(
                "fp4_to_fp8_switch_iter: needs fp4, which mxflux does not implement; a switch over "
                "zero fp4 layers would silently never happen"
            )
        return self

    @property
    def name(self) -> str:
        """'mxfp6', 'fp8' or 'bf16'."""
        return "mxfp6" if self.fp6 else "fp8" if self.fp8 else "bf16"

    @classmethod
    def from_name(cls, precision: str, **kwargs) -> "PrecisionConfig":
        presets = {"bf16": {}, "fp8": {"fp8": "hybrid"}, "mxfp6": {"fp6": "e2m3"}}
        if precision not in presets:
            raise ValueError(f"precision: expected one of {sorted(presets)}, got {precision!r}")
        return cls(**presets[precision], **kwargs)


@dataclass
class PrecisionReport:
    """What the policy did: qualified module name → precision, and what stayed bf16 and why."""

    precision: str
    swapped: dict[str, str] = field(default_factory=dict)
    kept_bf16: dict[str, str] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return sum(1 for v in self.swapped.values() if v == kind)


def _selected(name: str, include, exclude) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
        fnmatch.fnmatchcase(name, p) for p in exclude
    )


def _mlp_parts(module: nn.Module):
    """(fc1, activation name, fc2) if `module` is an nn.Sequential(Linear, activation, Linear)."""
    if not isinstance(module, nn.Sequential) or len(module) != 3:
        return None
    fc1, act, fc2 = module[0], module[1], module[2]
    if type(fc1) is nn.Linear and type(fc2) is nn.Linear and activation_name(act):
        return fc1, activation_name(act), fc2
    return None


def apply_precision(
    model: nn.Module,
    precision: str | PrecisionConfig,
    *,
    include: tuple[str, ...] | list[str] = ("*",),
    exclude: tuple[str, ...] | list[str] = (),
) -> PrecisionReport:
    """Swap the selected nn.Linears of `model` for MXFP6Linear in place.

    `include` / `exclude` are glob patterns over qualified module names (as in
    `model.named_modules()`). Selected linears whose shapes do not qualify stay bf16 and are
    reported (logged once each, and in the returned report). With MXFP6 and fused_mlp != "off",
    an nn.Sequential(Linear, activation, Linear) whose two linears are both selected becomes a
    FusedMXFP6MLP with the same state-dict keys.
    """
    cfg = precision if isinstance(precision, PrecisionConfig) else PrecisionConfig.from_name(precision)
    report = PrecisionReport(cfg.name)
    if cfg.name == "bf16":
        return report
    if cfg.name == "fp8":
        raise NotImplementedError("precision fp8: the hand-written FP8Linear is removed; the fp8 precision "
                                  "moves to torchao float8")
    mx_kw = dict(mx_gemm=cfg.mx_gemm, hadamard=cfg.hadamard)
    fused_mode = resolve_fused_mode(cfg.fused_mlp)

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}{child_name}"
            parts = _mlp_parts(child) if cfg.name == "mxfp6" and fused_mode != "off" else None
            if parts and all(_selected(f"{name}.{i}", include, exclude) for i in ("0", "2")):
                fc1, act, fc2 = parts
                why = mx_ineligibility(fc1.in_features, fc1.out_features, cfg.mx_gemm) or (
                    mx_ineligibility(fc2.in_features, fc2.out_features, cfg.mx_gemm))
                if why is None:
                    mlp = FusedMXFP6MLP.from_linears(fc1, fc2, activation=act, mode=fused_mode,
                                                     child_names=("0", "2"), **mx_kw)
                    setattr(parent, child_name, mlp)
                    for i in ("0", "2"):
                        report.swapped[f"{name}.{i}"] = "mxfp6-fused" if mlp.fused else "mxfp6"
                    continue
            if type(child) is nn.Linear:
                if not _selected(name, include, exclude):
                    continue
                why = mx_ineligibility(child.in_features, child.out_features, cfg.mx_gemm)
                new = None if why else MXFP6Linear.from_linear(child, **mx_kw)
                if new is None:
                    report.kept_bf16[name] = why
                    log.warning("%s: %s stays bf16: %s", cfg.name, name, why)
                else:
                    setattr(parent, child_name, new)
                    report.swapped[name] = cfg.name
            else:
                visit(child, f"{name}.")

    visit(model, "")
    return report
