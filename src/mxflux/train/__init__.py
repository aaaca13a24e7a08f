"""Training: config schema and recipes, the rectified-flow trainer, checkpoints and metrics."""

from .config import RecipeError, RunConfig, load_recipe, recipe_names

__all__ = ["RecipeError", "RunConfig", "load_recipe", "recipe_names"]
