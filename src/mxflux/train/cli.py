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
    _check_init_from(cfg, args.parser)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    print(f"# OK: {cfg.name} is valid ({cfg.precision.name}, model {cfg.model.name}, "
          f"global batch {cfg.batch.global_batch_size})", file=sys.stderr)
    return 0


def _check_init_from(cfg, parser) -> None:
    """model.init_from exists and fits the model config (read from the file headers, no tensor)."""
    if not cfg.model.init_from:
        return
    from ..model import FluxCheckpoint, FluxWeightsError, check_flux_weights

    try:
        check_flux_weights(FluxCheckpoint(cfg.model.init_from).shapes, cfg.model.flux_config(),
                           source=f"model.init_from {cfg.model.init_from}")
    except FluxWeightsError as e:
        parser.error(str(e))


def _with_init_from(cfg, weights: str | None):
    """The config with model.init_from replaced (None: a run checkpoint supplies the weights)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": weights})})


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

    from .distributed import cleanup, init_distributed, wrap_model
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
    trainer = Trainer(cfg, device=device, out_dir=args.out,
                      wrap_model=lambda m: wrap_model(m, cfg.distributed, ctx,
                                                      param_dtype=getattr(torch, cfg.train.compute_dtype)))
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
    p.add_argument("checkpoint", nargs="?", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--weights", metavar="PATH",
                   help="instead of a run checkpoint: released Flux weights (BFL .safetensors, diffusers "
                        "transformer/ or pipeline folder), evaluated under --recipe")
    p.add_argument("--recipe", help="with --weights: the recipe giving the model config, precision, data and "
                                    "eval settings (a built-in name or a YAML file)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --weights: override a recipe field (repeatable)")
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
    # The checkpoint holds the trained weights: the run's init_from weights are not read again.
    if path.is_dir():  # sharded: read the config alone, then the shards straight into the model
        trainer = Trainer(_with_init_from(RunConfig(**read_checkpoint_meta(path)["config"]), None), device=device)
        trainer.resume(path)
        return trainer
    state = load_checkpoint(path, map_location="cpu")
    trainer = Trainer(_with_init_from(RunConfig(**state["config"]), None), device=device)
    trainer.load_state_dict(state)
    return trainer


def _trainer_from_weights(args):
    """A Trainer of --recipe (with --set overrides) whose model starts from --weights."""
    from .config import RecipeError, load_recipe
    from .trainer import Trainer

    if not args.recipe:
        args.parser.error("--weights needs --recipe: the model config, precision, data and eval settings")
    try:
        cfg = _with_init_from(load_recipe(args.recipe, args.overrides), args.weights)
    except RecipeError as e:
        args.parser.error(str(e))
    _check_init_from(cfg, args.parser)
    return Trainer(cfg, device=args.device)


def _eval(args) -> int:
    if (args.checkpoint is None) == (args.weights is None):
        args.parser.error("give a run checkpoint or --weights PATH (with --recipe), not both")
    if args.weights is None and (args.recipe or args.overrides):
        args.parser.error("--recipe and --set go with --weights; a run checkpoint carries its own recipe")
    if args.weights:
        trainer = _trainer_from_weights(args)
    else:
        trainer = _trainer_from_checkpoint(args.checkpoint, args.device, args.parser)
    loss = trainer.evaluate(args.samples)
    print(json.dumps({"checkpoint": args.checkpoint or args.weights, "step": trainer.step,
                      "samples": trainer.samples, "eval_loss": loss}))
    return 0


def add_sample_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate images for prompts with a checkpoint or released Flux weights "
                                      "(Euler, rectified flow)")
    p.add_argument("checkpoint", nargs="?", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--weights", metavar="PATH",
                   help="instead of a run checkpoint: Flux weights (BFL .safetensors, diffusers transformer/ "
                        "or pipeline folder); the model config is inferred from them unless --model is given")
    p.add_argument("--model", help="with --weights: a built-in model config the weights must fit (e.g. flux-12b)")
    p.add_argument("--data", metavar="ROOT", help="with --weights and no --t5/--clip: the dataset whose own text "
                                                  "encoder (and decoder, without --vae) to use (default: the demo)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="Euler steps (default: 20)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale, 1 = none (default: the "
                                                  "checkpoint recipe's train.sample_guidance; 1 with --weights)")
    p.add_argument("--distilled-guidance", type=float, default=None, metavar="G",
                   help="the guidance input of guidance-distilled models (FLUX.1-dev; default: 3.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="samples.png", help="PNG grid to write (default: samples.png)")
    p.add_argument("--device")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="compute dtype (default: the checkpoint recipe's; with --weights bfloat16 on CUDA, "
                        "float32 on the CPU)")
    p.add_argument("--vae", help="a diffusers AutoencoderKL folder (or a pipeline folder with vae/) to decode with")
    for name in ("t5", "clip"):
        p.add_argument(f"--{name}", help=f"local {name.upper()} model path (give --vae, --t5 and --clip together "
                                         f"for prompts in natural language; without them the demo encoder)")
    p.add_argument("--t5-tokenizer", metavar="PATH", help="T5 tokenizer directory (default: --t5; FLUX.1: tokenizer_2/)")
    p.add_argument("--clip-tokenizer", metavar="PATH", help="CLIP tokenizer directory (default: --clip; FLUX.1: tokenizer/)")
    p.add_argument("--t5-len", type=int, help="T5 tokens per prompt (default: the dataset's; 256 with --weights, "
                                              "FLUX.1-schnell's; FLUX.1-dev takes 512)")
    p.add_argument("--height", type=int, help="image height in pixels, with --vae (default: the dataset's; 512)")
    p.add_argument("--width", type=int, help="image width in pixels, with --vae (default: the dataset's; 512)")
    p.set_defaults(handler=_sample, parser=p)


def _sample(args) -> int:
    import torch

    if (args.checkpoint is None) == (args.weights is None):
        args.parser.error("give a run checkpoint or --weights PATH, not both")
    if (args.model or args.data) and not args.weights:
        args.parser.error("--model and --data go with --weights; a run checkpoint carries its model and data")
    if (args.t5 or args.clip) and not (args.vae and args.t5 and args.clip):
        args.parser.error("--t5 and --clip: give them with --vae (all three), or none for the demo encoder")
    if args.weights:
        from ..data import LatentDataset, ensure_demo_dataset
        from ..model import FluxWeightsError, flux_config, flux_from_checkpoint
        from .trainer import DEMO_DATA_DIR, default_device

        device = torch.device(args.device) if args.device else default_device()
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda"
                                                                 else torch.float32)
        try:
            config = flux_config(args.model) if args.model else None
            model = flux_from_checkpoint(args.weights, config, device=device, dtype=dtype)
        except (FluxWeightsError, ValueError) as e:
            args.parser.error(f"--weights: {e}")
        # Without real text encoders, prompts go through a dataset's own (the demo's) encoder.
        dataset = None if args.t5 else LatentDataset(args.data or ensure_demo_dataset(DEMO_DATA_DIR), "train")
        default_guidance = 1.0
    else:
        trainer = _trainer_from_checkpoint(args.checkpoint, args.device, args.parser)
        model, dataset, device = trainer.model, trainer.train_set, trainer.device
        dtype = getattr(torch, args.dtype) if args.dtype else trainer.compute_dtype
        default_guidance = trainer.cfg.train.sample_guidance
    guidance = default_guidance if args.guidance is None else args.guidance
    if guidance < 0:
        args.parser.error(f"--guidance: expected a scale >= 0, got {guidance}")

    encoders = vae = None
    if args.t5:
        from ..data.prepare import _Encoders

        t5_len = args.t5_len or (dataset.t5_shape[0] if dataset is not None else 256)
        encoders = _Encoders(vae_path=args.vae, t5_path=args.t5, clip_path=args.clip,
                             t5_tokenizer_path=args.t5_tokenizer, clip_tokenizer_path=args.clip_tokenizer,
                             t5_len=t5_len, device=device, dtype=dtype)
    elif args.vae:
        from .sample import VaeDecoder

        vae = VaeDecoder.from_pretrained(args.vae, device=device, dtype=dtype)
    size = None
    if args.height or args.width:
        if not args.vae:
            args.parser.error("--height/--width: the image size is set with --vae (else the dataset's)")
        size = (args.height or args.width, args.width or args.height)
    elif args.vae and dataset is None:
        size = (512, 512)
    try:
        grid = _sample_to_grid(model, dataset, args.prompt, steps=args.steps, seed=args.seed, out=Path(args.out),
                               dtype=dtype, encoders=encoders, guidance=guidance, vae=vae, image_size=size,
                               distilled_guidance=args.distilled_guidance)
    except ValueError as e:
        args.parser.error(str(e))
    if grid is None:
        args.parser.error("this dataset has no built-in decoder: pass --vae, --t5 and --clip")
    print(json.dumps({"samples": str(grid), "prompts": args.prompt}))
    return 0


def _sample_to_grid(model, dataset, prompts, *, steps, seed, out, dtype, encoders=None, guidance=1.0, vae=None,
                    image_size=None, distilled_guidance=None):
    """Encode prompts, sample latents, decode and save a grid; None if no decoder is known.

    Text: `encoders` (real T5 and CLIP), else the dataset's own encoder (the demo's). Decoder and
    latent geometry: a VAE (`encoders.vae` or `vae`; `image_size` pixels, default the dataset's
    latent size), else the dataset's built-in decoder.
    """
    from ..data import load_empty_encodings

    from .sample import DEFAULT_DISTILLED_GUIDANCE, VaeDecoder, generate_latents, save_grid

    if encoders is not None:
        encode = encoders.captions
        vae = VaeDecoder(encoders.vae, device=encoders.device, dtype=encoders.dtype)
    else:
        source = dataset.meta.source
        if source.get("kind") != "demo" and not source.get("decoder"):
            return None
        from ..data import encode_demo_prompts as encode

    if vae is not None:
        if image_size is None:
            latent = dataset.latent_shape[1:]
            image_size = (latent[0] * vae.downsample, latent[1] * vae.downsample)
        latent_shape = vae.latent_shape(*image_size)
        shift, scale, decode = vae.latent_shift, vae.latent_scale, vae.decode
    else:
        module, _, fn = dataset.meta.source["decoder"].rpartition(".")
        latent_shape, shift, scale = dataset.latent_shape, dataset.latent_shift, dataset.latent_scale
        decode = getattr(importlib.import_module(module), fn)
    in_channels = model.config.in_channels
    if 4 * latent_shape[0] != in_channels:
        raise ValueError(f"the decoder's latents have {latent_shape[0]} channels; this model takes "
                         f"{in_channels // 4} (in_channels {in_channels} = 4 x latent channels)")

    t5, clip = encode(prompts)
    if (t5.shape[-1], clip.shape[-1]) != (model.config.context_in_dim, model.config.vec_in_dim):
        raise ValueError(f"the text encodings are T5 {t5.shape[-1]} / CLIP {clip.shape[-1]} wide; this model "
                         f"takes {model.config.context_in_dim} / {model.config.vec_in_dim}: pass --vae, --t5 and "
                         f"--clip (FLUX.1: text_encoder_2/, text_encoder/)")
    empty = None
    if guidance != 1.0:  # the empty prompt: the dataset's own encodings (what CFG dropout trained on)
        if dataset is not None:
            empty = load_empty_encodings(dataset.root)
        else:
            t5_empty, clip_empty = encode([""])
            empty = (t5_empty[0], clip_empty[0])
    z = generate_latents(model, t5, clip, latent_shape=latent_shape, steps=steps, seed=seed, shift=shift,
                         scale=scale, dtype=dtype, guidance=guidance, empty=empty,
                         distilled_guidance=DEFAULT_DISTILLED_GUIDANCE if distilled_guidance is None
                         else distilled_guidance)
    images = decode(z if vae is not None else z.cpu())
    return save_grid(images.cpu(), out, captions=list(prompts))
