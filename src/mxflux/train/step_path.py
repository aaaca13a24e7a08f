"""How a run's training step runs, as the run reports it (`mxflux train`'s result, "step_path").

What makes a step fast differs by setting, and most of it is chosen silently by the code: whether
the blocks compiled without graph breaks, whether the MX GEMMs and packers are launched from
inductor's code or through the opaque ops, whether the optimizer step keeps the MX weights' e_ref
and operands (else each forward packs its weights with both passes), which kernel takes the optimizer
step (and whether the gradient clipping costs a pass of its own), and which CUDA graphs replay. A user who turns
on FSDP2, accumulation or another optimizer should see which of these still hold and, where one is
off, the field or fact that turns it off, instead of inferring it from a slower step.
"""

from __future__ import annotations

import torch.distributed as dist

from ..kernels.gemm import DEFER_BIAS_MAX_N
from ..kernels.gemm_cute import ACCUMULATION as CUTE_ACCUMULATION
from ..kernels.gemm_cute import BLOCKWISE as CUTE_BLOCKWISE
from ..kernels.gemm_cute import CUTE_GEMM
from ..kernels.gemm_cute import KERNEL as CUTE_KERNEL
from ..kernels.gemm_cute import PROMOTION_PARTS as CUTE_PROMOTION_PARTS
from ..kernels.gemm_cute import available as cute_available
from ..kernels.gemm_cute import tvm_ffi_present as cute_tvm_ffi
from ..ops.custom_ops import DEFER_MIN_DIM, DEFER_MIN_TOKENS, DEFER_SCALES, FORCE_REFERENCE, INLINE_GEMM, INLINE_PACK, static_launch_on
from .build import rows_release_off, weight_state_off
from .optimizer import STEP_KERNELS

__all__ = ["compile_counts", "step_path", "step_path_line"]


def compile_counts() -> dict[str, int]:
    """torch.compile's work in this process so far: graphs compiled and graph breaks."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def _all_ranks(value: dict) -> list[dict]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)  # once per run: a few bytes
    return out


def step_path(trainer) -> dict:
    """The trainer's step as run so far (after its first step the compile counts are final); a
    collective under torchrun (every rank's compile counts)."""
    cfg, device = trainer.cfg, trainer.device
    m = cfg.model
    per_rank = _all_ranks(compile_counts())
    mx = cfg.precision.name == "mxfp6"
    kernels = device.type == "cuda" and not FORCE_REFERENCE
    if not mx:
        gemm = f"none ({cfg.precision.name})"
    elif not m.compile:
        gemm = "opaque op (model.compile: false)"
    elif not kernels:
        gemm = f"opaque op ({'the reference forced' if device.type == 'cuda' else device.type + ' kernels'})"
    elif not INLINE_GEMM:
        gemm = "opaque op (MXFLUX_INLINE_GEMM=0)"
    elif cfg.precision.mx_gemm != "rowwise":
        gemm = f"opaque op (precision.mx_gemm: {cfg.precision.mx_gemm}; only rowwise GEMMs are traced)"
    else:
        gemm = "inline: torch._scaled_mm in inductor's code" + {
            "auto": (f"; bias-free GEMMs with N or K >= {DEFER_MIN_DIM} and >= {DEFER_MIN_TOKENS} tokens tensor-wise, "
                     "their scales applied by the next op"),
            "all": "; bias-free GEMMs tensor-wise, their scales applied by the next op (MXFLUX_DEFER_SCALES=all)",
            "bias": (f"; GEMMs with N or K >= {DEFER_MIN_DIM} tensor-wise, those with a bias (N <= "
                     f"{DEFER_BIAS_MAX_N}) with fp32 sums (MXFLUX_DEFER_SCALES=bias)"),
            "bias-rounded": (f"; GEMMs with N or K >= {DEFER_MIN_DIM} tensor-wise, those with a bias (N <= "
                             f"{DEFER_BIAS_MAX_N}) rounded before it is added (MXFLUX_DEFER_SCALES=bias-rounded)"),
            "none": "; row-scaled (MXFLUX_DEFER_SCALES=none)"}[DEFER_SCALES]
    if not mx or not m.compile or not kernels:
        packers = gemm  # for the same reason
    elif not INLINE_PACK:
        packers = "opaque op (the default; MXFLUX_INLINE_PACK=1 launches them from inductor's code)"
    elif not static_launch_on():
        packers = ("opaque op (inductor's static launch of user kernels is off: mxflux.ops.static_kernel_launch() "
                   "turns it on)")
    elif m.activation_checkpointing != "none":
        packers = (f"opaque op (model.activation_checkpointing: {m.activation_checkpointing}; packer calls stay the "
                   "op the recompute policy sees, which it re-runs only as the mode says)")
    else:
        packers = "inline: the packer kernel launched from inductor's code"
        if cfg.precision.fused_mlp != "off":
            packers += " (the fused MLP's GELU prologues: the opaque op)"
    if mx and kernels and cfg.precision.held_col_erefs:
        packers += ("; the MXFP6Linears' X and dY in one read each, their columns against the last step's e_ref "
                    "(precision.held_col_erefs: the opaque op mx_operands_held)")
    if mx and kernels and CUTE_GEMM.kinds and cfg.precision.mx_gemm == "rowwise":  # eager and compiled alike
        kinds = ",".join(sorted(CUTE_GEMM.kinds))
        which = (f"of >= {CUTE_GEMM.min_tokens} tokens" if CUTE_GEMM.min_tokens else f"computing {kinds}")
        parts = CUTE_PROMOTION_PARTS.get(CUTE_ACCUMULATION)
        summed = ("fast accumulation (all of K in the tensor cores' accumulator, MXFLUX_CUTE_ACCUMULATE=fast)"
                  if CUTE_ACCUMULATION == "fast" else "each k-tile's sums added in fp32" + (
                      f", in {parts} parts of N, each added under the later parts' MMAs "
                      f"(MXFLUX_CUTE_ACCUMULATE={CUTE_ACCUMULATION})" if parts else ""))
        switch = "auto" if CUTE_GEMM.min_tokens else kinds
        where = "" if cute_available() else ", not available here"
        call = ("called through TVM-FFI" if cute_tvm_ffi() else
                "called through the DSL's own convention (more host time per call: apache-tvm-ffi not installed)")
        kernel = ("the CuTe-DSL row-scaled GEMM" if CUTE_KERNEL == "rowwise" else
                  f"quack-kernels' {CUTE_KERNEL.removeprefix('quack-')} GEMM with our epilogue "
                  f"(MXFLUX_CUTE_KERNEL={CUTE_KERNEL})")
        gemm += (f"; those {which} with M and N in whole tile clusters, before either, on {kernel}, {summed}, "
                 f"{call} (MXFLUX_CUTE_GEMM={switch}{where})")
    if mx and kernels and cfg.precision.mx_gemm == "blockwise":
        gemm += ("; on the CuTe-DSL GEMM with block scales at the promotion (MXFLUX_CUTE_BLOCKWISE=on"
                 f"{'' if cute_available() else ', not available here'})" if CUTE_BLOCKWISE == "on" else
                 "; on cuBLAS's 1x128 block-scaled GEMM (MXFLUX_CUTE_BLOCKWISE=off)")
    state = getattr(trainer.optimizer, "weight_state", None)
    if not mx:
        weights = f"none ({cfg.precision.name})"
    elif cfg.lora is not None:
        weights = ("frozen base: each MX weight kept as its fprop operand from the start (1 byte per weight), its "
                   "dgrad operand rebuilt from those bytes in each backward; the adapters trained in bf16")
    elif state is not None:
        weights = f"kept by the optimizer step ({len(state.of)} weights"
        if not state.kept:
            if cfg.precision.repack_weights:
                why = "precision.repack_weights: true"
            elif not cfg.precision.weight_operands_in_optimizer:
                why = "precision.weight_operands_in_optimizer: false"
            else:
                why = "the weights are FSDP2 shards: their operands would have to be gathered in their place"
            weights += f": their e_ref only, each forward packs them with pass 2 ({why})"
        else:
            rows = sum(k.operands[0].numel() for k in state.kept.values()) / 2**30
            weights += (f"; their row operands, {rows:.2f} GiB, freed from the last micro-batch's forward to the step"
                        if getattr(trainer.optimizer, "releases_rows", False) else
                        f"; their row operands, {rows:.2f} GiB, kept from forward to the step: "
                        f"{rows_release_off(cfg) or 'the optimizer was not built by the trainer'}")
            if not state.keep_cols:
                weights += "; Wᵀ packed in each backward from the weight (precision.kept_weight_cols: false)"
        weights += ")"
    else:
        why = weight_state_off(cfg, trainer.model) or "no weight qualifies (Triton missing or the reference forced)"
        weights = f"packed each forward: {why}"
    last = getattr(trainer.optimizer, "last_step", None)
    optimizer = STEP_KERNELS.get(last, "not stepped yet")
    if last is not None and last not in ("triton", "triton_shards"):
        o = cfg.optim
        if o.implementation != "auto":
            optimizer += f" (optim.implementation: {o.implementation}; auto takes our Triton kernel on CUDA)"
        elif not o.clip_in_optimizer:
            optimizer += " (optim.clip_in_optimizer: false)"
        else:
            optimizer += " (our Triton kernel needs fp32 parameters on one CUDA device, plain or FSDP2 shards)"
    if cfg.train.cuda_graph:
        graphs = "the whole step captured (train.cuda_graph)"
    elif trainer.block_graphs.on:
        graphs = "per block (model.compile_mode: reduce-overhead)"
    else:
        graphs = "none"
    return {
        "compiled": f"per block, mode {m.compile_mode}" if m.compile else "no (model.compile: false)",
        "graphs": [r["graphs"] for r in per_rank],
        "graph_breaks": [r["graph_breaks"] for r in per_rank],
        "mx_gemm": gemm,
        "mx_packers": packers,
        "mx_weights": weights,
        "optimizer": optimizer,
        "cuda_graphs": graphs,
        "accumulation": trainer.accum,
        "world_size": trainer.world,
    }


def step_path_line(path: dict, device_type: str = "cuda") -> str:
    """One line for the console; on a CPU a short one (the GPU-only parts say nothing there)."""
    compiled = path["compiled"]
    if device_type == "cpu":
        optimizer = path.get("optimizer", "not reported").split(" (")[0]
        return f"step: on the CPU, compiled {compiled}; optimizer {optimizer}"
    if not compiled.startswith("no"):
        breaks = max(path["graph_breaks"])
        compiled += f", {breaks} graph break(s) on some rank" if breaks else ", 0 graph breaks"
    return (f"step: compiled {compiled}; MX GEMMs {path['mx_gemm']}; MX packers {path['mx_packers']}; "
            f"MX weights {path['mx_weights']}; optimizer {path.get('optimizer', 'not reported')}; "
            f"CUDA graphs {path['cuda_graphs']}")
