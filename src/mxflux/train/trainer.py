"""The training loop: rectified-flow Flux training with fp32 master weights and bf16 compute.

One `Trainer` owns the model (fp32 parameters; MX/FP8 modules and autocast compute in bf16),
the AdamW optimizer with the MLPerf constants, the warm-up-then-constant LR and the data
position, so that a checkpoint captures everything and a resumed run's next loss equals the
uninterrupted run's. The training noise holds no state: every draw of a sample is a function
of (train seed, optimizer step, dataset index) (`mxflux.train.noise`), and each global batch is
the same set of samples on any number of ranks, so a run's losses do not depend on its world
size (up to floating-point reduction order) and a checkpoint resumes onto any world size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..model import MX_LINEAR_PATTERNS, Flux, image_ids, init_from_checkpoint, patchify, text_ids
from ..nn import apply_precision
from ..nn.linear import MXFP6Linear
from .checkpoint import (LATEST, LATEST_SHARDED, load_checkpoint, load_sharded_checkpoint, resolve_checkpoint,
                         rng_state, save_checkpoint, save_sharded_checkpoint, set_rng_state)
from .config import RunConfig
from .flow import cfg_dropout, eval_noise, noised, per_sample_mse, sample_latents
from .noise import training_draws

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
        with torch.device(self.device):  # initialised where it trains (a 12B model's CPU init takes minutes)
            self.model = Flux(cfg.model.flux_config())  # fp32 master weights
        self.precision_report = apply_precision(self.model, cfg.precision, include=MX_LINEAR_PATTERNS)
        if cfg.model.activation_checkpointing or cfg.model.compile:
            self._wrap_blocks()
        # Distributed wrapping (FSDP2/DDP) is injected by the caller; see mxflux.train.distributed.
        self.train_model = wrap_model(self.model) if wrap_model else self.model
        if cfg.model.init_from:  # after wrapping: under FSDP2 each rank reads only its shards
            init_from_checkpoint(self.model, cfg.model.init_from)

        self.data_root = Path(cfg.data.root) if cfg.data.root else ensure_demo_dataset(DEMO_DATA_DIR)
        self.train_set = LatentDataset(self.data_root, "train")
        self.eval_set = LatentDataset(self.data_root, "eval")
        self.latent_shift, self.latent_scale = self.train_set.latent_shift, self.train_set.latent_scale
        # Moved to the device once, in the compute dtype: no per-step host→device copy.
        self.t5_empty, self.clip_empty = load_empty_encodings(self.data_root, device=self.device,
                                                              dtype=self.compute_dtype)

        o = cfg.optim
        impl = o.implementation
        if impl == "auto":  # fused on CUDA; torch's own default elsewhere
            impl = "fused" if self.device.type == "cuda" else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, weight_decay=o.weight_decay,
                                           **({impl: True} if impl else {}))
        # A partial, not the bound method: no Trainer <-> scheduler reference cycle, so a dropped
        # Trainer frees its (GPU) memory at once instead of at the next garbage collection.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(_warmup_then_constant, cfg.optim.warmup_steps))
        # Training randomness (latent sampling, noise, t, CFG dropout) has no generator state:
        # each sample's draws are Philox of (seed, step, dataset index); see training_loss.
        self.step = 0  # optimizer steps taken
        self.samples = 0  # training samples consumed (global)
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of this epoch already consumed (this rank)
        self.last_eval: float | None = None
        self.last_checkpoint: Path | None = None

    # --- setup helpers ----------------------------------------------------------------------

    def _lr_factor(self, step: int) -> float:
        return _warmup_then_constant(self.cfg.optim.warmup_steps, step)

    def _wrap_blocks(self) -> None:
        """Per-block activation checkpointing and/or torch.compile (both switchable)."""
        from torch.utils.checkpoint import checkpoint

        for blocks in (self.model.double_blocks, self.model.single_blocks):
            for i, block in enumerate(blocks):
                fwd = block.forward
                if self.cfg.model.activation_checkpointing:
                    fwd = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(fwd)
                if self.cfg.model.compile:
                    fwd = torch.compile(fwd, mode=self.cfg.model.compile_mode)
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
        """Mean rectified-flow loss of one micro-batch (fp32 scalar, differentiable).

        Every random draw of a sample (latent ε, flow noise, t, CFG dropout) is a function of
        (train seed, current optimizer step, its dataset index `batch["index"]`) alone, computed
        on the device for the whole micro-batch at once.
        """
        mean = batch["vae_mean"]
        d = training_draws(batch["index"], self.step, self.cfg.train.seed, tuple(mean.shape[1:]), mean.device)
        x0 = sample_latents(mean, batch["vae_logvar"], self.latent_shift, self.latent_scale, eps=d.latent_eps)
        x_t, target = noised(x0, d.noise, d.t)
        p = self.cfg.data.cfg_dropout
        t5, clip = cfg_dropout(batch["t5"], batch["clip"], self.t5_empty, self.clip_empty, p, drop=d.drop_u < p)
        with self._autocast():
            pred = self.train_model(timesteps=d.t, **self._model_inputs(x_t, t5, clip))
        return per_sample_mse(pred, patchify(target)).mean()

    # --- training -----------------------------------------------------------------------------

    def _train_batches(self):
        """Endless micro-batches for this rank, resumable at (epoch, batch_in_epoch).

        Each global batch is the same set of samples on any world size (the loader cuts the
        epoch into global batches and gives each rank its slice), so the data position is
        portable: `samples_in_epoch` in the checkpoint converts to any (world, micro-batch).
        """
        from ..data import build_loader

        c = self.cfg
        while True:
            loader = build_loader(self.train_set, batch_size=c.batch.micro_batch_size, rank=self.rank,
                                  world_size=self.world, seed=c.train.seed, epoch=self.epoch,
                                  start_step=self.batch_in_epoch, num_workers=c.data.num_workers,
                                  prefetch_factor=c.data.prefetch_factor, shuffle=True, drop_last=True,
                                  global_batch_size=c.batch.global_batch_size)
            if self.batch_in_epoch == 0 and len(loader) == 0:
                raise ValueError(f"the training set ({len(self.train_set)} samples) is smaller than one global "
                                 f"batch ({c.batch.global_batch_size})")
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

    # A checkpoint's tensors are keyed by parameter name (torch.distributed.checkpoint.state_dict):
    # the same keys alone, under DDP and under FSDP2, so any checkpoint loads onto any world size.
    # Its non-tensor part ("meta") is the config, LR schedule, progress and global RNG states;
    # the data position is global (`samples_in_epoch`), the training noise has no state at all.

    def _tensor_state(self, *, full: bool) -> dict:
        """{"model", "optimizer"} by parameter name: this rank's shards, or (`full`) whole tensors
        on the CPU of rank 0 (a collective under FSDP2/DDP: call on every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if full and self.world > 1 else None
        fresh = not self.optimizer.state
        model, optim = get_state_dict(self.model, self.optimizer, options=opts)
        if fresh:  # get_state_dict initialised the optimizer state (a zero-lr step): undo that
            self.optimizer.state.clear()
        return {"model": model, "optimizer": optim}

    def _meta_state(self) -> dict:
        c = self.cfg.batch
        return {
            "format": 2,
            "config": self.cfg.model_dump(mode="json"),
            "scheduler": self.scheduler.state_dict(),
            "progress": {"step": self.step, "samples": self.samples, "epoch": self.epoch,
                         "samples_in_epoch": self.batch_in_epoch * c.micro_batch_size * self.world,
                         "last_eval": self.last_eval},
            "rng": rng_state(),
            "world_size": self.world,
        }

    def state_dict(self) -> dict:
        """Everything a resumed run needs, as whole tensors (the single-file checkpoint's layout).
        Under FSDP2/DDP a collective that gathers the tensors on rank 0's CPU."""
        return {**self._meta_state(), **self._tensor_state(full=True)}

    def load_state_dict(self, state: dict) -> None:
        """Load a whole-tensor state (`state_dict()`, a `latest.pt`) onto this world size."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        optim = state["optimizer"]
        if state.get("format", 1) < 2:  # optimizer.state_dict(): keyed by parameter number
            optim = _optimizer_state_by_name(optim, self.model, self.optimizer)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True) if self.world > 1 else None)
        self._load_meta(state)

    def _load_meta(self, meta: dict) -> None:
        self.scheduler.load_state_dict(meta["scheduler"])
        p = meta["progress"]
        self.step, self.samples, self.epoch, self.last_eval = p["step"], p["samples"], p["epoch"], p["last_eval"]
        per_batch = self.cfg.batch.micro_batch_size * self.world
        if "samples_in_epoch" in p:
            done = p["samples_in_epoch"]
        else:  # format 1: micro-batches of one rank of the checkpoint's run
            old = meta["config"]["batch"]
            done = p["batch_in_epoch"] * old["micro_batch_size"] * meta.get("world_size", 1)
            log.warning("checkpoint format 1 (per-rank noise generators): resuming with stateless noise; "
                        "the continuation is not the one the old run would have taken")
        if done % per_batch:
            raise ValueError(f"checkpoint data position {done} samples into epoch {self.epoch} is not a whole "
                             f"number of micro-batches x world size ({per_batch}): batch sizes changed")
        self.batch_in_epoch = done // per_batch
        set_rng_state(meta["rng"])

    def save(self, path: str | Path | None = None, *, sharded: bool | None = None) -> Path:
        """Write a checkpoint atomically; a collective under FSDP2/DDP.

        Alone (or `sharded=False`): one file, `latest.pt` by default, written by rank 0. Under
        torchrun: a sharded `torch.distributed.checkpoint` directory, `latest.dcp/` by default,
        each rank writing its shards (nothing is gathered), renamed into place once all are done.
        """
        sharded = self.world > 1 if sharded is None else sharded
        default = path is None
        if default:
            path = self.out_dir / (LATEST_SHARDED if sharded else LATEST)
        path = Path(path)
        if sharded:
            save_sharded_checkpoint(path, self._tensor_state(full=False), self._meta_state(), rank=self.rank)
        else:
            state = self.state_dict()
            if self.rank == 0:
                save_checkpoint(path, state)
            if self.world > 1:
                dist.barrier()
        if default and self.rank == 0:  # the other format's checkpoint (another world size) is stale now
            stale = self.out_dir / (LATEST if sharded else LATEST_SHARDED)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        self.last_checkpoint = path
        return path

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint: a file, a sharded directory or a run directory; any world size."""
        path = resolve_checkpoint(path)
        if not path.is_dir():
            self.load_state_dict(load_checkpoint(path, map_location="cpu"))
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict

        # Destination tensors: this rank's shards (FSDP2) or whole tensors (DDP, one process);
        # dcp.load reads just those pieces, whatever sharding wrote them.
        tensors = self._tensor_state(full=False)
        meta = load_sharded_checkpoint(path, tensors)
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optimizer"])
        self._load_meta(meta)

    def _snapshot(self) -> dict:
        """This rank's local training state on the CPU (no collective, nothing gathered)."""
        from torch.distributed.tensor import DTensor

        def local(t):
            if not isinstance(t, torch.Tensor):
                return copy.deepcopy(t)
            return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)

        params = list(self.model.parameters())
        return {
            "params": [local(p) for p in params],
            "optim": [{k: local(v) for k, v in self.optimizer.state[p].items()} if p in self.optimizer.state
                      else None for p in params],
            "groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                       for g in self.optimizer.param_groups],
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "progress": (self.step, self.samples, self.epoch, self.batch_in_epoch, self.last_eval),
            "rng": rng_state(),
        }

    @torch.no_grad()
    def _restore(self, snap: dict) -> None:
        from torch.distributed.tensor import DTensor

        def copy_into(dst, src):
            (dst.to_local() if isinstance(dst, DTensor) else dst).copy_(src)

        for p, saved, opt in zip(self.model.parameters(), snap["params"], snap["optim"]):
            copy_into(p, saved)
            if opt is None:
                self.optimizer.state.pop(p, None)
            else:
                state = self.optimizer.state[p]
                for k, v in opt.items():
                    if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor):
                        copy_into(state[k], v)
                    else:
                        state[k] = v
        for g, saved in zip(self.optimizer.param_groups, snap["groups"]):
            g.update(saved)
        self.scheduler.load_state_dict(snap["scheduler"])
        self.step, self.samples, self.epoch, self.batch_in_epoch, self.last_eval = snap["progress"]
        set_rng_state(snap["rng"])

    def warmup_without_trace(self, steps: int) -> None:
        """Run `steps` optimizer steps to warm compile caches and allocators, then restore
        everything they touched (weights, optimizer, LR schedule, data position, every RNG), so
        the timed run is exactly the run without them (the seed needed a fix here). The snapshot
        is each rank's own shards, copied to the CPU: nothing is gathered."""
        if steps <= 0:
            return
        snapshot = self._snapshot()
        batches = self._train_batches()
        for _ in range(steps):
            self.train_step([next(batches) for _ in range(self.accum)])
        del batches
        self._restore(snapshot)
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
        if self.step == 0 and c.model.init_from and not mll:  # the loaded weights' loss: the fine-tune's baseline
            self.last_eval = self.evaluate()
            if logger:
                logger.log(step=0, samples=0, split="eval", loss=self.last_eval)
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


def _warmup_then_constant(warmup_steps: int, step: int) -> float:
    """The LR factor at `step`: linear warm-up over `warmup_steps`, then 1 (MLPerf reference)."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def _optimizer_state_by_name(optim: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A format-1 `optimizer.state_dict()` (keyed by parameter number) keyed by parameter name,
    as `get_state_dict` writes it. The optimizer was built from `model.parameters()`, in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    by_number = {}
    for saved, group in zip(optim["param_groups"], optimizer.param_groups):
        by_number.update(zip(saved["params"], (names[id(p)] for p in group["params"])))
    return {"state": {by_number[k]: v for k, v in optim["state"].items()},
            "param_groups": [{**g, "params": [by_number[i] for i in g["params"]]} for g in optim["param_groups"]]}


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
