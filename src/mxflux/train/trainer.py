"""The training loop: rectified-flow Flux training with fp32 master weights and bf16 compute.

One `Trainer` owns the model (fp32 parameters; MX/FP8 modules and autocast compute in bf16),
the AdamW optimizer with the MLPerf constants, the warm-up-then-constant LR, the data
position and the training RNG, so that a checkpoint captures everything and a resumed run's
next loss equals the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..model import MX_LINEAR_PATTERNS, Flux, flux_config, image_ids, patchify, text_ids
from ..nn import apply_precision
from ..nn.linear import MXFP6Linear
from .checkpoint import LATEST, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import RunConfig
from .flow import cfg_dropout, eval_noise, noised, per_sample_mse, sample_latents

__all__ = ["Trainer", "default_device"]

log = logging.getLogger(__name__)

DEMO_DATA_DIR = Path("runs/demo-data")


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    def __init__(self, cfg: RunConfig, *, device: torch.device | str | None = None,
                 out_dir: str | Path | None = None, wrap_model=None):
        from ..data import LatentDataset, ensure_demo_dataset, load_empty_encodings

        self.cfg = cfg
        self.device = torch.device(device) if device is not None else default_device()
        self.rank, self.world = _rank_world()
        self.out_dir = Path(out_dir) if out_dir is not None else cfg.out_dir
        self.mllog = None
        if cfg.mlperf.enabled:  # the timed MLPerf "init" phase starts before anything is built
            from .mlperf import MLPerfLogger

            self.mllog = MLPerfLogger(self.out_dir / "mlperf.log", cfg, rank=self.rank, world_size=self.world,
                                      submission_org=cfg.mlperf.submission_org,
                                      submission_platform=cfg.mlperf.submission_platform)
            self.mllog.init_start()
        self.compute_dtype = getattr(torch, cfg.train.compute_dtype)
        self.accum = cfg.batch.accumulation_steps(self.world)

        torch.manual_seed(cfg.train.seed)
        self.model = Flux(flux_config(cfg.model.name)).to(self.device)  # fp32 master weights
        self.precision_report = apply_precision(self.model, cfg.precision, include=MX_LINEAR_PATTERNS)
        if cfg.model.activation_checkpointing or cfg.model.compile:
            self._wrap_blocks()
        # Distributed wrapping (FSDP2/DDP) is injected by the caller; see mxflux.train.distributed.
        self.train_model = wrap_model(self.model) if wrap_model else self.model

        self.data_root = Path(cfg.data.root) if cfg.data.root else ensure_demo_dataset(DEMO_DATA_DIR)
        self.train_set = LatentDataset(self.data_root, "train")
        self.eval_set = LatentDataset(self.data_root, "eval")
        self.latent_shift, self.latent_scale = self.train_set.latent_shift, self.train_set.latent_scale
        # Moved to the device once, in the compute dtype: no per-step host→device copy.
        self.t5_empty, self.clip_empty = load_empty_encodings(self.data_root, device=self.device,
                                                              dtype=self.compute_dtype)

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # Training randomness (latent sampling, noise, t, CFG dropout) has its own generator on
        # the device, seeded per rank, and travels in checkpoints.
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.train.seed * 1000 + self.rank)
        self.step = 0  # optimizer steps taken
        self.samples = 0  # training samples consumed (global)
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of this epoch already consumed (this rank)
        self.last_eval: float | None = None

    # --- setup helpers ----------------------------------------------------------------------

    def _lr_factor(self, step: int) -> float:
        w = self.cfg.optim.warmup_steps
        return min(1.0, (step + 1) / w) if w > 0 else 1.0

    def _wrap_blocks(self) -> None:
        """Per-block activation checkpointing and/or torch.compile (both switchable)."""
        from torch.utils.checkpoint import checkpoint

        for blocks in (self.model.double_blocks, self.model.single_blocks):
            for i, block in enumerate(blocks):
                fwd = block.forward
                if self.cfg.model.activation_checkpointing:
                    fwd = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(fwd)
                if self.cfg.model.compile:
                    fwd = torch.compile(fwd)
                block.forward = fwd

    def mx_modules(self) -> list[MXFP6Linear]:
        return [m for m in self.model.modules() if isinstance(m, MXFP6Linear)]

    def fold_outside_window(self) -> int:
        """Blocks that fell outside the FP8 fold window so far (summed over MX modules; syncs)."""
        mods = self.mx_modules()
        return int(sum(m.fold_outside_window for m in mods)) if mods else 0

    # --- the objective ------------------------------------------------------------------------

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _model_inputs(self, x_t: torch.Tensor, t5: torch.Tensor, clip: torch.Tensor):
        b, _, h, w = x_t.shape
        dt = self.compute_dtype
        img = patchify(x_t).to(dt)
        return dict(img=img, img_ids=image_ids(b, h // 2, w // 2, device=self.device),
                    txt=t5.to(dt), txt_ids=text_ids(b, t5.shape[1], device=self.device), y=clip.to(dt))

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def training_loss(self, batch: dict) -> torch.Tensor:
        """Mean rectified-flow loss of one micro-batch (fp32 scalar, differentiable)."""
        g = self.generator
        x0 = sample_latents(batch["vae_mean"], batch["vae_logvar"], self.latent_shift, self.latent_scale, g)
        noise = torch.randn(x0.shape, generator=g, device=self.device)
        t = torch.rand(x0.shape[0], generator=g, device=self.device)
        x_t, target = noised(x0, noise, t)
        t5, clip = cfg_dropout(batch["t5"], batch["clip"], self.t5_empty, self.clip_empty,
                               self.cfg.data.cfg_dropout, g)
        with self._autocast():
            pred = self.train_model(timesteps=t, **self._model_inputs(x_t, t5, clip))
        return per_sample_mse(pred, patchify(target)).mean()

    # --- training -----------------------------------------------------------------------------

    def _train_batches(self):
        """Endless micro-batches for this rank, resumable at (epoch, batch_in_epoch)."""
        from ..data import build_loader

        c = self.cfg
        while True:
            loader = build_loader(self.train_set, batch_size=c.batch.micro_batch_size, rank=self.rank,
                                  world_size=self.world, seed=c.train.seed, epoch=self.epoch,
                                  start_step=self.batch_in_epoch, num_workers=c.data.num_workers,
                                  prefetch_factor=c.data.prefetch_factor, shuffle=True, drop_last=True)
            for batch in loader:
                self.batch_in_epoch += 1
                yield batch
            self.epoch += 1
            self.batch_in_epoch = 0

    def train_step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over `accum` micro-batches. Returns loss (mean), grad norm, lr."""
        self.train_model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro_batches):
            loss = self.training_loss(self._to_device(batch))
            # The reported value is a detached copy taken before any scaling: nothing below (or
            # in a distributed wrapper) can rescale it in place (the seed's halved-loss bug).
            total += loss.detach().double()
            sync = contextlib.nullcontext()
            if i < len(micro_batches) - 1 and hasattr(self.train_model, "no_sync"):
                sync = self.train_model.no_sync()
            with sync:
                (loss / len(micro_batches)).backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.samples += self.cfg.batch.global_batch_size
        mean = total / len(micro_batches)
        if self.world > 1:
            dist.all_reduce(mean)
            mean /= self.world
        return {"loss": float(mean), "grad_norm": float(grad_norm), "lr": lr}

    @torch.no_grad()
    def evaluate(self, max_samples: int | None = None) -> float:
        """Validation loss: fixed t = k/8 per sample, fixed noise, Σloss/Σcount in fp64 over ranks."""
        from ..data import build_loader

        self.train_model.eval()
        c = self.cfg
        limit = max_samples if max_samples is not None else c.train.eval_samples
        n_total = len(self.eval_set) if limit is None else min(limit, len(self.eval_set))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        loader = build_loader(self.eval_set, batch_size=c.train.eval_batch_size, rank=self.rank,
                              world_size=self.world, seed=0, shuffle=False, drop_last=False,
                              num_workers=c.data.num_workers, prefetch_factor=c.data.prefetch_factor,
                              limit=n_total)
        seed = c.train.seed
        for batch in loader:
            batch = self._to_device(batch)
            idx = batch["index"].cpu()
            mean, logvar = batch["vae_mean"].float(), batch["vae_logvar"].float()
            z = mean + torch.exp(0.5 * logvar) * eval_noise(idx, tuple(mean.shape[1:]), seed + 1, self.device)
            x0 = (z - self.latent_shift) * self.latent_scale
            noise = eval_noise(idx, tuple(x0.shape[1:]), seed + 2, self.device)
            t = batch["timestep_index"].float() / 8.0
            x_t, target = noised(x0, noise, t)
            with self._autocast():
                pred = self.train_model(timesteps=t, **self._model_inputs(x_t, batch["t5"], batch["clip"]))
            per = per_sample_mse(pred, patchify(target)).double()
            loss_sum += per.sum()
            count += per.numel()
        if self.world > 1:
            dist.all_reduce(loss_sum)
            dist.all_reduce(count)
        self.train_model.train()
        return float(loss_sum / count)  # a fresh Python float: it aliases nothing

    # --- checkpoints --------------------------------------------------------------------------

    def _full_state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Whole (unsharded) tensors on the CPU: a checkpoint loads onto any number of ranks.
        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def state_dict(self) -> dict:
        """Everything a resumed run needs. Under FSDP2/DDP this is a collective: call on all ranks."""
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optim = get_state_dict(self.model, self.optimizer, options=self._full_state_options())
            generators = [None] * self.world
            dist.all_gather_object(generators, self.generator.get_state())
        else:
            model, optim = self.model.state_dict(), self.optimizer.state_dict()
            generators = [self.generator.get_state()]
        return {
            "config": self.cfg.model_dump(mode="json"),
            "model": model,
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict(),
            "progress": {"step": self.step, "samples": self.samples, "epoch": self.epoch,
                         "batch_in_epoch": self.batch_in_epoch, "last_eval": self.last_eval},
            "rng": rng_state(),
            "world_size": self.world,
            "generators": generators,  # one per rank: each rank's training noise stream
        }

    def load_state_dict(self, state: dict) -> None:
        if self.world > 1:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=self._full_state_options())
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        p = state["progress"]
        self.step, self.samples, self.epoch = p["step"], p["samples"], p["epoch"]
        self.batch_in_epoch, self.last_eval = p["batch_in_epoch"], p["last_eval"]
        set_rng_state(state["rng"])
        if state.get("world_size", 1) == self.world:
            self.generator.set_state(state["generators"][self.rank].to(torch.uint8).cpu())
        else:
            # Another rank count: per-rank noise streams cannot carry over; derive fresh ones
            # (and the per-rank data position: batch_in_epoch counts this rank's micro-batches).
            self.generator.manual_seed(self.cfg.train.seed * 1000 + self.rank + 7919 * self.step)
            self.batch_in_epoch = p["batch_in_epoch"] * state.get("world_size", 1) // self.world

    def save(self, path: str | Path | None = None) -> Path:
        """Write a checkpoint atomically. A collective under FSDP2/DDP: rank 0 writes."""
        path = Path(path) if path is not None else self.out_dir / LATEST
        state = self.state_dict()
        if self.rank == 0:
            save_checkpoint(path, state)
        if self.world > 1:
            dist.barrier()
        return path

    def resume(self, path: str | Path) -> None:
        self.load_state_dict(load_checkpoint(path, map_location=self.device))

    def warmup_without_trace(self, steps: int) -> None:
        """Run `steps` optimizer steps to warm compile caches and allocators, then restore
        everything they touched (weights, optimizer, LR schedule, data position, every RNG), so
        the timed run is exactly the run without them (the seed needed a fix here)."""
        if steps <= 0:
            return
        snapshot = copy.deepcopy(self.state_dict())
        batches = self._train_batches()
        for _ in range(steps):
            self.train_step([next(batches) for _ in range(self.accum)])
        self.load_state_dict(snapshot)
        if self.mx_modules():  # the warm-up's blocks are not the run's
            for m in self.mx_modules():
                m.fold_outside_window.zero_()

    # --- the whole run ------------------------------------------------------------------------

    def fit(self, *, progress: bool = True, max_steps: int | None = None) -> dict:
        """Train until `train.train_samples` (or `max_steps` more steps); log, evaluate, checkpoint."""
        from .metrics import MetricsLogger, plot_loss_curve

        c = self.cfg
        total_steps = math.ceil(c.train.train_samples / c.batch.global_batch_size)
        end_step = total_steps if max_steps is None else min(total_steps, self.step + max_steps)
        is_main = self.rank == 0
        logger = MetricsLogger(self.out_dir, append=self.step > 0) if is_main else None
        mll = self.mllog
        if mll:
            self.warmup_without_trace(c.mlperf.warmup_steps)
            if self.world > 1:
                dist.barrier()
            mll.init_stop()
            mll.run_start()
            mll.block_start(self.samples)
        converged = False
        batches = self._train_batches()
        next_eval = (self.samples // c.train.eval_every_samples + 1) * c.train.eval_every_samples
        bar = _progress(progress and is_main, end_step, self.step, c.name)
        t_last, samples_last = time.perf_counter(), self.samples
        result = {}
        try:
            while self.step < end_step:
                result = self.train_step([next(batches) for _ in range(self.accum)])
                if self.step % c.train.log_every == 0 or self.step == end_step:
                    now = time.perf_counter()
                    ips = (self.samples - samples_last) / max(now - t_last, 1e-9)
                    t_last, samples_last = now, self.samples
                    if logger:
                        logger.log(step=self.step, samples=self.samples, split="train", loss=result["loss"],
                                   lr=result["lr"], grad_norm=result["grad_norm"], images_per_s=ips,
                                   fold_outside_window=self.fold_outside_window())
                    bar.update(self.step, loss=result["loss"], lr=result["lr"], ips=ips)
                if self.samples >= next_eval or (self.step == end_step and not mll):
                    if mll:
                        mll.block_stop(self.samples)
                        mll.eval_start(self.samples)
                    self.last_eval = self.evaluate()
                    next_eval += c.train.eval_every_samples
                    if logger:
                        logger.log(step=self.step, samples=self.samples, split="eval", loss=self.last_eval)
                    bar.note(f"step {self.step}: eval loss {self.last_eval:.4f}")
                    if mll:
                        mll.eval_stop(self.samples)
                        mll.eval_accuracy(self.last_eval, self.samples)
                        if self.last_eval <= c.mlperf.target_eval_loss:
                            converged = True
                            break
                        if self.step < end_step:
                            mll.block_start(self.samples)
                if c.train.checkpoint_every and self.step % c.train.checkpoint_every == 0:
                    self.save()
        finally:
            bar.close()
            if logger:
                logger.close()
            if mll:  # run_stop before checkpoints and plots: they are outside the timed run
                mll.run_stop(self.samples, status="success" if converged else "aborted")
                mll.close()
        self.save()
        if is_main:
            plot_loss_curve(self.out_dir / "metrics.csv", self.out_dir / "loss_curve.png",
                            title=f"{c.name} ({c.precision.name})")
        return {"step": self.step, "samples": self.samples, "train_loss": result.get("loss"),
                "eval_loss": self.last_eval}


class _progress:
    """A rich progress bar showing loss, LR and images/s (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int, start: int, name: str):
        self.p = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[stats]}"), TimeRemainingColumn())
        self.p.start()
        self.task = self.p.add_task(name, total=total, completed=start, stats="")

    def update(self, step, *, loss, lr, ips):
        if self.p:
            self.p.update(self.task, completed=step, stats=f"loss {loss:.4f}  lr {lr:.2e}  {ips:.1f} img/s")

    def note(self, text: str) -> None:
        if self.p:
            self.p.console.print(text)

    def close(self) -> None:
        if self.p:
            self.p.stop()
