"""Build the model a recipe describes: seeded fp32 init on the training device, then precision.

The order is fixed because the weights must not depend on anything but the recipe: the seed is
set first, the model is initialised where it will train (a 12B model's CPU init takes minutes),
and only then are the chosen linears converted (docs/design.md, "Precisions as converters and
the layer map").
"""

from __future__ import annotations

import torch

from ..model import MX_LINEAR_PATTERNS, Flux
from ..nn import PrecisionReport, apply_precision
from .config import RunConfig

__all__ = ["build_model"]


def build_model(cfg: RunConfig, device: torch.device | str) -> tuple[Flux, PrecisionReport]:
    """The recipe's Flux with fp32 master weights on `device` and its linears converted to the
    recipe's precision; the report says which linears run in which precision."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = Flux(cfg.model.flux_config())
    report = apply_precision(model, cfg.precision, include=MX_LINEAR_PATTERNS)
    return model, report
