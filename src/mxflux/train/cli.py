"""`mxflux train | eval | sample | check-config | recipes`: the command-line face of the trainer."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

from ..argtypes import non_negative_int, positive_int

__all__ = ["add_train_parser", "add_eval_parser", "add_sample_parser", "add_check_config_parser",
           "add_recipes_parser"]

DEFAULT_RECIPE = "tiny-mxfp6"


def _recipe_args(p: argparse.ArgumentParser, *, default: str | None = DEFAULT_RECIPE) -> None:
    shown = f" (default: {default})" if default else ""
    p.add_argument("recipe", nargs="?", default=default,
                   help=f"built-in recipe name (`mxflux recipes` lists them) or a YAML file{shown}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=3e-4 (repeatable)")


def _load(args, recipe: str | None = None):
    from .config import RecipeError, load_recipe

    try:
        return load_recipe(recipe or args.recipe, args.overrides)
    except RecipeError as e:
        args.parser.error(str(e))


def _device(args):
    """--device, checked: a CUDA device where there is none is a user error, not a traceback."""
    import torch

    if not args.device:
        return None
    try:
        device = torch.device(args.device)
    except RuntimeError:
        args.parser.error(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            args.parser.error(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            args.parser.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def add_recipes_parser(sub) -> None:
    p = sub.add_parser("recipes", help="list the built-in recipes, one line each",
                       description="The built-in recipes with their descriptions. Any command that takes a "
                                   "recipe takes one of these names or the path of a YAML file.")
    p.set_defaults(handler=_recipes, parser=p)


def _recipes(args) -> int:
    from .config import recipe_descriptions

    items = recipe_descriptions()
    width = max(map(len, items))
    for name, text in items.items():
        print(f"{name:<{width}}  {text}")
    return 0


def add_check_config_parser(sub) -> None:
    p = sub.add_parser("check-config", help="validate a recipe (and overrides) without running it",
                       description="Validate a recipe with its overrides and print the full config as YAML; "
                                   "warns (on stderr) about paths in it that do not exist.")
    _recipe_args(p)
    p.set_defaults(handler=_check_config, parser=p)


def _check_config(args) -> int:
    import yaml

    cfg = _load(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    # Precision patterns are checked against the real module names: a dry run on the meta device.
    import torch

    from ..model import Flux
    from ..nn import apply_precision

    with torch.device("meta"):
        model = Flux(cfg.model.flux_config())
    try:
        print(apply_precision(model, cfg.precision).format(), file=sys.stderr)
    except ValueError as e:
        args.parser.error(str(e))
    for field, path in _recipe_paths(cfg):
        if not Path(path).exists():
            print(f"# warning: {field} {path!r} does not exist", file=sys.stderr)
    print(f"# OK: {cfg.name} is valid ({cfg.precision.name}, model {cfg.model.name}, "
          f"global batch {cfg.batch.global_batch_size})", file=sys.stderr)
    return 0


def _recipe_paths(cfg) -> list[tuple[str, str]]:
    """(field, path) of every input path a recipe names."""
    paths = [("data.root", cfg.data.root)]
    init_from = getattr(cfg.model, "init_from", None)
    if isinstance(init_from, str):
        paths.append(("model.init_from", init_from))
    return [(f, p) for f, p in paths if p]


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a Flux model from a recipe (default: the tiny MXFP6 demo)",
                       description="Train with rectified flow. Writes metrics.csv, TensorBoard logs, "
                                   "loss_curve.png, checkpoints and samples.png to the run directory. A run "
                                   "directory belongs to one run: a new run refuses a directory that holds "
                                   "one (--resume continues it there, --overwrite starts over). Ctrl-C "
                                   "(SIGINT) or SIGTERM finishes the step, writes a checkpoint and exits.")
    _recipe_args(p, default=None)
    p.add_argument("--out", metavar="DIR",
                   help="run directory (default: the recipe's train.out_dir; with --resume, the resumed run's)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR (a run directory, or a latest.pt / latest.dcp/ checkpoint in "
                        "it), on any number of ranks; its recipe is the checkpoint's unless RECIPE is given")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run even where another run's files are (they are deleted first)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available; LOCAL_RANK under torchrun)")
    p.add_argument("--max-steps", type=positive_int, metavar="N",
                   help="stop once the run has taken N optimizer steps in all (steps before a resume count); "
                        "the run stays unfinished and --resume continues it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.csv)")
    p.set_defaults(handler=_train, parser=p)


def _train(args) -> int:
    from .checkpoint import CheckpointNotFoundError, load_checkpoint, read_checkpoint_meta, resolve_checkpoint
    from .config import RecipeError, config_from_dict
    from .distributed import cleanup, init_distributed
    from .rundir import check_new_run
    from .stop import TrainingInterrupted
    from .trainer import Trainer, total_steps

    device = _device(args)
    state = None
    if args.resume:
        try:
            ckpt = resolve_checkpoint(args.resume)
        except CheckpointNotFoundError as e:
            args.parser.error(str(e))
        state = load_checkpoint(ckpt) if ckpt.is_file() else read_checkpoint_meta(ckpt)
        if args.recipe:
            cfg = _load(args)
        else:
            try:
                cfg = config_from_dict(state["config"], f"of checkpoint {ckpt}", args.overrides)
            except RecipeError as e:
                args.parser.error(str(e))
        run_dir = ckpt.parent
        out = Path(args.out) if args.out else run_dir
        done, end = state["progress"]["step"], min(total_steps(cfg), args.max_steps or total_steps(cfg))
        if done >= end:
            print(f"{run_dir}: the run is at step {done} of {end}; nothing to train, nothing changed. "
                  f"To train longer, raise train.train_samples (now {cfg.train.train_samples}) with --set.",
                  file=sys.stderr)
            return 0
    else:
        cfg = _load(args, args.recipe or DEFAULT_RECIPE)
        run_dir, out = None, Path(args.out) if args.out else cfg.out_dir
    ctx = init_distributed(device.type if device is not None else None)  # gloo for --device cpu
    try:
        if run_dir is None or out.resolve() != run_dir.resolve():
            if ctx.is_main:
                check_new_run(out, overwrite=args.overwrite)
            _barrier(ctx)
        callbacks = []
        if cfg.mlperf.enabled:  # constructed first: the timed MLPerf "init" phase starts here
            from .mlperf import MLPerfCallback

            callbacks.append(MLPerfCallback(out, cfg, rank=ctx.rank, world_size=ctx.world_size))
        trainer = Trainer(cfg, ctx=ctx, device=device, out_dir=out, callbacks=callbacks)
        if state is not None and ckpt.is_file():
            trainer.load_state_dict(state)
        elif state is not None:
            trainer.resume(ckpt)
        del state
        if ctx.is_main:
            r = trainer.precision_report
            print(f"{cfg.name}: {cfg.model.name}, {cfg.precision.name}: {len(r.swapped)} linears swapped, "
                  f"{len(r.kept_bf16)} kept bf16; data {trainer.data_root}; world {ctx.world_size}; "
                  f"device {trainer.device}; out {trainer.out_dir}"
                  + (f"; resuming at step {trainer.step}" if trainer.step else ""))
        try:
            result = trainer.fit(progress=not args.no_progress, max_steps=args.max_steps)
        except TrainingInterrupted as e:
            if ctx.is_main:
                print(f"{signal_name(e.signum)}: stopped after step {e.step}; checkpoint {e.checkpoint}; "
                      f"continue with: mxflux train --resume {out}", file=sys.stderr)
            return e.exit_code
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
            print(json_text(result))
    finally:
        cleanup()
    return 0


def _barrier(ctx) -> None:
    if ctx.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def json_text(obj, **kw) -> str:
    """JSON that every parser accepts: a non-finite float becomes null (bare NaN is not JSON)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), allow_nan=False, **kw)


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="validation loss of a checkpoint (fixed t = k/8, fixed noise)",
                       description="The validation loss of a checkpoint on its recipe's eval split, as training "
                                   "logs it: each sample at its fixed timestep t = k/8 with fixed noise, "
                                   "sum(loss)/count. Prints one JSON object; writes nothing.")
    p.add_argument("checkpoint", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--samples", type=positive_int, metavar="N",
                   help="evaluate on the first N eval samples (default: the recipe's train.eval_samples)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.set_defaults(handler=_eval, parser=p)


def _trainer_from_checkpoint(args):
    """A trainer with a checkpoint's recipe and state, alone in this process; writes nothing."""
    from .checkpoint import CheckpointNotFoundError, load_checkpoint, read_checkpoint_meta, resolve_checkpoint
    from .config import RecipeError, config_from_dict
    from .distributed import alone
    from .trainer import Trainer

    device = _device(args)
    try:
        path = resolve_checkpoint(args.checkpoint)
    except CheckpointNotFoundError as e:
        args.parser.error(str(e))
    # A sharded checkpoint: the config alone first, then the shards straight into the model.
    state = read_checkpoint_meta(path) if path.is_dir() else load_checkpoint(path, map_location="cpu")
    try:
        cfg = config_from_dict(state["config"], f"of checkpoint {path}")
    except RecipeError as e:
        args.parser.error(str(e))
    trainer = Trainer(cfg, ctx=alone(device.type if device is not None else None), device=device)
    if path.is_dir():
        trainer.resume(path)
    else:
        trainer.load_state_dict(state)
    return trainer


def _eval(args) -> int:
    trainer = _trainer_from_checkpoint(args)
    loss = trainer.evaluate(args.samples)
    print(json_text({"checkpoint": args.checkpoint, "step": trainer.step, "samples": trainer.samples,
                     "eval_loss": loss}))
    return 0


def add_sample_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate images for prompts with a checkpoint (Euler, rectified flow)",
                       description="Generate one image per prompt with a checkpoint (Euler steps of the "
                                   "rectified flow, optional classifier-free guidance) and save them as a "
                                   "captioned PNG grid. The demo dataset decodes by itself; a prepared "
                                   "dataset needs its VAE and text encoders (--vae, --t5, --clip).")
    p.add_argument("checkpoint", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--steps", type=positive_int, default=20, help="Euler steps (default: 20)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale, 1 = none "
                                                  "(default: the checkpoint recipe's train.sample_guidance)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the initial noise (default: 0)")
    p.add_argument("--out", default="samples.png", help="PNG grid to write (default: samples.png)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    for name in ("vae", "t5", "clip"):
        p.add_argument(f"--{name}", help=f"local {name.upper()} model path (datasets made by `mxflux data prepare`)")
    p.add_argument("--t5-tokenizer", metavar="PATH", help="T5 tokenizer directory (default: --t5; FLUX.1: tokenizer_2/)")
    p.add_argument("--clip-tokenizer", metavar="PATH", help="CLIP tokenizer directory (default: --clip; FLUX.1: tokenizer/)")
    p.set_defaults(handler=_sample, parser=p)


def _sample(args) -> int:
    trainer = _trainer_from_checkpoint(args)
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
    print(json_text({"samples": str(grid), "prompts": args.prompt}))
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
