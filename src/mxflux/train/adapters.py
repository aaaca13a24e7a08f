"""A LoRA run's model: its frozen base, built one block at a time, and the adapters on it.

With `model.init_from` the base never exists whole in fp32: the model is built on the meta device,
and each block in turn is materialised on the training device, given its weights from the file and
frozen (`nn.frozen.freeze_base`: its MX linears to their 1-byte operands, the rest to bf16) before the
next is read, so building flux-12b's base peaks at its frozen size plus one block in fp32, not at
48 GB. (A recipe must name `init_from`, `RunConfig` says why; without it, as benchmarks of random
weights call it, the base is the seeded initialisation, built whole.) The adapters are then added with the run's seed, so the same recipe always starts from the same
adapters on the same base; `base_fingerprint` is recorded in checkpoints, and a resume that rebuilt a
different base (the weights file changed) is refused.
"""

from __future__ import annotations

import torch

from ..model import Flux, check_flux_weights
from ..model.lora_file import save_lora_file
from ..model.weights import FluxCheckpoint, FluxWeightsError, block_of
from ..nn import PrecisionReport, apply_precision
from ..nn.frozen import base_fingerprint, freeze_base
from ..nn.lora import adapted_linears, apply_lora, lora_targets
from .callbacks import Callback
from .config import RecipeError, RunConfig
from .ema import plain_name

__all__ = ["ADAPTERS_FILE", "AdaptersFile", "adapter_tensors", "build_lora_model", "check_same_base"]

ADAPTERS_FILE = "lora.safetensors"  # in the run directory, beside the checkpoints


def build_lora_model(cfg: RunConfig, device: torch.device | str) -> tuple[Flux, PrecisionReport, str]:
    """(the model with its frozen base and fresh adapters on `device`, the precision report, the base's
    fingerprint). RecipeError for a lora pattern that matches nothing."""
    dtype = getattr(torch, cfg.train.compute_dtype)
    torch.manual_seed(cfg.train.seed)
    meta = torch.device("meta") if cfg.model.init_from else torch.device(device)
    with meta:
        model = Flux(cfg.model.flux_config())
    try:
        report = apply_precision(model, cfg.precision)
    except ValueError as e:
        raise RecipeError(f"recipe {cfg.name}: {e}") from None
    if cfg.model.init_from:
        _stream_frozen(model, cfg.model.init_from, device, dtype)
    else:
        freeze_base(model, dtype)
    fingerprint = base_fingerprint(model)
    lora = cfg.lora
    try:
        names = lora_targets(model, lora.include, lora.exclude)
    except ValueError as e:
        raise RecipeError(f"recipe {cfg.name}: {e}") from None
    torch.manual_seed(cfg.train.seed)  # the adapters' initialisation: a function of the seed alone
    apply_lora(model, names, lora.rank, lora.alpha, lora.dropout)
    return model, report, fingerprint


@torch.no_grad()
def _stream_frozen(model: Flux, path: str, device, dtype: torch.dtype) -> None:
    """Materialise `model` (built on meta) unit by unit from the weights at `path`, freezing each unit
    as soon as its weights are in."""
    checkpoint = FluxCheckpoint(path)
    check_flux_weights(checkpoint.shapes, model.config, source=str(checkpoint.path))
    params = {name for name, _ in model.named_parameters()}
    if params != set(checkpoint.shapes):
        raise FluxWeightsError(f"{checkpoint.path}: the model's parameter names differ from Flux's: "
                               f"{sorted(params ^ set(checkpoint.shapes))[:8]}")
    blocks = {f"{kind}.{i}" for kind in ("double_blocks", "single_blocks")
              for i in range(len(getattr(model, kind)))}
    for unit in model.children():  # everything outside the blocks is small: materialised at once
        if unit not in (model.double_blocks, model.single_blocks):
            unit.to_empty(device=device)
    for group in checkpoint.blocks():
        unit_name = block_of(next(iter(group)))
        if unit_name in blocks:
            unit = model.get_submodule(unit_name)
            unit.to_empty(device=device)
            for name, tensor in group.items():
                model.get_parameter(name).copy_(tensor)
            freeze_base(unit, dtype)
        else:
            for name, tensor in group.items():
                model.get_parameter(name).copy_(tensor)
    freeze_base(model, dtype)  # the units outside the blocks (the blocks are frozen already)


def check_same_base(saved: str | None, now: str, run_dir) -> None:
    """Refuse a resume whose rebuilt base differs from the one the checkpoint's adapters trained on."""
    if saved is not None and saved != now:
        raise RecipeError(f"{run_dir}: the run's adapters were trained on another base than the one rebuilt now "
                          f"from model.init_from (its weights changed since): resuming would train them on "
                          f"other weights; restore the original weights or start a new run")


def adapter_tensors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{adapted linear's name: (down, up, scale)} as whole tensors (gathered from FSDP2's shards: a
    collective then, call on every rank)."""
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return {plain_name(name): (whole(m.lora_down.weight.detach()), whole(m.lora_up.weight.detach()), m.scale)
            for name, m in adapted_linears(model).items()}


class AdaptersFile(Callback):
    """Writes the run's adapters (`ADAPTERS_FILE`, diffusers' layout: `model.lora_file`) after every
    checkpoint, so the newest adapters always lie beside the newest checkpoint, ready for diffusers,
    ComfyUI or `mxflux sample --weights BASE --lora FILE`. With the run's EMA, the averages."""

    def on_checkpoint(self, trainer, path) -> None:
        with trainer.sampling_weights():  # copies: the swap back would change views of the parameters
            adapters = {n: (d.clone(), u.clone(), s) for n, (d, u, s) in adapter_tensors(trainer.model).items()}
        if trainer.rank != 0:
            return
        c = trainer.cfg
        save_lora_file(trainer.out_dir / ADAPTERS_FILE, adapters, trainer.model.config, {
            "lora.rank": c.lora.rank, "lora.alpha": c.lora.alpha, "lora.dropout": c.lora.dropout,
            "lora.include": ",".join(c.lora.include), "lora.exclude": ",".join(c.lora.exclude),
            "base_model": c.model.name, "base_weights": c.model.init_from or f"seeded init (train.seed {c.train.seed})",
            "base_precision": c.precision.name, "recipe": c.name, "step": trainer.step, "run_id": trainer.run_id,
            "ema": c.train.ema_decay is not None, "modelspec.architecture": "flux-1/lora", "written_by": "mxflux",
        })
