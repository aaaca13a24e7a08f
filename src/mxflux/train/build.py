"""Build the model a recipe describes (seeded fp32 init on the training device, then precision),
and its optimizer.

The order is fixed because the weights must not depend on anything but the recipe: the seed is
set first, the model is initialised where it will train (a 12B model's CPU init takes minutes),
and only then are the chosen linears converted (docs/design.md, "Precisions as converters and
the layer map").
"""

from __future__ import annotations

import torch

from ..model import Flux, init_from_checkpoint
from ..nn import PrecisionReport, apply_precision
from . import adamw_cuda
from .config import RecipeError, RunConfig
from .optimizer import ClippingAdamW
from .parallelize import parallelize

__all__ = ["build_model", "build_optimizer", "build_training_model", "rows_release_off", "weight_state_off"]


def build_model(cfg: RunConfig, device: torch.device | str) -> tuple[Flux, PrecisionReport]:
    """The recipe's Flux with fp32 master weights on `device` and its linears converted to the
    recipe's precision; the report says which linears run in which precision."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = Flux(cfg.model.flux_config())
    try:
        report = apply_precision(model, cfg.precision)
    except ValueError as e:  # a pattern that matches no linear of this model: the recipe's mistake
        raise RecipeError(f"recipe {cfg.name}: {e}") from None
    return model, report


def build_training_model(cfg: RunConfig, ctx, device) -> tuple[Flux, torch.nn.Module, PrecisionReport, str | None]:
    """(the model, the module to train with: the model or its DDP wrapper, the precision report, the
    frozen base's fingerprint for a LoRA run, else None). The whole model: built, parallelized, then
    given `model.init_from`'s weights (under FSDP2 each rank then reads only its own shards). A LoRA
    run (`lora:`): its frozen base and adapters (`train.adapters`), then parallelized."""
    if cfg.lora is not None:
        from .adapters import build_lora_model

        model, report, fingerprint = build_lora_model(cfg, device)
        return model, parallelize(model, cfg, ctx), report, fingerprint
    model, report = build_model(cfg, device)
    train_model = parallelize(model, cfg, ctx)
    if cfg.model.init_from:
        init_from_checkpoint(model, cfg.model.init_from)
    return model, train_model, report, None


def build_optimizer(cfg: RunConfig, model: torch.nn.Module, *, capturable: bool = False) -> ClippingAdamW:
    """The recipe's AdamW over `model`'s parameters. `implementation: auto` is torch's fused kernel
    (on the CPU 4x faster than the per-parameter loop: the demo model, 2 cores, 2.0 against 8.6 ms
    per step), with our Triton kernel for the large fp32 CUDA parameters when the step carries the
    clipping factor (`train.optimizer`, `train.adamw_cuda`); `fused` is torch's kernel throughout.
    `capturable`: step counts kept on the device, so that a step can be captured in a CUDA graph.
    With MXFP6's `precision.weight_exponents_in_optimizer` (and the clipping in the optimizer, whose
    step is the Triton one) the step also computes the MX weights' e_ref for the packer, and with
    `precision.weight_operands_in_optimizer` the MXFP6Linear weights' operands for their forward."""
    o = cfg.optim
    impl = "fused" if o.implementation == "auto" else o.implementation
    extra = {"capturable": True} if capturable else {}
    trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA run's adapters only
    optimizer = ClippingAdamW(trained, kernel="triton" if o.implementation == "auto" else "torch",
                              lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                              **{impl: True}, **extra)
    if _triton_step_off(cfg) is None:
        # what the precision keeps between steps, written by the Triton step (min_elements: the
        # parameters it updates)
        state = cfg.precision.converter().optimizer_state(model, min_elements=adamw_cuda.LARGE)
        if state is not None:
            optimizer.weight_state = state
            state.install(model)  # compiled blocks read it unchecked: up to date before each forward
            optimizer.releases_rows = bool(state.kept) and rows_release_off(cfg) is None
    return optimizer


def rows_release_off(cfg: RunConfig) -> str | None:
    """Why the kept weights' row operands stay allocated from forward to the optimizer step (the field
    to change); None where the trainer frees them after the last micro-batch's forward
    (`precision.release_weight_rows`): only where nothing reads them between the two."""
    m = cfg.model
    if not cfg.precision.release_weight_rows:
        return "precision.release_weight_rows: false"
    if cfg.train.cuda_graph:
        return "train.cuda_graph: true (the captured step reads them at fixed addresses)"
    if m.compile and m.compile_mode == "reduce-overhead":
        return "model.compile_mode: reduce-overhead (the blocks' CUDA graphs read them at fixed addresses)"
    if m.activation_checkpointing in ("full", "attention"):
        return f"model.activation_checkpointing: {m.activation_checkpointing} (backward runs the GEMMs' forward again)"
    return None


def _triton_step_off(cfg: RunConfig) -> str | None:
    """Why the optimizer's step is torch's, not the Triton one that writes a precision's per-step state."""
    o = cfg.optim
    if o.implementation != "auto":
        return f"optim.implementation: {o.implementation} (torch's step; the Triton one writes the state)"
    if not o.clip_in_optimizer:
        return "optim.clip_in_optimizer: false (torch's step; the Triton one writes the state)"
    return None


def weight_state_off(cfg: RunConfig, model: torch.nn.Module) -> str | None:
    """Why the optimizer step cannot keep the precision's per-step state (for MXFP6 the weights'
    e_ref and operands, without which each forward packs its weights with both passes), as the
    field or fact to change; None when it can. `model` as the optimizer sees it: after FSDP2 has
    sharded it."""
    return _triton_step_off(cfg) or cfg.precision.converter().optimizer_state_off(model)
