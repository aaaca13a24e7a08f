"""The bare training loop of a recipe: what a step costs without the trainer around it.

The same model as the trainer's (`build_model`: seed, fp32 master weights, the recipe's
precision; then `parallelize`: activation checkpointing, torch.compile, FSDP2/DDP), the same
AdamW (fused on CUDA unless the recipe says otherwise), the same bf16 autocast, loss function and
gradient clipping, on random inputs of the recipe's shapes that live on the device from the
start: no data loader, no host-to-device copies, no noise sampling, no learning-rate schedule, no
metrics. `mxflux bench step --bare-loop` times it next to the trainer; their ratio is what the
trainer adds to a step.

With `cuda_graph=True` the whole step (forward, backward, gradient clipping, AdamW) is captured
once as one CUDA graph and replayed (`--cuda-graph`): no host work per step but one graph launch,
so the difference to the eager bare loop is what the host's per-op cost (op dispatch, our
packers' Python, kernel launches) still costs a step. The standard whole-network recipe of
`torch.cuda.graphs`: warm-up steps on a side stream (they also compile), gradients set to None
before capture (backward then allocates them in the graph's pool, replays rewrite them), AdamW
with `capturable=True` (its step counts on the device). One process only: FSDP2 and DDP issue
collectives from hooks on their own streams.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..model import image_ids, text_ids
from ..train.config import RunConfig
from ..train.distributed import DistContext
from ..train.flow import per_sample_mse

__all__ = ["BareLoop"]


class BareLoop:
    """`step()` runs one optimizer step over `accum` micro-batches of random on-device inputs."""

    def __init__(self, cfg: RunConfig, ctx: DistContext, device: torch.device, *, latent_hw: tuple[int, int],
                 text_tokens: int, cuda_graph: bool = False, graph_warmup: int = 3):
        from ..train.build import build_model, build_optimizer
        from ..train.parallelize import parallelize

        if cuda_graph and (device.type != "cuda" or ctx.world_size > 1):
            raise ValueError(f"cuda_graph: a captured step needs one process on a CUDA device; got {device.type} "
                             f"with world size {ctx.world_size}")
        if cuda_graph and graph_warmup < 1:
            raise ValueError(f"graph_warmup: a captured step needs at least one warm-up step first (it compiles "
                             f"and allocates the gradients' shapes), got {graph_warmup}")
        self.cfg, self.device = cfg, device
        self.model, _ = build_model(cfg, device)
        self.train_model = parallelize(self.model, cfg, ctx)
        self.optimizer = build_optimizer(cfg, self.model, capturable=cuda_graph)
        self.cuda_graph, self.graph_warmup = cuda_graph, graph_warmup
        self._graph = self._graph_loss = None
        self.accum = cfg.batch.accumulation_steps(ctx.world_size)
        self.compute_dtype = getattr(torch, cfg.train.compute_dtype)
        mc = cfg.model.flux_config()
        b, (h, w) = cfg.batch.micro_batch_size, latent_hw
        if h % 2 or w % 2:
            raise ValueError(f"latent_hw {latent_hw}: expected even sides (2x2 patches)")
        image_tokens = (h // 2) * (w // 2)
        g = torch.Generator(device).manual_seed(cfg.train.seed)
        dt = self.compute_dtype

        def randn(*shape, dtype=dt):
            return torch.randn(shape, generator=g, device=device, dtype=dtype)

        # One set of inputs per micro-batch of a step, as the trainer feeds a fresh batch each time.
        self.inputs = [dict(img=randn(b, image_tokens, mc.in_channels),
                            img_ids=image_ids(b, h // 2, w // 2, device=device),
                            txt=randn(b, text_tokens, mc.context_in_dim),
                            txt_ids=text_ids(b, text_tokens, device=device),
                            y=randn(b, mc.vec_in_dim),
                            timesteps=torch.rand((b,), generator=g, device=device))
                       for _ in range(self.accum)]
        self.targets = [randn(b, image_tokens, mc.in_channels, dtype=torch.float32) for _ in range(self.accum)]

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def step(self) -> torch.Tensor:
        """One optimizer step; returns the last micro-batch's loss (a device tensor: no sync). With
        `cuda_graph` the first call warms up and captures, every call replays; the loss returned is
        then a copy (the graph's own output is overwritten by the next replay)."""
        if not self.cuda_graph:
            return self._step()
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._graph_loss.clone()

    def _capture(self) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.graph_warmup):
                self._step()
        current.wait_stream(side)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_loss = self._step(zero_grad=False)
        self._graph = graph

    def _step(self, zero_grad: bool = True) -> torch.Tensor:
        self.train_model.train()
        if zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
        for i, (inputs, target) in enumerate(zip(self.inputs, self.targets)):
            with self._autocast():
                pred = self.train_model(**inputs)
            loss = per_sample_mse(pred, target).mean()
            no_sync = contextlib.nullcontext()
            if i < self.accum - 1 and hasattr(self.train_model, "no_sync"):
                no_sync = self.train_model.no_sync()
            with no_sync:
                (loss / self.accum).backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        return loss.detach()
