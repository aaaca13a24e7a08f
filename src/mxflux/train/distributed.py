"""The process group: torchrun's environment (RANK/WORLD_SIZE/LOCAL_RANK), or a run alone.

Who this process is and which device it trains on; how the model is sharded or replicated
across the group is `mxflux.train.parallelize`.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed", "alone", "cleanup"]


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def alone(device_type: str | None = None) -> DistContext:
    """This process on its own (rank 0 of 1), whatever the environment says: the current CUDA
    device when `device_type` is "cuda" (the default where CUDA is available), else the CPU."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return DistContext(0, 1, 0, dev)


def init_distributed(device_type: str | None = None) -> DistContext:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK), or run alone.

    NCCL on CUDA, gloo on CPU. Each rank takes the GPU of its LOCAL_RANK.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return alone(device_type)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
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


def cleanup() -> None:
    """Destroy the process group, after collecting what only cycles still hold: modules sharded or
    replicated over the group hold it, and one left to interpreter exit is torn down there in no
    defined order (gloo's threads can abort a finished run; NCCL warns). Callers drop their own
    references to the model first."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
