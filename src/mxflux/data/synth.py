"""Random datasets in the on-disk format: for loader benchmarks, tests and smoke runs.

The tensors have the statistics of real ones where that is cheap: VAE means such that the
normalised latents (z - 0.1159) * 0.3611 are about unit normal, log-variances in [-6, -2], T5 states
of small magnitude, unit-scale CLIP vectors. They carry no image or text.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .shards import FLUX_VAE_SCALE, FLUX_VAE_SHIFT, DatasetWriter

__all__ = ["write_synthetic"]

_CHUNK = 64  # samples generated at a time: bounds memory for any dataset size


def _random_batch(n: int, *, l_txt: int, d_t5: int, d_clip: int, latent_channels: int, latent_hw: int,
                  g: torch.Generator) -> dict[str, torch.Tensor]:
    latent = (n, latent_channels, latent_hw, latent_hw)
    return {
        "vae_mean": FLUX_VAE_SHIFT + torch.randn(latent, generator=g) / FLUX_VAE_SCALE,
        "vae_logvar": torch.empty(latent).uniform_(-6.0, -2.0, generator=g),
        "t5": 0.25 * torch.randn((n, l_txt, d_t5), generator=g),
        "clip": torch.randn((n, d_clip), generator=g),
    }


def write_synthetic(root: str | os.PathLike, *, n_train: int, n_eval: int, l_txt: int = 256,
                    d_t5: int = 4096, d_clip: int = 768, latent_hw: int = 32, latent_channels: int = 16,
                    seed: int = 0, samples_per_shard: int | None = None) -> Path:
    """Write a random dataset of `n_train` + `n_eval` samples to `root` (defaults: MLPerf dims)."""
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"sample counts must be >= 0, got n_train={n_train}, n_eval={n_eval}")
    dims = dict(l_txt=l_txt, d_t5=d_t5, d_clip=d_clip, latent_channels=latent_channels, latent_hw=latent_hw)
    source = {"kind": "synthetic", "seed": seed, **dims}
    with DatasetWriter(root, **dims, samples_per_shard=samples_per_shard, source=source) as writer:
        for split, count in (("train", n_train), ("eval", n_eval)):
            g = torch.Generator().manual_seed(seed * 2 + (split == "eval"))
            for start in range(0, count, _CHUNK):
                n = min(_CHUNK, count - start)
                batch = _random_batch(n, **dims, g=g)
                if split == "eval":
                    batch["timestep_index"] = torch.arange(start, start + n) % 8
                writer.write(split, batch)
        g = torch.Generator().manual_seed(seed * 2 + 2)
        writer.write_empty_encodings(0.25 * torch.randn((l_txt, d_t5), generator=g),
                                     torch.randn((d_clip,), generator=g))
    return Path(root)
