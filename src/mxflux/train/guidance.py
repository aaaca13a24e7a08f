"""The guidance input of guidance-distilled Flux models (FLUX.1-dev) in training, evaluation and sampling.

FLUX.1-dev was distilled from classifier-free guidance: its guidance embedder (`guidance_in`,
`FluxConfig.guidance_embed`) takes the guidance scale as a second, timestep-like input, and the
model predicts the guided velocity for that scale. Fine-tuning such weights feeds one constant
value for it (`train.distilled_guidance`; kohya's sd-scripts documents 1.0 for training), and the
run's evaluation and samples use the same value, so that they measure the model that is trained.
Models without the embedder (schnell, MLPerf's) have no such input; the recipe schema refuses a
value for them rather than carrying a setting that nothing reads.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_DISTILLED_GUIDANCE", "guidance_input", "sampling_distilled_guidance"]

# FLUX.1-dev's guidance input at inference, as diffusers' FluxPipeline defaults it: what released
# dev weights are sampled with when no run says otherwise (`mxflux sample --weights`).
DEFAULT_DISTILLED_GUIDANCE = 3.5


def guidance_input(value: float | None, batch: int, device: torch.device | str) -> torch.Tensor | None:
    """`Flux.forward`'s `guidance` for a batch: [batch] fp32 filled with `value`; None for None
    (a model without a guidance embedder)."""
    if value is None:
        return None
    return torch.full((batch,), float(value), dtype=torch.float32, device=device)


def sampling_distilled_guidance(guidance_embed: bool, requested: float | None, trained: float | None) -> float | None:
    """The guidance input to sample a model with: `requested` (--distilled-guidance) if given,
    else the value the run trained with (`trained`), else FLUX.1-dev's default; None for a model
    without a guidance embedder, for which a requested value is an error (nothing would read it)."""
    if not guidance_embed:
        if requested is not None:
            raise ValueError(f"--distilled-guidance {requested}: this model has no guidance embedder "
                             "(guidance_embed false, e.g. FLUX.1-schnell); it takes no guidance input")
        return None
    if requested is not None:
        if requested < 0:
            raise ValueError(f"--distilled-guidance: expected a value >= 0, got {requested}")
        return requested
    return trained if trained is not None else DEFAULT_DISTILLED_GUIDANCE
