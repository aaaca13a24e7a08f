"""How the model runs: activation checkpointing, then torch.compile, then FSDP2 or DDP.

One function, used by `mxflux train`, the `Trainer` and `mxflux bench step` alike, so that a
benchmark times exactly the model a training run trains (docs/design.md, "Distributed
training"). The order is the one that composes:

1. Activation checkpointing wraps each transformer block (`checkpoint_wrapper`): with "full"
   the block's activations are recomputed in backward instead of kept ("attention": but
   attention's outputs; `blocks_keeping_gemm_outputs`: the GEMMs' in the first blocks); with "mx_packers" the
   block runs under a selective-checkpointing policy by which the compiled partitioner recomputes
   the MX packer calls on activations instead of keeping their FP8 column operands
   (`mxflux.nn.recompute`; `mx_packer_rebuilt_ops` says what else, and why); with "elementwise"
   the policy recomputes every op but the GEMMs and attention; with "mx_inputs" the MX linears whose
   input backward can rebuild from what it keeps anyway keep no Xᵀ: the input is rebuilt in backward
   and its Xᵀ packed again (`mx_repacked_inputs`).
2. torch.compile compiles each (wrapped) block in place (`module.compile`), so the recompute
   runs the compiled code too and the parameter names do not change.
3. FSDP2 (`fully_shard`) shards each unit of blocks and then the root, or DDP replicates the
   whole model; alone, neither.

FSDP2 keeps the fp32 parameters sharded (the master copy) and all-gathers them in the compute
dtype; gradients are reduced in the recipe's `reduce_dtype`. Forward inputs are NOT cast by
FSDP: the timesteps must stay fp32 until the x1000 sinusoidal embedding (a bf16 t would lose
the fine timesteps). DDP keeps full fp32 replicas, computes under bf16 autocast, and
all-reduces in buckets of `ddp_bucket_mb`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.layers import DoubleStreamBlock, SingleStreamBlock
from ..nn.frozen import FrozenMXFP6Linear
from ..nn.linear import MXFP6Linear
from ..nn.mlp import FusedMXFP6MLP
from ..nn.recompute import (full_recompute_context, mark_input_repacked, mark_recomputed,
                            mx_packer_checkpoint_context)
from ..ops import static_kernel_launch
from .config import DistributedSection, RunConfig
from .distributed import DistContext

__all__ = ["BLOCK_GRAPHS_ONE_PROCESS", "checkpoint_block", "mx_packer_rebuilt_ops", "mx_repacked_inputs", "parallelize"]

# Why per-block CUDA graphs (cudagraph trees) are one process's: a replay reads the addresses it was
# recorded with, and FSDP2 frees each unit's all-gathered parameters after use and allocates them
# again on the next step; DDP's all-reduce runs from autograd hooks on a stream of its own between
# the blocks' graphs, which no multi-GPU run of this project has checked yet.
BLOCK_GRAPHS_ONE_PROCESS = (
    "model.compile_mode: reduce-overhead (each block replayed as CUDA graphs) runs in one process only, got "
    "world size {world_size}: under FSDP2 the blocks' all-gathered parameters are freed after use and allocated "
    "anew each step, so a replay would read stale addresses; under DDP it is not validated. Use "
    "model.compile_mode: default (the compiled blocks then launch the MX GEMMs from inductor's code)")


def parallelize(model: nn.Module, cfg: RunConfig, ctx: DistContext) -> nn.Module:
    """Apply the recipe's activation checkpointing, compile and data parallelism to `model` (a
    `Flux`, changed in place) and return the module to train with: `model` itself, or its DDP
    wrapper."""
    m = cfg.model
    if m.compile and m.compile_mode == "reduce-overhead" and ctx.world_size > 1:
        raise ValueError(BLOCK_GRAPHS_ONE_PROCESS.format(world_size=ctx.world_size))
    if m.activation_checkpointing != "none":
        kept = m.blocks_keeping_gemm_outputs
        for blocks, n_kept in ((model.double_blocks, kept.double), (model.single_blocks, kept.single)):
            for i, block in enumerate(blocks):
                blocks[i] = checkpoint_block(block, m.activation_checkpointing, keep_gemm_outputs=i < n_kept)
    if m.compile:
        static_kernel_launch()  # where the packers are inlined (MXFLUX_INLINE_PACK=1), inductor launches them
        for block in _blocks(model):
            block.compile(mode=m.compile_mode)
    if ctx.world_size == 1:
        return model
    if cfg.distributed.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # No buffer is a replica of rank 0's: the MX layers' fold-window counters and held column e_refs
        # are each rank's own, and a LoRA run's frozen base (buffers) is loaded by every rank. DDP's
        # default would broadcast them all from rank 0 before every forward: the whole base each step.
        return DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                   bucket_cap_mb=cfg.distributed.ddp_bucket_mb, broadcast_buffers=False)
    _fully_shard(model, cfg.distributed, param_dtype=getattr(torch, cfg.train.compute_dtype))
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [*model.double_blocks, *model.single_blocks]


def mx_packer_rebuilt_ops(block: nn.Module) -> tuple[torch._ops.OpOverload, ...]:
    """The ops of `block` that `activation_checkpointing: mx_packers` rebuilds in backward along
    with the packer calls on its activations: those that build an MX linear's input for it alone.

    Measured on the CPU's inductor (benchmarks/saved_bytes.py, benchmarks/RESULTS.md): in a double
    block every MX input is rebuilt in backward from tensors the block keeps anyway (LayerNorm and
    modulate from the block's inputs, GELU from its input), so recomputing the packers alone keeps
    exactly FP8's bytes. A single block's linear2 reads [attention output, GELU(mlp)]
    concatenated, a tensor built for it alone: recomputing its packer alone made the partitioner
    keep that concatenation in bf16 (2 B per element) instead of its E4M3 Xᵀ (1 B), more than it
    saved. Rebuilding the concatenation and GELU too, from the attention output and GELU's input
    (both kept for their own backward), the single block keeps no activation operand at all: less
    than FP8, which keeps linear2's E4M3 input.
    """
    if isinstance(block, SingleStreamBlock):
        return (torch.ops.aten.cat.default, torch.ops.aten.gelu.default)
    if isinstance(block, DoubleStreamBlock):
        return ()
    raise TypeError(f"activation_checkpointing=mx_packers: no recompute choice for a {type(block).__name__}")


# What builds an MX linear's input from tensors backward keeps anyway, which `mx_inputs` rebuilds: the
# attention output's [B, L, H·D] copy and its slices (proj's inputs in a double block, from what SDPA
# keeps), GELU (fc2's and linear2's part, from the output GELU's backward keeps) and the concatenations (a
# single block's linear2 input; in a double block, q, k and v's of both streams, whose pieces backward keeps
# too: on the CPU's inductor a double block keeps 5 % more without them, benchmarks/saved_bytes.py).
_REBUILT_INPUTS = (torch.ops.aten.clone.default, torch.ops.aten.slice.Tensor, torch.ops.aten.transpose.int,
                   torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.gelu.default,
                   torch.ops.aten.cat.default)


def mx_repacked_inputs(block: nn.Module) -> list[nn.Module]:
    """The MX linears (or fused MLPs, for fc2's input) of `block` whose input `activation_checkpointing:
    mx_inputs` keeps in place of its Xᵀ, and backward packs again: those whose input is built from
    tensors backward keeps anyway, by memory-bound ops it rebuilds (`_REBUILT_INPUTS`): attention's
    proj (the attention output), the MLP's fc2 (GELU of h), a single block's linear2 (attention
    output and GELU concatenated). Not qkv, fc1 and linear1: their input is a LayerNorm's output,
    which backward does not keep (kept in bf16 it would cost 2 B per element against Xᵀ's 1)."""
    if isinstance(block, SingleStreamBlock):
        candidates = [block.linear2]
    elif isinstance(block, DoubleStreamBlock):
        candidates = [block.img_attn.proj, block.txt_attn.proj]
        for mlp in (block.img_mlp, block.txt_mlp):
            candidates.append(mlp if isinstance(mlp, FusedMXFP6MLP) and mlp.fused else mlp[2])
    else:
        raise TypeError(f"activation_checkpointing=mx_inputs: no choice of inputs for a {type(block).__name__}")
    return [m for m in candidates if isinstance(m, (MXFP6Linear, FusedMXFP6MLP))]


def checkpoint_block(block: nn.Module, mode: str, *, keep_gemm_outputs: bool = False) -> nn.Module:
    """`block` wrapped for `model.activation_checkpointing` `mode` ("full", "attention",
    "mx_packers", "elementwise" or "mx_inputs"), in a non-reentrant `torch.utils.checkpoint`
    (`checkpoint_wrapper`: the parameter names do not change); `keep_gemm_outputs` (full and
    attention): the block keeps its linears' GEMM outputs too."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in ("full", "attention", "mx_packers", "elementwise", "mx_inputs"):
        raise ValueError("activation_checkpointing: expected 'full', 'attention', 'mx_packers', 'elementwise' or "
                         f"'mx_inputs', got {mode!r}")
    if keep_gemm_outputs and mode not in ("full", "attention"):
        raise ValueError(f"blocks_keeping_gemm_outputs: applies under 'full' or 'attention', not {mode!r}")
    # In every mode but mx_inputs forward's packer calls run again in backward; marked, they count their
    # fold-window blocks once (`mxflux.nn.functional._forward_counter`). Under mx_inputs none should, and
    # marked they stay the opaque op, which the partitioner never re-runs (an inlined packer it could).
    selective = mode in ("mx_packers", "elementwise")
    mark_recomputed(block, selective=selective)
    if mode == "mx_inputs":  # the inputs' Xᵀ packed in backward from the inputs, rebuilt there
        for m in mx_repacked_inputs(block):  # (TypeError for a block of another kind)
            mark_input_repacked(m)
        return checkpoint_wrapper(block, context_fn=mx_packer_checkpoint_context(_REBUILT_INPUTS, packers=False))
    if not selective:  # every op recomputed, inside the MX linears' autograd.Functions too, but those kept
        mx = any(isinstance(m, (MXFP6Linear, FrozenMXFP6Linear, FusedMXFP6MLP)) for m in block.modules())
        if not (mx or keep_gemm_outputs or mode == "attention"):
            return checkpoint_wrapper(block)
        return checkpoint_wrapper(block, context_fn=full_recompute_context(
            keep_attention=mode == "attention", keep_gemms=keep_gemm_outputs))
    return checkpoint_wrapper(block, context_fn=mx_packer_checkpoint_context(
        mx_packer_rebuilt_ops(block), elementwise=mode == "elementwise"))


def _fully_shard(model: nn.Module, cfg: DistributedSection, *, param_dtype: torch.dtype) -> None:
    """FSDP2 units of `fsdp_blocks_per_unit` consecutive blocks of one kind (one all-gather and
    one reduce-scatter per unit), then the root (embeddings and final layer)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, cfg.reduce_dtype),
                              cast_forward_inputs=False)
    n = cfg.fsdp_blocks_per_unit
    for blocks in (model.double_blocks, model.single_blocks):
        blocks = list(blocks)
        for i in range(0, len(blocks), n):
            unit = blocks[i:i + n]
            fully_shard(unit if len(unit) > 1 else unit[0], mp_policy=mp,
                        reshard_after_forward=cfg.fsdp_reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=cfg.fsdp_reshard_after_forward)
