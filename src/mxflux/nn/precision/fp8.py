"""fp8: linears as torchao.float8 `Float8Linear` (the FP8 training people run on Hopper).

`fp8: hybrid` is the classic hybrid FP8 recipe: activations and weights cast to E4M3 (more
mantissa, for the forward GEMM's operands) and the output gradient to E5M2 (more range, for
the two backward GEMMs); every cast is dynamic, from the current amax. `fp8_scaling` picks the
scale granularity, and with it which library recipe this is derived from:

- tensorwise (default): one fp32 scale per tensor. Exactly torchao's default
  `Float8LinearConfig()` (its "tensorwise" recipe, which is hybrid already): fast accumulation
  in the output GEMM only.
- rowwise: one scale per row of each GEMM operand (along the contraction axis), scales rounded
  down to powers of two. torchao's "rowwise" recipe with one change: its gradients are E4M3,
  here they are E5M2, so both scalings run the same hybrid number formats.

`fp8_fast_accumulation: false` turns the output GEMM's fast accumulation off too (torchao's
`gemm_config_output`), so that every GEMM's partial sums are added into fp32 as in the backward
ones and in MXFP6's GEMM contract: the comparison of FP8 with MXFP6 at equal accumulation (the
bench setting `fp8-tensorwise-exact`).

Cost: each linear casts X, W and dY to FP8 (one amax reduction and one cast per operand and
GEMM orientation) and runs three FP8 GEMMs on `torch._scaled_mm`, which needs a CUDA device
of compute capability 8.9 or newer. With row-wise scales torchao runs the two gradient GEMMs
(no fast accumulation) on the tensor-wise kernel and multiplies the scales into the output. On other devices the modules still swap (so recipes
validate and the placement can be tested on the CPU), and the model's first forward raises.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel
from torch import nn

from .registry import PrecisionConverter, register_precision

__all__ = ["FP8Converter", "FP8Options", "FP8_ALIGN", "float8_linear_config", "fp8_unavailability"]

FP8_ALIGN = 16  # torch._scaled_mm needs both GEMM dims of the weight to be multiples of 16
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores


def float8_linear_config(scaling: str, fast_accumulation: bool = True):
    """torchao `Float8LinearConfig` of the hybrid recipe with `scaling` ('tensorwise' | 'rowwise'), the output
    GEMM with fast accumulation (torchao's default) or not."""
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity
    from torchao.float8.config import Float8GemmConfig

    granularity = {"tensorwise": ScalingGranularity.TENSORWISE,
                   "rowwise": ScalingGranularity.AXISWISE}.get(scaling)
    if granularity is None:
        raise ValueError(f"fp8_scaling: expected 'tensorwise' or 'rowwise', got {scaling!r}")
    e4m3 = CastConfig(scaling_granularity=granularity, target_dtype=torch.float8_e4m3fn)
    e5m2 = CastConfig(scaling_granularity=granularity, target_dtype=torch.float8_e5m2)
    return Float8LinearConfig(
        cast_config_input=e4m3,  # X, in fprop and (transposed) in wgrad
        cast_config_weight=e4m3,  # W, in fprop and (transposed) in dgrad
        cast_config_grad_output=e5m2,  # dY, in dgrad and wgrad
        # torchao's own choice per recipe: power-of-two scales for row-wise (their rounding is
        # then exact and equal values quantize alike in forward and backward), not tensor-wise.
        round_scales_to_power_of_2=scaling == "rowwise",
        # the forward GEMM's sums: in the tensor cores' FP8 accumulator (fast) or promoted to fp32 (the two
        # backward GEMMs' default either way)
        gemm_config_output=Float8GemmConfig(use_fast_accum=fast_accumulation),
    )


def fp8_unavailability(device: torch.device) -> str | None:
    """Why torchao float8 training cannot run its GEMMs on `device`, or None if it can."""
    if device.type != "cuda":
        return f"the model is on {device}, not a CUDA GPU"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {cap[0]}.{cap[1]}; "
                f"FP8 tensor cores need {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer")
    return None


def _unavailable_error(why: str) -> RuntimeError:
    return RuntimeError(f"precision.fp8: torchao float8 training cannot run here: {why}. Run this "
                        f"recipe on an Ada/Hopper-class GPU, or select another precision (bf16, fp6)")


class FP8Options(BaseModel):
    """The recipe fields of FP8 on torchao.float8 (`precision.fp8: hybrid` selects it), part of
    `PrecisionConfig`."""

    fp8: Literal["hybrid"] | None = None  # E4M3 activations and weights, E5M2 gradients
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    # torchao's default: the forward GEMM sums in the tensor cores' FP8 accumulator; false: in fp32, as the
    # backward GEMMs and MXFP6's GEMM contract do
    fp8_fast_accumulation: bool = True


@register_precision
class FP8Converter(PrecisionConverter):
    """`fp8: hybrid`: E4M3 forward operands, E5M2 gradients, on torchao.float8."""

    name = "fp8"
    selected_by = "fp8"
    selector_value = "hybrid"
    options = tuple(f for f in FP8Options.model_fields if f != "fp8")

    def ineligibility(self, linear: nn.Linear) -> str | None:
        bad = [f"{n}={v}" for n, v in (("in_features", linear.in_features),
                                        ("out_features", linear.out_features)) if v % FP8_ALIGN]
        return f"{' and '.join(bad)} not a multiple of {FP8_ALIGN}" if bad else None

    def convert(self, model: nn.Module, chosen: dict[str, nn.Linear]) -> dict[str, str]:
        if not chosen:
            return {}
        from torchao.float8 import convert_to_float8_training

        device = next(iter(chosen.values())).weight.device
        if device.type == "cuda" and (why := fp8_unavailability(device)):
            raise _unavailable_error(why)  # the device is known now: fail before anything runs
        convert_to_float8_training(model, config=float8_linear_config(self.cfg.fp8_scaling,
                                                                      self.cfg.fp8_fast_accumulation),
                                   module_filter_fn=lambda _module, fqn: fqn in chosen)
        first = model.get_submodule(next(iter(chosen)))
        _check_device_at_first_forward(model, first)
        return {name: self.name for name in chosen}


def _check_device_at_first_forward(model: nn.Module, probe: nn.Module) -> None:
    """Raise at `model`'s first forward if `probe`'s weight is where FP8 GEMMs cannot run.

    A model converted on the CPU or the meta device is moved before it runs; its device is
    known only then. The hook removes itself after one successful check, so it costs nothing
    per step and never enters a compiled graph.
    """
    def check(_module, _args):
        why = fp8_unavailability(probe.weight.device)
        if why:
            raise _unavailable_error(why)
        handle.remove()

    handle = model.register_forward_pre_hook(check)
