"""`mxflux train | eval | sample | check-config`: the command-line face of the trainer."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

__all__ = ["add_train_parser", "add_eval_parser", "add_sample_parser", "add_check_config_parser"]

DEFAULT_RECIPE = "tiny-mxfp6"


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE,
                   help=f"built-in recipe name or a YAML file (default: {DEFAULT_RECIPE})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=3e-4 (repeatable)")


def _load(args):
    from .config import RecipeError, load_recipe

    try:
        return load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        args.parser.error(str(e))


def add_check_config_parser(sub) -> None:
    p = sub.add_parser("check-config", help="validate a recipe (and overrides) without running it")
    _recipe_args(p)
    p.set_defaults(handler=_check_config, parser=p)


def _check_config(args) -> int:
    import yaml

    cfg = _load(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    print(f"# OK: {cfg.name} is valid ({cfg.precision.name}, model {cfg.model.name}, "
          f"global batch {cfg.batch.global_batch_size})", file=sys.stderr)
    return 0


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a Flux model from a recipe (default: the tiny MXFP6 demo)",
                       description="Train with rectified flow. Writes metrics.csv, TensorBoard logs, "
                                   "loss_curve.png, checkpoints and samples.png to the run directory.")
    _recipe_args(p)
    p.add_argument("--out", help="run directory (default: the recipe's train.out_dir)")
    p.add_argument("--resume", metavar="CKPT",
                   help="resume from a checkpoint (latest.pt file, sharded latest.dcp/ directory, or run "
                        "directory), onto any number of ranks")
    p.add_argument("--device", help="cpu, cuda, cuda:1 … (default: cuda if available; LOCAL_RANK under torchrun)")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (for smoke runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.csv)")
    p.set_defaults(handler=_train, parser=p)


def _train(args) -> int:
    import torch

    from .distributed import cleanup, init_distributed
    from .trainer import Trainer

    cfg = _load(args)
    if args.resume:
        from .checkpoint import CheckpointNotFoundError, resolve_checkpoint

        try:
            resolve_checkpoint(args.resume)
        except CheckpointNotFoundError as e:
            args.parser.error(str(e))
    ctx = init_distributed(torch.device(args.device).type if args.device else None)  # gloo for --device cpu
    device = torch.device(args.device) if args.device else ctx.device
    trainer = Trainer(cfg, ctx=ctx, device=device, out_dir=args.out)
    try:
        if args.resume:
            trainer.resume(args.resume)
        if ctx.is_main:
            r = trainer.precision_report
            print(f"{cfg.name}: {cfg.model.name}, {cfg.precision.name}: {len(r.swapped)} linears swapped, "
                  f"{len(r.kept_bf16)} kept bf16; data {trainer.data_root}; world {ctx.world_size}; "
                  f"device {device}; out {trainer.out_dir}")
        result = trainer.fit(progress=not args.no_progress, max_steps=args.max_steps)
        if ctx.is_main:
            if cfg.train.sample_prompts:
                grid = _sample_to_grid(trainer.model, trainer.train_set, list(cfg.train.sample_prompts),
                                       steps=cfg.train.sample_steps, seed=cfg.train.seed,
                                       out=trainer.out_dir / "samples.png", dtype=trainer.compute_dtype,
                                       guidance=cfg.train.sample_guidance)
                if grid:
                    result["samples_png"] = str(grid)
            result["checkpoint"] = str(trainer.last_checkpoint)
            result["loss_curve"] = str(trainer.out_dir / "loss_curve.png")
            print(json.dumps(result, indent=1))
    finally:
        cleanup()
    return 0


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="validation loss of a checkpoint (fixed t = k/8, fixed noise)")
    p.add_argument("checkpoint", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--samples", type=int, help="evaluate on the first N eval samples (default: the recipe's)")
    p.add_argument("--device")
    p.set_defaults(handler=_eval, parser=p)


def _trainer_from_checkpoint(path: str, device, parser):
    from .checkpoint import CheckpointNotFoundError, load_checkpoint, read_checkpoint_meta, resolve_checkpoint
    from .config import RunConfig
    from .trainer import Trainer

    try:
        path = resolve_checkpoint(path)
    except CheckpointNotFoundError as e:
        parser.error(str(e))
    if path.is_dir():  # sharded: read the config alone, then the shards straight into the model
        trainer = Trainer(RunConfig(**read_checkpoint_meta(path)["config"]), device=device)
        trainer.resume(path)
        return trainer
    state = load_checkpoint(path, map_location="cpu")
    trainer = Trainer(RunConfig(**state["config"]), device=device)
    trainer.load_state_dict(state)
    return trainer


def _eval(args) -> int:
    trainer = _trainer_from_checkpoint(args.checkpoint, args.device, args.parser)
    loss = trainer.evaluate(args.samples)
    print(json.dumps({"checkpoint": args.checkpoint, "step": trainer.step, "samples": trainer.samples,
                      "eval_loss": loss}))
    return 0


def add_sample_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate images for prompts with a checkpoint (Euler, rectified flow)")
    p.add_argument("checkpoint", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="Euler steps (default: 20)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale, 1 = none "
                                                  "(default: the checkpoint recipe's train.sample_guidance)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="samples.png", help="PNG grid to write (default: samples.png)")
    p.add_argument("--device")
    for name in ("vae", "t5", "clip"):
        p.add_argument(f"--{name}", help=f"local {name.upper()} model path (datasets made by `mxflux data prepare`)")
    p.add_argument("--t5-tokenizer", metavar="PATH", help="T5 tokenizer directory (default: --t5; FLUX.1: tokenizer_2/)")
    p.add_argument("--clip-tokenizer", metavar="PATH", help="CLIP tokenizer directory (default: --clip; FLUX.1: tokenizer/)")
    p.set_defaults(handler=_sample, parser=p)


def _sample(args) -> int:
    trainer = _trainer_from_checkpoint(args.checkpoint, args.device, args.parser)
    encoders = None
    if args.vae or args.t5 or args.clip:
        if not (args.vae and args.t5 and args.clip):
            args.parser.error("--vae, --t5 and --clip: give all three, or none for the demo dataset")
        from ..data.prepare import _Encoders

        encoders = _Encoders(vae_path=args.vae, t5_path=args.t5, clip_path=args.clip,
                             t5_tokenizer_path=args.t5_tokenizer, clip_tokenizer_path=args.clip_tokenizer,
                             t5_len=trainer.train_set.t5_shape[0],
                             device=trainer.device, dtype=trainer.compute_dtype)
    guidance = trainer.cfg.train.sample_guidance if args.guidance is None else args.guidance
    if guidance < 0:
        args.parser.error(f"--guidance: expected a scale >= 0, got {guidance}")
    grid = _sample_to_grid(trainer.model, trainer.train_set, args.prompt, steps=args.steps, seed=args.seed,
                           out=Path(args.out), dtype=trainer.compute_dtype, encoders=encoders, guidance=guidance)
    if grid is None:
        args.parser.error("this dataset has no built-in decoder: pass --vae, --t5 and --clip")
    print(json.dumps({"samples": str(grid), "prompts": args.prompt}))
    return 0


def _sample_to_grid(model, dataset, prompts, *, steps, seed, out, dtype, encoders=None, guidance=1.0):
    """Encode prompts, sample latents, decode and save a grid; None if no decoder is known."""
    import torch

    from ..data import load_empty_encodings

    from .sample import generate_latents, save_grid

    decoder_name = dataset.meta.source.get("decoder")
    if encoders is None:
        if dataset.meta.source.get("kind") != "demo" and not decoder_name:
            return None
        from ..data import encode_demo_prompts

        t5, clip = encode_demo_prompts(prompts)
        module, _, fn = decoder_name.rpartition(".")
        decode = getattr(importlib.import_module(module), fn)
    else:
        t5, clip = encoders.captions(prompts)

        def decode(z):
            with torch.no_grad():
                x = encoders.vae.decode(z.to(encoders.device, encoders.dtype)).sample.float()
            return (x + 1) / 2

    # The guidance's empty prompt: the dataset's own empty encodings (what CFG dropout trained on).
    empty = load_empty_encodings(dataset.root) if guidance != 1.0 else None
    z = generate_latents(model, t5, clip, latent_shape=dataset.latent_shape, steps=steps, seed=seed,
                         shift=dataset.latent_shift, scale=dataset.latent_scale, dtype=dtype,
                         guidance=guidance, empty=empty)
    images = decode(z.cpu() if encoders is None else z)
    return save_grid(images.cpu(), out, captions=list(prompts))
