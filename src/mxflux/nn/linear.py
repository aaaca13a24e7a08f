"""MXFP6Linear: a drop-in nn.Linear whose three GEMMs run in MXFP6 (same parameters, same state dict)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..mx import FoldGranularity
from .functional import SAVED_OPERANDS, MXConfig, mx_linear

__all__ = ["MXFP6Linear", "mx_ineligibility", "output_dtype", "rowwise_mx_linears"]


def mx_ineligibility(in_features: int, out_features: int, mx_gemm: str = "rowwise") -> str | None:
    """Why a linear of this shape cannot run in MXFP6 with this GEMM mode, or None if it can.

    in_features is fprop's contraction axis and out_features dgrad's, so both must hold whole
    32-element blocks, and whole fold groups when the fold is per 128 elements (block-wise mode);
    the token axis (wgrad's contraction) is zero-padded, which is exact
    (docs/design.md, "The three GEMMs and their operands").
    """
    multiple = FoldGranularity.from_mx_gemm(mx_gemm).row_multiple
    bad = [f"{n}={v}" for n, v in (("in_features", in_features), ("out_features", out_features))
           if v % multiple]
    return f"{' and '.join(bad)} not a multiple of {multiple}" if bad else None


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an MX layer returns: autocast's dtype where autocast is on, as nn.Linear does
    under autocast, else the input's.

    Returning the input's dtype under autocast would hand fp32 activations (a LayerNorm's or
    modulation's output) to everything downstream: every elementwise op after the GEMM would move
    twice the bytes, and the ops that save their input for backward (GELU, QK-norm, the gates)
    would keep fp32 copies, so the MXFP6 model would hold more memory than the bf16 one
    (docs/design.md, "Precisions as converters and the layer map").
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def as_2d(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x as [tokens, features] and the leading dims to restore afterwards."""
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class MXFP6Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in MXFP6 (E2M3 elements, E8M0 scale per 32, Hadamard-rotated).

    Y = X·Wᵀ + b with X, W and, in backward, dY quantized along each GEMM's contraction axis and
    multiplied as exact FP8 row-wise GEMMs (docs/design.md, "The exact FP8 fold and its window").
    Compute is bf16: the packer rounds fp32 master weights to bf16 as it reads them, and their
    gradients come back in fp32 straight from the GEMM's accumulator. Cost per call:
    three quantize-and-fold passes over X, W and dY (memory-bound) plus three FP8 GEMMs.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 mx_gemm: str = "rowwise", hadamard: bool = True, saved_operands: str = "e4m3",
                 repack_weights: bool = False):
        self._check_shape(in_features, out_features, mx_gemm)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(mx_gemm, hadamard, saved_operands, repack_weights)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, mx_gemm: str = "rowwise", hadamard: bool = True,
                    saved_operands: str = "e4m3", repack_weights: bool = False) -> "MXFP6Linear":
        """An MXFP6Linear sharing `linear`'s weight and bias Parameters (no copy)."""
        cls._check_shape(linear.in_features, linear.out_features, mx_gemm)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._setup(mx_gemm, hadamard, saved_operands, repack_weights)
        return new

    @staticmethod
    def _check_shape(in_features: int, out_features: int, mx_gemm: str) -> None:
        reason = mx_ineligibility(in_features, out_features, mx_gemm)
        if reason:
            raise ValueError(f"MXFP6Linear with mx_gemm={mx_gemm!r}: {reason}")

    def _setup(self, mx_gemm: str, hadamard: bool, saved_operands: str, repack_weights: bool) -> None:
        if saved_operands not in SAVED_OPERANDS:
            raise ValueError(f"saved_operands: expected one of {SAVED_OPERANDS}, got {saved_operands!r}")
        if not isinstance(repack_weights, bool):
            raise ValueError(f"repack_weights: expected a bool, got {repack_weights!r}")
        self.cfg = MXConfig(mx_gemm, bool(hadamard), saved_operands, repack_weights)
        # Device-side count of blocks that fell outside the FP8 fold window; read it only when
        # reporting, so training never waits on the device for it
        # (docs/design.md, "The exact FP8 fold and its window").
        self.register_buffer("blocks_outside_window", torch.zeros(1, dtype=torch.int64,
                                                                device=self.weight.device),
                             persistent=False)
        # What the optimizer step keeps of the weight between steps, attached by its owner
        # (`mxflux.nn.weight_state.MXWeightState`): the e_ref, the packed operands, and the weight's
        # version they were computed from. Plain tensors; None: forward packs the weight itself.
        # The last call's e_ref of the input's and of the output gradient's columns (e_ref + 128, 0 for
        # none), which `cfg.held_cols` packs those col operands against (`mx_linear`'s `held`). Not in
        # the state dict: the trainer's checkpoint carries them (`mxflux.train.held_erefs`); a model
        # loaded alone starts from none (its first step re-encodes every column against its own e_ref).
        self.register_buffer("x_col_erefs", torch.zeros(self.in_features, dtype=torch.int32,
                                                        device=self.weight.device), persistent=False)
        self.register_buffer("dy_col_erefs", torch.zeros(self.out_features, dtype=torch.int32,
                                                         device=self.weight.device), persistent=False)
        self.weight_erefs: torch.Tensor | None = None
        self.weight_operands: tuple[torch.Tensor, ...] | None = None
        self.weight_state_version: int | tuple[int, int] | None = None  # `weight_version` of the weight
        object.__setattr__(self, "weight_state_param", None)  # the parameter that version is of (the owner's)

    def kept_weight_state(self) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """(e_ref, operands) of the weight to use in this forward, or None each.

        Eagerly, only while the weight's version (the owner's parameter: under FSDP2 the shard, not the
        gathered weight forward sees) is the one they were computed from: after any
        write through torch (`copy_`, `load_state_dict`, an EMA swap) forward packs the weight itself
        (the same bits) until the owner computes them again. Compiled, the version cannot be read,
        so they are used as attached: the owner brings them up to date before each forward of the
        model (its forward pre-hook) and before each replay of a captured step."""
        if self.weight_state_version is None:
            return None, None
        source = self.weight if self.weight_state_param is None else self.weight_state_param
        if not torch.compiler.is_compiling() and weight_version(source) != self.weight_state_version:
            return None, None
        return self.weight_erefs, self.weight_operands

    def holds_col_erefs(self) -> bool:
        """Whether forward and backward pack X and dY against the kept column e_ref (`cfg.held_cols`):
        the row granularity, and a forward that runs once (one recomputed in backward would see the
        e_ref its first run left, and pack otherwise)."""
        cfg = self.cfg
        return cfg.held_cols and cfg.granularity is FoldGranularity.ROWWISE and not cfg.recomputed

    def compute_params(self, x: torch.Tensor):
        """(x in bf16, the dtype every MX GEMM takes its inputs in; weight; bias). The parameters
        go in their own dtype, which the Function returns their gradients in."""
        return x.to(torch.bfloat16), self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"MXFP6Linear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        x2, lead = as_2d(x)
        erefs, operands = self.kept_weight_state()
        held = (self.x_col_erefs, self.dy_col_erefs) if self.holds_col_erefs() else None
        y = mx_linear(*self.compute_params(x2), self.blocks_outside_window, self.cfg, operands, erefs, held)
        return y.reshape(*lead, self.out_features).to(output_dtype(x))

    def extra_repr(self) -> str:
        saved = "" if self.cfg.saved_operands == "e4m3" else f", saved_operands={self.cfg.saved_operands}"
        repack = ", repack_weights=True" if self.cfg.repack_weights else ""
        recomputed = ", recomputed=True" if self.cfg.recomputed else ""
        held = ", held_cols=True" if self.cfg.held_cols else ""
        return (f"{super().extra_repr()}, mx_gemm={self.cfg.mx_gemm}, hadamard={self.cfg.hadamard}{saved}{repack}"
                f"{recomputed}{held}")


def weight_version(p: torch.Tensor) -> int | tuple[int, int]:
    """What changes with every write to a weight's values through torch: its version counter; for a
    DTensor (an FSDP2 shard) its own and its local tensor's, since a write through `to_local()` (the
    weight EMA's swap, a checkpoint load into the shard) bumps only the local one."""
    if isinstance(p, DTensor):
        return p._version, p.to_local()._version
    return p._version


def rowwise_mx_linears(model: nn.Module) -> list[MXFP6Linear]:
    """Every MXFP6Linear in `model` (those inside a FusedMXFP6MLP included) whose GEMMs use the row
    granularity: those whose weight's e_ref an optimizer step can keep for the packer
    (`mxflux.nn.weight_state`)."""
    return [m for m in model.modules() if isinstance(m, MXFP6Linear) and m.cfg.granularity is FoldGranularity.ROWWISE]
