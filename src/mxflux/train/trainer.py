"""The training loop: rectified-flow Flux training with fp32 master weights and bf16 compute.

One `Trainer` owns the model (fp32 parameters; MX/FP8 modules and autocast compute in bf16),
the AdamW optimizer with the MLPerf constants, the LR schedule (warm-up, then constant or decaying: `lr_factor`)
and the data position, so that a checkpoint captures everything and a resumed run's next loss equals the
uninterrupted run's. The training noise holds no state: every draw of a sample is a function of (train seed,
optimizer step, dataset index) (`mxflux.train.noise`), and each global batch is the same set of samples on any
number of ranks, so a run's losses do not depend on its world size (up to floating-point reduction order) and a
checkpoint resumes onto any world size (docs/design.md, "The trainer").

A step never waits for the device: its loss, gradient norm and window count stay device tensors (`StepResult`)
until the loop (`mxflux.train.loop`) reads them, all at once, where it logs, evaluates or checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.fit import dataset_dims, dims_mismatch
from ..model import image_ids, patchify, text_ids
from .block_graphs import BlockGraphs
from .build import build_optimizer, build_training_model
from .callbacks import Callback
from .captured import CapturedStep, one_process_error
from .checkpoint import (CHECKPOINT_FORMAT, LATEST, LATEST_SHARDED, check_format, load_checkpoint,
                         load_model_optimizer_state, load_sharded_checkpoint, model_optimizer_state, resolve_checkpoint,
                         rng_state, save_checkpoint, save_sharded_checkpoint, set_rng_state, sharded_has)
from .clipping import clip_and_step
from .config import RecipeError, RunConfig
from .distributed import DistContext, init_distributed
from .ema import WeightEMA
from .evaluation import validation_loss
from .adapters import check_same_base
from .identity import new_run_id, run_identity
from .flow import cfg_dropout, noised, per_sample_mse, sample_latents, shift_time
from .guidance import guidance_input
from .held_erefs import gather_held, restore_gathered_held
from .noise import training_draws
from .results import StepResult
from .schedule import lr_factor

__all__ = ["Trainer", "StepResult", "lr_factor", "total_steps"]

DEMO_DATA_DIR = Path("runs/demo-data")


def total_steps(cfg: RunConfig) -> int:
    """Optimizer steps of the whole run: `train.train_samples` in global batches, rounded up."""
    return math.ceil(cfg.train.train_samples / cfg.batch.global_batch_size)


class Trainer:
    def __init__(self, cfg: RunConfig, *, ctx: DistContext | None = None, device: torch.device | str | None = None,
                 out_dir: str | Path | None = None, callbacks: tuple[Callback, ...] | list[Callback] = ()):
        from ..data import LatentDataset, ensure_demo_dataset, load_empty_encodings

        self.cfg = cfg
        self.ctx = ctx if ctx is not None else init_distributed(torch.device(device).type if device else None)
        self.device = torch.device(device) if device is not None else self.ctx.device
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        refused = one_process_error("train.cuda_graph", self.device.type, self.world) if cfg.train.cuda_graph else None
        if refused:  # before any work
            raise RecipeError(refused)
        self.out_dir = Path(out_dir) if out_dir is not None else cfg.out_dir
        self.callbacks = list(callbacks)
        self.compute_dtype = getattr(torch, cfg.train.compute_dtype)
        self.accum = cfg.batch.accumulation_steps(self.world)
        self.block_graphs = BlockGraphs(cfg.model, self.device, self.accum)
        self.total_steps = total_steps(cfg)

        # The data first: data that does not fit the model is refused before the model is built.
        self.data_root = Path(cfg.data.root) if cfg.data.root else ensure_demo_dataset(DEMO_DATA_DIR)
        self.train_set = LatentDataset(self.data_root, "train")
        why = dims_mismatch(dataset_dims(self.data_root), f"data.root {str(self.data_root)!r}", cfg.model.flux_config(),
                            model_name=cfg.model.name, recipe=cfg.name)
        if why:
            raise RecipeError(why)
        self.eval_set = LatentDataset(self.data_root, "eval")
        self.latent_shift, self.latent_scale = self.train_set.latent_shift, self.train_set.latent_scale
        # Moved to the device once, in the compute dtype: no per-step host-to-device copy.
        self.t5_empty, self.clip_empty = load_empty_encodings(self.data_root, device=self.device,
                                                              dtype=self.compute_dtype)

        # fp32 master weights (a LoRA run: its adapters', on a frozen base); train_model may be DDP's wrapper
        self.model, self.train_model, self.precision_report, self.base_fingerprint = build_training_model(
            cfg, self.ctx, self.device)
        self.window_counters = [m.blocks_outside_window for m in self.mx_modules()]
        # After init_from and sharding: the average starts from the weights the run starts from.
        self.ema = WeightEMA(self.model, cfg.train.ema_decay) if cfg.train.ema_decay else None

        o = cfg.optim
        self.optimizer = build_optimizer(cfg, self.model, capturable=cfg.train.cuda_graph)
        # A partial, not a bound method: no Trainer <-> scheduler cycle, so a dropped Trainer frees its memory at once
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, o.warmup_steps, o.decay, o.decay_steps, o.min_lr_ratio,
                                              self.total_steps))
        self.run_id = new_run_id()  # a resume takes the checkpoint's (`_load_meta`)
        self.step, self.epoch = 0, 0  # optimizer steps taken, epochs begun
        self.samples = 0  # training samples consumed (global)
        self.batch_in_epoch = 0  # micro-batches of this epoch already consumed (this rank)
        self.last_eval, self.last_checkpoint = None, None  # float, Path
        self.window_base = 0  # blocks outside the window before this process (a resumed run's)
        self.captured = CapturedStep(self.optimizer, self.device) if cfg.train.cuda_graph else None

    def mx_modules(self) -> list[torch.nn.Module]:  # MXFP6Linear and FrozenMXFP6Linear: fold-window counters
        return [m for m in self.model.modules() if isinstance(getattr(m, "blocks_outside_window", None), torch.Tensor)]

    def blocks_outside_window(self) -> int:
        """Blocks that fell outside the FP8 fold window over the whole run (this rank; syncs)."""
        return self.window_base + int(sum(int(c) for c in self.window_counters))

    # --- the objective ------------------------------------------------------------------------

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _model_inputs(self, x_t: torch.Tensor, t5: torch.Tensor, clip: torch.Tensor):
        b, _, h, w = x_t.shape
        dt = self.compute_dtype
        return dict(img=patchify(x_t).to(dt), img_ids=image_ids(b, h // 2, w // 2, device=self.device),
                    txt=t5.to(dt), txt_ids=text_ids(b, t5.shape[1], device=self.device), y=clip.to(dt),
                    guidance=guidance_input(self.cfg.train.distilled_guidance, b, self.device))

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def training_loss(self, batch: dict, step: int | torch.Tensor | None = None) -> torch.Tensor:
        """Mean rectified-flow loss of one micro-batch (fp32 scalar, differentiable).

        Every random draw of a sample (latent eps, flow noise, t, CFG dropout) is a function of
        (train seed, current optimizer step, its dataset index `batch["index"]`) alone, computed
        on the device for the whole micro-batch at once. `step`: that step, when not `self.step`
        (a captured step passes a device tensor holding it).
        """
        mean = batch["vae_mean"]
        d = training_draws(batch["index"], self.step if step is None else step, self.cfg.train.seed,
                           tuple(mean.shape[1:]), mean.device)
        x0 = sample_latents(mean, batch["vae_logvar"], self.latent_shift, self.latent_scale, eps=d.latent_eps)
        t = shift_time(d.t, self.cfg.train.timestep_shift)
        x_t, target = noised(x0, d.noise, t)
        p = self.cfg.data.cfg_dropout
        t5, clip = cfg_dropout(batch["t5"], batch["clip"], self.t5_empty, self.clip_empty, p, drop=d.drop_u < p)
        with self._autocast():
            pred = self.train_model(timesteps=t, **self._model_inputs(x_t, t5, clip))
        return per_sample_mse(pred, patchify(target)).mean()

    # --- training -----------------------------------------------------------------------------

    def batches(self):
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

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        """One optimizer step over `accum` micro-batches; nothing in it waits for the device."""
        self.train_model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.captured is not None:
            mean, grad_norm = self.captured.run(self._step_core, micro_batches, self.step)
        else:
            self.block_graphs.zero_grad(self.optimizer)
            mean, grad_norm = self._step_core(micro_batches, self.step, to_device=self._to_device)
        self.scheduler.step()
        self.step += 1
        if self.ema is not None:
            self.ema.update(self.step)
        self.samples += self.cfg.batch.global_batch_size
        if self.world > 1:
            dist.all_reduce(mean)
            mean /= self.world
        window = torch.stack(self.window_counters).sum() + self.window_base if self.window_counters else None
        return StepResult(self.step, self.samples, mean, grad_norm, lr, window,
                          tuple(b["index"] for b in micro_batches))

    def _step_core(self, micro_batches: list[dict], step: int | torch.Tensor, to_device=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping and AdamW over `micro_batches` (moved to the device one at a
        time by `to_device`, or there already), the gradients None on entry: (mean loss, gradient
        norm). What `train.cuda_graph` captures."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro_batches):
            self.block_graphs.micro_batch()
            loss = self.training_loss(to_device(batch) if to_device is not None else batch, step)
            # The reported value is a detached copy taken before the 1/accum scaling, so that
            # nothing below (or in a distributed wrapper) can rescale it in place.
            total += loss.detach().double()
            if (last := i == len(micro_batches) - 1):  # nothing reads the weights' row operands until the step
                self.optimizer.release_weight_rows()
            with contextlib.nullcontext() if last or not hasattr(self.train_model, "no_sync") \
                    else self.train_model.no_sync():
                (loss / len(micro_batches)).backward()
        o = self.cfg.optim
        grad_norm = clip_and_step(self.optimizer, self.model.parameters(), o.grad_clip,
                                  in_optimizer=o.clip_in_optimizer)
        return total / len(micro_batches), grad_norm.detach()

    def evaluate(self, max_samples: int | None = None) -> float:
        """Validation loss: fixed t = k/8 per sample, fixed noise (`evaluation.validation_loss`)."""
        return validation_loss(self, max_samples)

    # --- checkpoints --------------------------------------------------------------------------

    # A checkpoint: the weights and optimizer state keyed by parameter name (any world size
    # loads them), and "meta": the config, LR schedule, progress (the data position in global
    # samples) and global RNG states. The training noise has no state at all.

    def _tensors(self, *, full: bool) -> dict:
        tensors = model_optimizer_state(self.model, self.optimizer, full=full, world_size=self.world)
        if self.ema is not None:  # whole tensors (full) or the averages themselves (shards)
            tensors["ema"] = self.ema.state_dict(full=full)
        return tensors

    def _load_ema(self, tensors: dict) -> None:
        if self.ema is None:
            return
        if "ema" not in tensors:
            raise ValueError("the recipe keeps an EMA of the weights (train.ema_decay) but the checkpoint holds "
                             "none: resume with --set train.ema_decay=null, or start a new run")
        self.ema.load_state_dict(tensors["ema"])

    def sampling_weights(self):
        """A context in which the model holds the weights samples are drawn with: the EMA of the
        weights where the recipe keeps one (train.ema_decay), else the weights themselves."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    def _meta_state(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.cfg.model_dump(mode="json"),
            "identity": run_identity(self.cfg, self.train_set),  # what the run is: a resume must be the same
            "run_id": self.run_id,
            "base_fingerprint": self.base_fingerprint,  # a LoRA run's frozen base (`train.adapters`)
            "scheduler": self.scheduler.state_dict(),
            "progress": {"step": self.step, "samples": self.samples, "epoch": self.epoch,
                         "samples_in_epoch": self.batch_in_epoch * self.cfg.batch.micro_batch_size * self.world,
                         "last_eval": self.last_eval, "blocks_outside_window": self.blocks_outside_window()},
            "rng": rng_state(),
            "world_size": self.world,
            "held_col_erefs": gather_held(self.model, self.world),  # each rank's (`precision.held_col_erefs`)
        }

    def state_dict(self) -> dict:
        """Everything a resumed run needs, as whole tensors (the single-file checkpoint's layout).
        Under FSDP2/DDP a collective that gathers the tensors on rank 0's CPU."""
        return {**self._meta_state(), **self._tensors(full=True)}

    def load_state_dict(self, state: dict) -> None:
        """Load a whole-tensor state (`state_dict()`, a `latest.pt`) onto this world size."""
        check_format(state)
        load_model_optimizer_state(self.model, self.optimizer, state, full=True, world_size=self.world)
        self._load_ema(state)
        self._load_meta(state)

    def _load_meta(self, meta: dict) -> None:
        check_format(meta)
        if self.captured is not None:  # the optimizer's state tensors were replaced: capture again
            self.captured.invalidate()
        self.scheduler.load_state_dict(meta["scheduler"])
        self.run_id = meta.get("run_id") or self.run_id  # checkpoints before run ids: this one from now on
        check_same_base(meta.get("base_fingerprint"), self.base_fingerprint, self.out_dir)
        p = meta["progress"]
        self.step, self.samples, self.epoch, self.last_eval = p["step"], p["samples"], p["epoch"], p["last_eval"]
        self.window_base = p.get("blocks_outside_window", 0)
        per_batch = self.cfg.batch.micro_batch_size * self.world
        if p["samples_in_epoch"] % per_batch:
            raise ValueError(f"checkpoint data position {p['samples_in_epoch']} samples into epoch {self.epoch} is "
                             f"not a whole number of micro-batches x world size ({per_batch}): batch sizes changed")
        self.batch_in_epoch = p["samples_in_epoch"] // per_batch
        set_rng_state(meta["rng"])
        restore_gathered_held(self.model, meta.get("held_col_erefs"), self.rank, self.world)

    def save(self, path: str | Path | None = None, *, sharded: bool | None = None) -> Path:
        """Write a checkpoint atomically; a collective under FSDP2/DDP.

        Alone (or `sharded=False`): one file, `latest.pt` by default, written by rank 0. Under torchrun: a
        sharded `torch.distributed.checkpoint` directory, `latest.dcp/` by default, each rank writing its
        shards (no weight is gathered), renamed into place once all are done."""
        sharded = self.world > 1 if sharded is None else sharded
        default = path is None
        path = Path(self.out_dir / (LATEST_SHARDED if sharded else LATEST) if default else path)
        if sharded:
            save_sharded_checkpoint(path, self._tensors(full=False), self._meta_state(), rank=self.rank)
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
        # Destination tensors: this rank's shards (FSDP2) or whole tensors (DDP, one process);
        # dcp.load reads just those pieces, whatever sharding wrote them.
        tensors = self._tensors(full=False)
        if self.ema is not None and not sharded_has(path, "ema."):
            self._load_ema({})  # the error that names the missing averages, before dcp's own
        meta = load_sharded_checkpoint(path, tensors)
        load_model_optimizer_state(self.model, self.optimizer, tensors, full=False, world_size=self.world)
        self._load_ema(tensors)
        self._load_meta(meta)

    # --- the whole run ------------------------------------------------------------------------

    def fit(self, *, progress: bool = True, max_steps: int | None = None) -> dict:
        """Train to `train.train_samples`, or until the run has taken `max_steps` optimizer steps
        in all (steps before a resume count); see `mxflux.train.loop.fit`."""
        from .loop import fit

        return fit(self, progress=progress, max_steps=max_steps)
