"""Rectified flow as in the MLPerf reference (torchtitan Flux), and its Euler sampler.

x_t = (1 − t)·x0 + t·ε with t ~ U(0, 1) (optionally shifted: `shift_time`); the model predicts the velocity ε − x0, and the loss
is its fp32 MSE. x0 is resampled every step from the stored VAE posterior (mean, logvar) and
normalised as (z − shift)·scale. Evaluation uses fixed timesteps t = k/8 per sample and fixed
noise, so the validation loss is a deterministic function of the weights.
"""

from __future__ import annotations

import torch

__all__ = ["sample_latents", "noised", "cfg_dropout", "per_sample_mse", "euler_sample", "eval_noise", "shift_time"]


def sample_latents(mean: torch.Tensor, logvar: torch.Tensor, shift: float, scale: float,
                   generator: torch.Generator | None = None, *, eps: torch.Tensor | None = None) -> torch.Tensor:
    """z ~ N(mean, exp(logvar)) in fp32, then (z − shift)·scale; `eps` gives the N(0, 1) draws."""
    mean, std = mean.float(), torch.exp(0.5 * logvar.float())
    if eps is None:
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
    return (mean + std * eps - shift) * scale


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Times moved towards the noise end: s·t / (1 + (s − 1)·t) (SD3's and Flux's timestep shift).

    1 is the identity; s > 1 spends more of training, or of the sampler's steps, at high noise,
    where a picture's layout is decided (t = 1/2 maps to s/(1 + s)). 0 and 1 stay fixed.
    """
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, target) for per-sample times t [B]: x_t = (1 − t)·x0 + t·ε, target = ε − x0."""
    tb = t.float().view(-1, *([1] * (x0.dim() - 1)))
    return (1 - tb) * x0 + tb * noise, noise - x0


def cfg_dropout(t5: torch.Tensor, clip: torch.Tensor, t5_empty: torch.Tensor, clip_empty: torch.Tensor,
                p: float, generator: torch.Generator | None = None, *,
                drop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each sample's encodings by the empty prompt's with probability p (or where the
    bool [B] `drop` is set, when given).

    The empty encodings must already live on the device in the compute dtype (moved once at
    setup): a per-step host→device copy would break CUDA-graph capture.
    """
    if p <= 0:
        return t5, clip
    if drop is None:
        drop = torch.rand(t5.shape[0], generator=generator, device=t5.device) < p
    t5 = torch.where(drop.view(-1, 1, 1), t5_empty.to(t5.dtype).expand_as(t5), t5)
    clip = torch.where(drop.view(-1, 1), clip_empty.to(clip.dtype).expand_as(clip), clip)
    return t5, clip


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample, in fp32: [B]."""
    return (pred.float() - target.float()).square().flatten(1).mean(dim=1)


def eval_noise(indices: torch.Tensor, shape: tuple[int, ...], seed: int, device) -> torch.Tensor:
    """Fixed noise per eval sample (keyed by its dataset index): evaluation is deterministic."""
    out = torch.empty((len(indices), *shape), dtype=torch.float32)
    for i, idx in enumerate(indices.tolist()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(idx))
        out[i] = torch.randn(shape, generator=g)
    return out.to(device)


@torch.no_grad()
def euler_sample(velocity, noise: torch.Tensor, steps: int, shift: float = 1.0) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t = 1 (noise) to t = 0 (data) with `steps` Euler steps,
    at times `shift_time` of an even grid (shift 1: evenly spaced).

    `velocity(x, t)` returns the model's prediction of ε − x0 for a batch at times t [B].
    """
    x = noise.float()
    ts = shift_time(torch.linspace(1.0, 0.0, steps + 1, device=x.device), shift)
    for t_cur, t_next in zip(ts[:-1], ts[1:]):
        t = torch.full((x.shape[0],), float(t_cur), device=x.device)
        x = x + (t_next - t_cur) * velocity(x, t).float()
    return x
