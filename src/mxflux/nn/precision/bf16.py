"""bf16: the default precision; every linear stays an nn.Linear computing in the autocast dtype."""

from __future__ import annotations

from torch import nn

from .registry import PrecisionConverter, register_precision

__all__ = ["BF16Converter"]


@register_precision
class BF16Converter(PrecisionConverter):
    """Selected when no other precision is: converts nothing, so the report lists every linear as bf16."""

    name = "bf16"
    selected_by = None

    def convert(self, model: nn.Module, chosen: dict[str, nn.Linear]) -> dict[str, str]:
        return {}
