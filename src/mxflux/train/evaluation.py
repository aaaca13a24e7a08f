"""The validation loss of a trainer's model: fixed t = k/8 per sample and fixed noise, so that two
evaluations of the same weights agree bit for bit and any two runs are compared on the same draws."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model import patchify
from .flow import eval_noise, noised, per_sample_mse

__all__ = ["validation_loss"]


@torch.no_grad()
def validation_loss(trainer, max_samples: int | None = None) -> float:
    """sum(loss) / count in fp64 over ranks, on the first `max_samples` (default: the recipe's
    `train.eval_samples`) samples of the trainer's eval split."""
    from ..data import build_loader

    trainer.train_model.eval()
    c = trainer.cfg
    limit = max_samples if max_samples is not None else c.train.eval_samples
    n_total = len(trainer.eval_set) if limit is None else min(limit, len(trainer.eval_set))
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    count = torch.zeros((), dtype=torch.float64, device=trainer.device)
    loader = build_loader(trainer.eval_set, batch_size=c.train.eval_batch_size, rank=trainer.rank,
                          world_size=trainer.world, seed=0, shuffle=False, drop_last=False,
                          num_workers=c.data.num_workers, prefetch_factor=c.data.prefetch_factor,
                          limit=n_total)
    seed = c.train.seed
    for batch in loader:
        idx = batch["index"]
        batch = trainer._to_device(batch)
        mean, logvar = batch["vae_mean"].float(), batch["vae_logvar"].float()
        z = mean + torch.exp(0.5 * logvar) * eval_noise(idx, tuple(mean.shape[1:]), seed + 1, trainer.device)
        x0 = (z - trainer.latent_shift) * trainer.latent_scale
        noise = eval_noise(idx, tuple(x0.shape[1:]), seed + 2, trainer.device)
        t = batch["timestep_index"].float() / 8.0
        x_t, target = noised(x0, noise, t)
        with trainer._autocast():
            pred = trainer.train_model(timesteps=t, **trainer._model_inputs(x_t, batch["t5"], batch["clip"]))
        per = per_sample_mse(pred, patchify(target)).double()
        loss_sum += per.sum()
        count += per.numel()
    if trainer.world > 1:
        dist.all_reduce(loss_sum)
        dist.all_reduce(count)
    trainer.train_model.train()
    return float(loss_sum / count)  # a fresh Python float: it aliases nothing
