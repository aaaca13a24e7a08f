"""Distributed training through PyTorch's own stack: torchrun + FSDP2 (default) or DDP.

FSDP2 (`fully_shard`) shards each transformer block and the root: parameters are kept sharded
in fp32 (the master copy) and all-gathered in the compute dtype (bf16 by default; fp32 when the
recipe computes in fp32); gradients are reduced in the recipe's `reduce_dtype`. Forward inputs are NOT cast by FSDP: the timesteps must stay fp32
until the ×1000 sinusoidal embedding (a bf16 t would lose the fine timesteps). DDP keeps full
fp32 replicas, computes under bf16 autocast, and all-reduces in buckets of `ddp_bucket_mb`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import DistributedSection

__all__ = ["DistContext", "init_distributed", "wrap_model", "cleanup"]


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str | None = None) -> DistContext:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK), or run alone.

    NCCL on CUDA, gloo on CPU. Each rank takes the GPU of its LOCAL_RANK.
    """
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        return DistContext(0, 1, 0, dev)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                device_id=device if device_type == "cuda" else None)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def wrap_model(model: nn.Module, cfg: DistributedSection, ctx: DistContext, *,
               param_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Shard (FSDP2) or replicate (DDP) `model` across the process group; identity when alone.

    `param_dtype` is the dtype FSDP2 all-gathers parameters in: the trainer's compute dtype.
    """
    if ctx.world_size == 1:
        return model
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                   bucket_cap_mb=cfg.ddp_bucket_mb)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, cfg.reduce_dtype),
                              cast_forward_inputs=False)
    n = cfg.fsdp_blocks_per_unit
    for blocks in (model.double_blocks, model.single_blocks):
        blocks = list(blocks)
        for i in range(0, len(blocks), n):
            unit = blocks[i:i + n]  # one all-gather / reduce-scatter for these blocks together
            fully_shard(unit if len(unit) > 1 else unit[0], mp_policy=mp,
                        reshard_after_forward=cfg.fsdp_reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=cfg.fsdp_reshard_after_forward)
    return model


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
