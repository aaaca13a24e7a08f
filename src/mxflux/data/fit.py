"""Whether a dataset fits a model: the dims a Flux config reads from every sample.

A Flux model takes T5 states of width `context_in_dim`, a pooled CLIP vector of width
`vec_in_dim` and VAE latents of `in_channels / 4` channels (patchified 2x2, so the latent side
must be even). A dataset fixes all of them in its meta.json. Data written for another model
(the MLPerf-sized `mxflux data synth` defaults under the tiny recipe, say) would otherwise fail
deep in the first forward; `data_model_mismatch` says it in one line that names both sides,
before any work, for `mxflux check-config`, `mxflux train` and `mxflux bench step`.
`dims_for_model` is the other direction: the dims `mxflux data synth --for RECIPE` writes.

The model is read by duck typing (any object with the FluxConfig fields above), so that this
module needs nothing above `mxflux.data`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .shards import read_meta

__all__ = ["DataDims", "dataset_dims", "demo_dims", "dims_for_model", "dims_mismatch", "data_model_mismatch"]


@dataclass(frozen=True)
class DataDims:
    """The per-sample dims of a dataset (the keyword arguments of `write_synthetic`)."""

    l_txt: int  # T5 tokens
    d_t5: int  # T5 width
    d_clip: int  # pooled CLIP width
    latent_channels: int
    latent_hw: int  # latent height = width

    def describe(self) -> str:
        return (f"T5 {self.l_txt}x{self.d_t5}, CLIP {self.d_clip}, "
                f"latent {self.latent_channels}x{self.latent_hw}x{self.latent_hw}")


def dataset_dims(root: str | os.PathLike) -> DataDims:
    """The dims of the dataset at `root`, from its meta.json's train split."""
    tensors = read_meta(root).splits["train"].tensors
    (l_txt, d_t5), (d_clip,) = tensors["t5"].shape, tensors["clip"].shape
    c, h, _w = tensors["vae_mean"].shape
    return DataDims(l_txt=l_txt, d_t5=d_t5, d_clip=d_clip, latent_channels=c, latent_hw=h)


def demo_dims() -> DataDims:
    """The dims of the built-in demo dataset (`data.root: null`)."""
    from .demo import DEMO_CLIP_DIM, DEMO_LATENT_CHANNELS, DEMO_LATENT_HW, DEMO_T5_DIM, DEMO_T5_LEN

    return DataDims(l_txt=DEMO_T5_LEN, d_t5=DEMO_T5_DIM, d_clip=DEMO_CLIP_DIM,
                    latent_channels=DEMO_LATENT_CHANNELS, latent_hw=DEMO_LATENT_HW)


def dims_for_model(mc, *, l_txt: int, latent_hw: int) -> DataDims:
    """Dims that fit the Flux config `mc`, with `l_txt` T5 tokens and latents of side `latent_hw`."""
    if mc.in_channels % 4:
        raise ValueError(f"in_channels {mc.in_channels} is not 4 x latent channels (2x2 patches)")
    return DataDims(l_txt=l_txt, d_t5=mc.context_in_dim, d_clip=mc.vec_in_dim,
                    latent_channels=mc.in_channels // 4, latent_hw=latent_hw)


def _differences(dims: DataDims, mc) -> list[str]:
    out = []
    if dims.d_t5 != mc.context_in_dim:
        out.append(f"T5 width {dims.d_t5} vs context_in_dim {mc.context_in_dim}")
    if dims.d_clip != mc.vec_in_dim:
        out.append(f"CLIP width {dims.d_clip} vs vec_in_dim {mc.vec_in_dim}")
    if dims.latent_channels * 4 != mc.in_channels:
        out.append(f"latent channels {dims.latent_channels} x 4 vs in_channels {mc.in_channels}")
    if dims.latent_hw % 2:
        out.append(f"latent side {dims.latent_hw} is odd (the model patchifies 2x2)")
    return out


def dims_mismatch(dims: DataDims, data: str, mc, *, model_name: str, recipe: str) -> str | None:
    """One line naming `data` (with its dims) and the model when `dims` do not fit the Flux config
    `mc` of `recipe`; None when they fit."""
    diffs = _differences(dims, mc)
    if not diffs:
        return None
    return (f"{data} ({dims.describe()}) does not fit model {model_name} of recipe {recipe}: {'; '.join(diffs)}; "
            f"`mxflux data synth --for {recipe}` writes random data that fits")


def data_model_mismatch(root: str | os.PathLike | None, mc, *, model_name: str, recipe: str) -> str | None:
    """`dims_mismatch` for the dataset at `root` (None: the built-in demo dataset), read from its
    meta.json. A root without a dataset is not judged here (None): reading it reports that."""
    if root is None:
        dims, data = demo_dims(), "the built-in demo dataset (data.root: null)"
    else:
        if not (os.path.isfile(os.path.join(root, "meta.json"))):
            return None
        dims, data = dataset_dims(root), f"data.root {str(root)!r}"
    return dims_mismatch(dims, data, mc, model_name=model_name, recipe=recipe)
