"""mxfp6: linears as MXFP6Linear, and fc1 → GELU(tanh) → fc2 MLPs as FusedMXFP6MLP."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, Field, model_validator
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..functional import HELD_HEADROOM
from ..linear import MXFP6Linear, mx_ineligibility, rowwise_mx_linears
from ..mlp import FusedMXFP6MLP, activation_name
from ..weight_state import MXWeightState
from .registry import PrecisionConverter, register_precision, replace_module

__all__ = ["MXFP6Converter", "MXFP6Options"]


class MXFP6Options(BaseModel):
    """The recipe fields of MXFP6 (`precision.fp6: e2m3` selects it), part of `PrecisionConfig`."""

    fp6: Literal["e2m3"] | None = None
    mx_gemm: Literal["rowwise", "blockwise", "exact"] = "rowwise"
    hadamard: bool = True
    fused_mlp: Literal["auto", "on", "off"] = "auto"
    # How forward keeps Xᵀ and Wᵀ for backward: the FP8 GEMM bytes (1 B/element) or 6-bit E2M3
    # codes plus a shift per block (25/32 B/element, expanded in backward to the same bytes, so
    # losses and gradients are bit-identical; docs/design.md, "Saved operands in six bits").
    saved_operands: Literal["e4m3", "e2m3"] = "e4m3"
    # Wᵀ for backward: kept from forward (1 B per weight element) or packed again in backward from
    # the parameter, which is alive anyway (one more read of every weight per step; the same bytes).
    repack_weights: bool = False
    # The MX weights' per-step state written by the optimizer (nn.weight_state.MXWeightState; on
    # CUDA, with optim.implementation: auto and optim.clip_in_optimizer, whose step is the Triton
    # one): the row-granularity e_ref of each weight, so that the next forward's packer skips its
    # first pass over it (false: the packer reads each weight twice) ...
    weight_exponents_in_optimizer: bool = True
    # ... and, with it, the packed MX operands of the MXFP6Linear weights, which their forward then
    # uses instead of packing the weight (the same values; 2 bytes per weight element kept between
    # steps; none with repack_weights, which asks for no weight operand kept through the step).
    weight_operands_in_optimizer: bool = True
    # ... of which Wᵀ (the col operand, 1 byte per weight element, dgrad's) too, or (false) the row
    # operand alone, forward's: backward then packs Wᵀ from the parameter with the kept e_ref (pass 2
    # alone, a read of every MX weight per step). With release_weight_rows nothing of the weights' kept
    # operands is then alive at the step's peak, in backward. The same bits either way.
    kept_weight_cols: bool = True
    # Those operands' row halves (1 byte per weight element) freed from the last micro-batch's
    # forward, which has read them, to the optimizer step, which writes them anew: backward reads Wᵀ
    # alone, and the step's peak lies in between. Where the step allows it (not captured, no per-block
    # CUDA graphs, no checkpointing that runs forward again: `train.build.rows_release_off`). The same
    # bits with or without (tests/gpu/test_weight_erefs.py).
    release_weight_rows: bool = True
    # The MXFP6Linears' input and output gradient packed in one read each (not two): the weight
    # gradient's operands, Xᵀ and dYᵀ, encoded against each column's e_ref from the last step, a binade
    # or two above it (held_headroom_x / _dy), and the columns that outgrew it re-encoded. The
    # same values inside the fold window; the window itself sits that much higher, so a few more blocks
    # fall below it (rounded, and counted in blocks_outside_window). docs/design.md, "The one-pass packer".
    # Off by default: on an H100 its first kernels were not faster than the two passes (0.87x their speed
    # over the Flux widths, the rows' provisional bytes through DRAM); the kernel that re-scales them in
    # pieces was 0.30x on its first H100 call, since mended and not yet timed (benchmarks/NOTES.md).
    held_col_erefs: bool = False
    # With it, the binades above the last step's column maxima at which X's and dY's col operands are
    # encoded (`nn.functional.HELD_HEADROOM`'s defaults): each binade takes one from the exact fold
    # window; each binade less re-encodes more columns that outgrew their prediction.
    held_headroom_x: int = Field(HELD_HEADROOM["x"], ge=0, le=8)
    held_headroom_dy: int = Field(HELD_HEADROOM["dy"], ge=0, le=8)

    @model_validator(mode="after")
    def _headroom_needs_held(self):
        for name in ("held_headroom_x", "held_headroom_dy"):
            if not self.held_col_erefs and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name}: applies to precision.held_col_erefs: true only; set that or remove it")
        return self


def _mlp_activation(module: nn.Module) -> str | None:
    """The activation's name if `module` is exactly nn.Sequential(Linear, activation, Linear) keyed
    '0', '1', '2' (the keys FusedMXFP6MLP keeps); None otherwise."""
    if type(module) is not nn.Sequential or list(module._modules) != ["0", "1", "2"]:
        return None
    if isinstance(module[0], nn.Linear) and isinstance(module[2], nn.Linear):
        return activation_name(module[1])
    return None


@register_precision
class MXFP6Converter(PrecisionConverter):
    """`fp6: e2m3`: E2M3 elements with an E8M0 scale per 32, Hadamard-rotated, on FP8 GEMMs.

    Options: mx_gemm (the fold granularity), hadamard, fused_mlp (auto | on | off: an MLP whose
    two linears are both chosen becomes one FusedMXFP6MLP with the same state-dict keys),
    saved_operands (e4m3 | e2m3: the col operands kept for backward as FP8 bytes or as 6-bit codes),
    repack_weights (backward packs Wᵀ again from the parameter instead of keeping it from forward),
    weight_exponents_in_optimizer / weight_operands_in_optimizer (the optimizer step writes the
    weights' e_ref / packed operands for the next forward), kept_weight_cols (those operands include
    Wᵀ, or backward packs it from the parameter), held_col_erefs (X and dY packed in one read each,
    their columns against the last step's e_ref, held_headroom_x / _dy binades above it).
    """

    name = "mxfp6"
    selected_by = "fp6"
    selector_value = "e2m3"
    options = tuple(f for f in MXFP6Options.model_fields if f != "fp6")
    same_values = ("saved_operands", "repack_weights", "weight_exponents_in_optimizer", "weight_operands_in_optimizer",
                   "kept_weight_cols", "release_weight_rows")

    def ineligibility(self, linear: nn.Linear) -> str | None:
        return mx_ineligibility(linear.in_features, linear.out_features, self.cfg.mx_gemm)

    def convert(self, model: nn.Module, chosen: dict[str, nn.Linear]) -> dict[str, str]:
        mx = dict(mx_gemm=self.cfg.mx_gemm, hadamard=self.cfg.hadamard, saved_operands=self.cfg.saved_operands,
                  repack_weights=self.cfg.repack_weights)
        done: dict[str, str] = {}
        if self.cfg.fused_mlp != "off":
            for name, module in list(model.named_modules()):
                act = _mlp_activation(module)
                if not name or act is None or not {f"{name}.0", f"{name}.2"} <= chosen.keys():
                    continue  # (a model that is itself the MLP keeps its Sequential: nothing to replace it in)
                mlp = FusedMXFP6MLP.from_linears(module[0], module[2], activation=act,
                                                 mode=self.cfg.fused_mlp, **mx)
                replace_module(model, name, mlp)
                for k in ("0", "2"):
                    done[f"{name}.{k}"] = "mxfp6-fused" if mlp.fused else "mxfp6"
        for name, linear in chosen.items():
            if name not in done:
                replace_module(model, name, MXFP6Linear.from_linear(linear, **mx))
                done[name] = "mxfp6"
        if self.cfg.held_col_erefs:
            for m in model.modules():
                if isinstance(m, MXFP6Linear):
                    m.cfg = m.cfg._replace(held_cols=True,
                                           held_headroom=(self.cfg.held_headroom_x, self.cfg.held_headroom_dy))
        return done

    def optimizer_state_off(self, model: nn.Module) -> str | None:
        if not self.cfg.weight_exponents_in_optimizer:
            return "precision.weight_exponents_in_optimizer: false"
        weights = [m.weight for m in rowwise_mx_linears(model)]
        if not weights:
            return "no MXFP6 layer with the row granularity (precision.mx_gemm)"
        sharded = [w for w in weights if isinstance(w, DTensor)]
        if any(w.device_mesh.ndim != 1 or tuple(w.placements) != (Shard(0),) for w in sharded):
            return "the weights are sharded otherwise than by rows over one mesh dimension (FSDP2's)"
        if any(type(w.data) is not torch.Tensor for w in weights if not isinstance(w, DTensor)):
            return "the weights are tensor subclasses the Triton step does not update"
        if not any(w.is_cuda for w in weights):
            return "the Triton step runs on CUDA only"
        return None

    def keeps_operands(self) -> bool:
        """Whether the optimizer step keeps the weights' operands (2 bytes per weight element between
        steps), not only their e_ref. `repack_weights` asks for no weight operand kept through the
        step, so it turns them off: forward and backward then pack each weight with pass 2 alone."""
        return self.cfg.weight_operands_in_optimizer and not self.cfg.repack_weights

    def optimizer_state(self, model: nn.Module, *, min_elements: int = 1) -> MXWeightState | None:
        """The row-granularity MX weights' e_ref (and, with weight_operands_in_optimizer, the
        MXFP6Linear weights' operands), written by the Triton AdamW step (`nn.weight_state`)."""
        if self.optimizer_state_off(model) is not None:
            return None
        state = MXWeightState.of_model(model, keep_operands=self.keeps_operands(), keep_cols=self.cfg.kept_weight_cols,
                                       min_elements=min_elements)
        return state if state.of else None
