"""Training: config schema and recipes, the rectified-flow trainer, checkpoints and metrics.

Names are imported from their modules on first use, so that building the CLI parser (which
imports `mxflux.train.cli`) never loads torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"config": ["RecipeError", "RunConfig", "load_recipe", "recipe_names"]}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
