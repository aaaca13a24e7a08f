"""The Flux DiT: model, configs, FLOP counts, input packing and checkpoint-name conversion."""

from .configs import FLUX_CONFIGS, FluxConfig, ForwardFlops, flops_per_sample, flux_config, forward_flops
from .convert import diffusers_to_bfl
from .flux import DEFAULT_PRECISION_INCLUDE, Flux, image_ids, patchify, text_ids, unpatchify

__all__ = ["FLUX_CONFIGS", "DEFAULT_PRECISION_INCLUDE", "Flux", "FluxConfig", "ForwardFlops",
           "diffusers_to_bfl", "flops_per_sample", "flux_config", "forward_flops", "image_ids",
           "patchify", "text_ids", "unpatchify"]
