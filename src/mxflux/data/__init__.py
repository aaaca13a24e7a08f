"""Training data: the on-disk latent dataset format, its reader and loader, and dataset builders.

- `shards`:  the format (docs/DATA_FORMAT.md): `DatasetWriter`, `LatentDataset`, `load_empty_encodings`
- `loader`:  `build_loader`: deterministic, rank-sharded, resumable batches
- `synth`:   `write_synthetic`: random datasets at any dims (benchmarks, tests)
- `demo`:    the built-in demo dataset of captioned shapes, with its exact "VAE" and "text encoder"
- `prepare`: encode images + captions with a real VAE, T5 and CLIP (needs the `prepare` extra)
- `cli`:     the `mxflux data ...` subcommands

Importing this package is cheap: names are imported from their modules (and torch with them) on
first use, so that `mxflux --help` never loads torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "shards": ["DataError", "DatasetExistsError", "DatasetFormatError", "DatasetNotFoundError", "DatasetWriter",
               "LatentDataset", "FLUX_VAE_SCALE", "FLUX_VAE_SHIFT", "load_empty_encodings", "read_meta"],
    "loader": ["build_loader", "num_batches", "plan_batches"],
    "synth": ["write_synthetic"],
    "demo": ["build_demo_dataset", "decode_demo_latents", "encode_demo_images", "encode_demo_prompts",
             "ensure_demo_dataset", "render_demo_images"],
    "prepare": ["prepare_dataset"],
})
