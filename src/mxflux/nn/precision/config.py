"""`PrecisionConfig`: the `precision:` block of a recipe, validated so a wrong-precision run cannot start.

Which precision runs is chosen by one selector field per precision (`fp6: e2m3` is MXFP6,
`fp8: hybrid` is FP8, none is bf16); the other fields are options that belong to exactly one
precision (`PrecisionConverter.options`, declared with the converter: `MXFP6Options`,
`FP8Options`), and setting an option of a precision the recipe does
not select to anything but its default is an error, not a silently ignored line. `include` / `exclude` choose the layers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, model_validator

from .default_layers import DEFAULT_PRECISION_INCLUDE
from .fp8 import FP8Options
from .mxfp6 import MXFP6Options
from .registry import converter_class, registered_precisions, selected_precision

__all__ = ["PrecisionConfig"]


class PrecisionConfig(MXFP6Options, FP8Options):
    """The precision block of a recipe: the layer choice here, each precision's selector and options
    from its converter's module (`MXFP6Options`, `FP8Options`). Nothing selected means bf16."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Layer choice, shared by every precision: fnmatch patterns over qualified module names
    # (`model.named_modules()`). A linear runs in the selected precision if some include pattern
    # matches it, no exclude pattern does, and its shape qualifies.
    include: tuple[str, ...] = DEFAULT_PRECISION_INCLUDE
    exclude: tuple[str, ...] = ()

    # Refused with a message: named here so a recipe written for another trainer fails clearly.
    fp4: Literal["mxfp4", "nvfp4"] | None = None
    fp4_to_fp8_switch_iter: int | None = None

    @model_validator(mode="after")
    def _one_precision(self) -> "PrecisionConfig":
        if self.fp4 is not None:
            raise ValueError("fp4: MXFP4/NVFP4 linears are not implemented in mxflux; use fp6 or fp8")
        if self.fp4_to_fp8_switch_iter is not None:
            raise ValueError(
                "fp4_to_fp8_switch_iter: needs fp4, which mxflux does not implement; a switch over "
                "zero fp4 layers would silently never happen")
        selectors = [c.selected_by for c in map(converter_class, registered_precisions())
                     if c.selected_by and getattr(self, c.selected_by) is not None]
        if len(selectors) > 1:
            raise ValueError(
                f"{selectors[0]} and {selectors[1]} are both set: one run has one precision (the "
                f"layers one selects would run in the other); unset one of them")
        chosen = self.name
        for name in registered_precisions():
            if name == chosen:
                continue
            for option in converter_class(name).options:
                # Non-default only: a dumped config (checkpoints, check-config) lists every field.
                if getattr(self, option) != type(self).model_fields[option].default:
                    raise ValueError(f"{option}: an option of precision {name}, but this recipe "
                                     f"runs {chosen}; remove it or select {name}")
        if not self.include:
            raise ValueError("include: empty, so no linear could run in the selected precision; "
                             "leave it out for the model's default set")
        return self

    @property
    def name(self) -> str:
        """The selected precision: 'mxfp6', 'fp8' or 'bf16' (MLPerf logs and reports read it)."""
        return selected_precision(self)

    def converter(self):
        """The selected precision's converter (`PrecisionConverter`), holding this config."""
        return converter_class(self.name)(self)

    @classmethod
    def from_name(cls, precision: str, **kwargs) -> "PrecisionConfig":
        """The config selecting precision `precision` ('bf16', 'fp8', 'mxfp6') with its default selector value."""
        if precision not in registered_precisions():
            raise ValueError(f"precision: expected one of {sorted(registered_precisions())}, got {precision!r}")
        c = converter_class(precision)
        return cls(**({c.selected_by: c.selector_value} if c.selected_by else {}), **kwargs)
