"""Whether a dataset's samples fit a model: checked before a model is built (train, check-config).

A Flux model takes 2x2 patches of the VAE latents (in_channels = 4 x latent channels, even
latent height and width), T5 encodings of width context_in_dim and a pooled CLIP vector of
width vec_in_dim. Data that does not fit fails deep inside the first forward with a shape error
of some matmul; this names the dataset, the tensor and the model field instead.
"""

from __future__ import annotations

from .config import RecipeError

__all__ = ["DataModelMismatchError", "check_data_fits_model", "check_data_fits_recipe"]


def _demo_shapes():
    """The built-in demo dataset's sample shapes: latent [C, H, W], t5 [L, D], clip D."""
    from ..data.demo import DEMO_CLIP_DIM, DEMO_LATENT_CHANNELS, DEMO_LATENT_HW, DEMO_T5_DIM, DEMO_T5_LEN

    return (DEMO_LATENT_CHANNELS, DEMO_LATENT_HW, DEMO_LATENT_HW), (DEMO_T5_LEN, DEMO_T5_DIM), DEMO_CLIP_DIM


class DataModelMismatchError(RecipeError):
    """The dataset's sample shapes do not fit the recipe's model."""


def check_data_fits_model(model_section, latent_shape, t5_shape, clip_dim, *, data: str) -> None:
    """Raise DataModelMismatchError naming `data` and the model field for each misfit."""
    cfg = model_section.flux_config()
    c, h, w = latent_shape
    problems = []
    if 4 * c != cfg.in_channels:
        problems.append(f"its latents have {c} channels (vae_mean {list(latent_shape)}), the model takes "
                        f"in_channels {cfg.in_channels} = 4 x {cfg.in_channels / 4:g} latent channels")
    if h % 2 or w % 2:
        problems.append(f"its latents are {h}x{w}, expected an even height and width (2x2 patches)")
    if t5_shape[-1] != cfg.context_in_dim:
        problems.append(f"its T5 encodings are {t5_shape[-1]} wide (t5 {list(t5_shape)}), the model takes "
                        f"context_in_dim {cfg.context_in_dim}")
    if clip_dim != cfg.vec_in_dim:
        problems.append(f"its CLIP vectors are {clip_dim} wide, the model takes vec_in_dim {cfg.vec_in_dim}")
    if problems:
        raise DataModelMismatchError(f"{data} does not fit model {model_section.name}: " + "; ".join(problems)
                                     + " (choose a model config for this data, or data for this model)")


def check_data_fits_recipe(cfg) -> None:
    """`check_data_fits_model` for the recipe's data.root (its meta.json, no sample read); the
    built-in demo's shapes where data.root is null. A dataset that is not there yet is skipped
    (check-config warns about it)."""
    from pathlib import Path

    from ..data.shards import META_FILE, LatentDataset

    if cfg.data.root is None:
        latent, t5, clip = _demo_shapes()
        check_data_fits_model(cfg.model, latent, t5, clip, data="the built-in demo dataset (data.root null)")
        return
    if not (Path(cfg.data.root) / META_FILE).is_file():
        return
    train = LatentDataset(cfg.data.root, "train")
    check_data_fits_model(cfg.model, train.latent_shape, train.t5_shape, train.clip_dim, data=f"data.root {cfg.data.root}")
