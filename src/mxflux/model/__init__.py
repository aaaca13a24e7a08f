"""The Flux DiT: model, configs, FLOP counts, input packing, checkpoint-name conversion and loading."""

from .configs import FLUX_CONFIGS, FluxConfig, ForwardFlops, flops_per_sample, flux_config, forward_flops
from .convert import diffusers_to_bfl
from .flux import Flux, image_ids, patchify, text_ids, unpatchify
from .weights import (FluxCheckpoint, FluxWeightsError, check_flux_weights, flux_from_checkpoint,
                      infer_flux_config, init_from_checkpoint, load_flux_weights)

__all__ = ["FLUX_CONFIGS", "Flux", "FluxCheckpoint", "FluxConfig", "FluxWeightsError",
           "ForwardFlops", "check_flux_weights", "diffusers_to_bfl", "flops_per_sample", "flux_config",
           "flux_from_checkpoint", "forward_flops", "image_ids", "infer_flux_config", "init_from_checkpoint",
           "load_flux_weights", "patchify", "text_ids", "unpatchify"]
