"""Training: config schema and recipes, the rectified-flow trainer, checkpoints and metrics.

Names are imported from their modules on first use, so that building the CLI parser (which
imports `mxflux.cli`'s command modules) never loads torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__, globals(), {"config": ["RecipeError", "RunConfig", "load_recipe", "recipe_names"]})
