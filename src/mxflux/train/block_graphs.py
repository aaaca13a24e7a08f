"""A training step around per-block CUDA graphs (`model.compile_mode: reduce-overhead`).

With that mode torch.compile replays each compiled block's forward and backward as CUDA graphs
(cudagraph trees): the host issues one launch per block instead of every kernel, without
capturing the whole step (`train.cuda_graph`), so gradient accumulation keeps its Python loop.
Two rules make the replays safe:

- A replay writes its outputs into the graph's own memory, so each micro-batch starts a new
  generation (`cudagraph_mark_step_begin`): the previous micro-batch's outputs have been consumed
  by its backward by then.
- A gradient that autograd takes over as `.grad` from a backward replay would be that memory, and
  the next micro-batch's replay would overwrite it. With accumulation the gradients are therefore
  zeroed buffers allocated outside the graphs, into which each backward adds; with one
  micro-batch they are set to None as usual (the optimizer reads them before the next replay).
"""

from __future__ import annotations

import torch

__all__ = ["BlockGraphs"]


class BlockGraphs:
    """What a step does differently when its compiled blocks replay as CUDA graphs; nothing otherwise."""

    def __init__(self, model_section, device: torch.device, accum: int):
        self.on = bool(model_section.compile and model_section.compile_mode == "reduce-overhead"
                       and device.type == "cuda")
        self.keep_grads = self.on and accum > 1

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.keep_grads:
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        optimizer.zero_grad(set_to_none=False)

    def micro_batch(self) -> None:
        """Before each micro-batch's forward."""
        if self.on:
            torch.compiler.cudagraph_mark_step_begin()
