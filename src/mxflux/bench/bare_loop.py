"""The bare training loop of a recipe: what a step costs without the trainer around it.

The same model as the trainer's (`build_model`: seed, fp32 master weights, the recipe's
precision; then `parallelize`: activation checkpointing, torch.compile, FSDP2/DDP), the same
AdamW (fused on CUDA unless the recipe says otherwise), the same bf16 autocast, loss function and
gradient clipping, on random inputs of the recipe's shapes that live on the device from the
start: no data loader, no host-to-device copies, no noise sampling, no learning-rate schedule, no
metrics. `mxflux bench step --bare-loop` times it next to the trainer; their ratio is what the
trainer adds to a step.

With `cuda_graph=True` the whole step (forward, backward, gradient clipping, AdamW) is captured
once as one CUDA graph and replayed (`--cuda-graph`; `mxflux.train.captured`, as the trainer's
`train.cuda_graph` does): no host work per step but one graph launch, so the difference to the
eager bare loop is what the host's per-op cost (op dispatch, our packers' Python, kernel launches)
still costs a step. The first call runs the warm-up steps and the capture. One process only.
"""

from __future__ import annotations

import contextlib

import torch

from ..model import image_ids, text_ids
from ..train.block_graphs import BlockGraphs
from ..train.clipping import clip_and_step
from ..train.config import RunConfig
from ..train.distributed import DistContext
from ..train.flow import per_sample_mse
from ..train.guidance import guidance_input

__all__ = ["BareLoop"]


class BareLoop:
    """`step()` runs one optimizer step over `accum` micro-batches of random on-device inputs."""

    def __init__(self, cfg: RunConfig, ctx: DistContext, device: torch.device, *, latent_hw: tuple[int, int],
                 text_tokens: int, cuda_graph: bool = False, graph_warmup: int = 3):
        from ..train.build import build_model, build_optimizer
        from ..train.captured import CapturedStep, one_process_error
        from ..train.parallelize import parallelize

        refused = one_process_error("cuda_graph", device.type, ctx.world_size) if cuda_graph else None
        if refused:
            raise ValueError(refused)
        self.cfg, self.device = cfg, device
        self.model, _ = build_model(cfg, device)
        self.train_model = parallelize(self.model, cfg, ctx)
        self.optimizer = build_optimizer(cfg, self.model, capturable=cuda_graph)
        self.captured = CapturedStep(self.optimizer, device, warmup=graph_warmup) if cuda_graph else None
        self.accum = cfg.batch.accumulation_steps(ctx.world_size)
        self.block_graphs = BlockGraphs(cfg.model, device, self.accum)
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
                            timesteps=torch.rand((b,), generator=g, device=device),
                            guidance=guidance_input(cfg.train.distilled_guidance, b, device))
                       for _ in range(self.accum)]
        self.targets = [randn(b, image_tokens, mc.in_channels, dtype=torch.float32) for _ in range(self.accum)]

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def step(self) -> torch.Tensor:
        """One optimizer step; returns the last micro-batch's loss (a device tensor: no sync). With
        `cuda_graph` the first call runs the eager warm-up steps and the capture, and every call
        returns the loss of one replay."""
        if self.captured is None:
            self.block_graphs.zero_grad(self.optimizer)
            return self._core()[0]
        while True:  # the inputs live on the device already: no micro-batches to copy in
            (loss,) = self.captured.run(self._core, (), 0)
            if self.captured.graph is not None:
                return loss

    def _core(self, static=(), step_t=None) -> tuple[torch.Tensor]:
        """One step from zeroed (None) gradients; the arguments of a captured step are unused (the
        inputs are fixed and the bare loop draws no noise)."""
        self.train_model.train()
        for i, (inputs, target) in enumerate(zip(self.inputs, self.targets)):
            self.block_graphs.micro_batch()
            with self._autocast():
                pred = self.train_model(**inputs)
            loss = per_sample_mse(pred, target).mean()
            if i == self.accum - 1:  # as the trainer: nothing reads the weights' row operands until the step
                self.optimizer.release_weight_rows()
            no_sync = contextlib.nullcontext()
            if i < self.accum - 1 and hasattr(self.train_model, "no_sync"):
                no_sync = self.train_model.no_sync()
            with no_sync:
                (loss / self.accum).backward()
        o = self.cfg.optim
        clip_and_step(self.optimizer, self.model.parameters(), o.grad_clip, in_optimizer=o.clip_in_optimizer)
        return (loss.detach(),)
