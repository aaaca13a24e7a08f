"""`mxflux train | eval | sample | check-config | recipes`: the command-line face of the trainer."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
from pathlib import Path

from ..argtypes import non_negative_int, positive_int
from .datacheck import check_recipe_data, warn_unknown_prompt_words

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
    if device.type not in ("cpu", "cuda"):
        args.parser.error(f"--device {args.device}: mxflux runs on cpu or cuda (cuda:N); {device.type} is not "
                          f"supported")
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
    _check_init_from(cfg, args.parser, missing_ok=True)
    check_recipe_data(cfg, args.parser)
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
        elif field == "data.root" and not Path(path).is_dir():
            print(f"# warning: {field} {path!r} is a file, expected a dataset directory", file=sys.stderr)
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
def _check_init_from(cfg, parser, *, missing_ok: bool = False) -> None:
    """model.init_from exists and fits the model config (read from the file headers, no tensor).
    `missing_ok`: a path that does not exist is not checked (check-config warns about it)."""
    if not cfg.model.init_from or (missing_ok and not Path(cfg.model.init_from).exists()):
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
                                   "loss_curve.png, checkpoints and samples.png to the run directory. A run "
                                   "directory belongs to one run: a new run refuses a directory that holds "
                                   "one (--resume continues it there, --overwrite starts over). Ctrl-C "
                                   "(SIGINT), SIGTERM or SIGHUP finishes the step, writes a checkpoint and exits. One "
                                   "command at a time owns a run directory (a lock held for the run's life).")
    _recipe_args(p, default=None)
    p.add_argument("--out", metavar="DIR",
                   help="run directory (default: the recipe's train.out_dir; with --resume, the resumed run's)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR (a run directory, or a latest.pt / latest.dcp/ checkpoint in "
                        "it), on any number of ranks; its recipe is the checkpoint's unless RECIPE is given")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run even where another run's files are (they are deleted first)")
    p.add_argument("--allow-precision-change", action="store_true",
                   help="with --resume and a RECIPE (or --set precision...): continue the run in another "
                        "precision on purpose (any other difference from the checkpoint's run is refused)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available; LOCAL_RANK under torchrun)")
    p.add_argument("--max-steps", type=positive_int, metavar="N",
                   help="stop once the run has taken N optimizer steps in all (steps before a resume count); "
                        "the run stays unfinished and --resume continues it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.csv)")
    p.set_defaults(handler=_train, parser=p)


def _train(args) -> int:
    from .phases import DISK_FULL, TrainPhase
    from .stop import Interrupted, signals_raise

    phase = TrainPhase()
    try:
        with signals_raise():  # SIGINT, SIGTERM, SIGHUP outside the steps: one line, nothing lost
            return _run_train(args, phase)
    except Interrupted as e:
        print(phase.interrupted(e.signum), file=sys.stderr)
        return 128 + e.signum
    except OSError as e:
        if e.errno in DISK_FULL:
            raise phase.disk_full(e) from e
        raise


def _run_train(args, phase) -> int:
    from .checkpoint import CheckpointNotFoundError, load_checkpoint, read_checkpoint_meta, resolve_checkpoint
    from .config import RecipeError, config_from_dict
    from .distributed import cleanup, init_distributed
    from .identity import check_same_data, check_same_run
    from .rundir import check_new_run, remove_leftovers
    from .runlock import RunLock
    from .stop import TrainingInterrupted
    from .trainer import Trainer, total_steps

    device = _device(args)
    if args.resume:
        try:
            ckpt = resolve_checkpoint(args.resume)
        except CheckpointNotFoundError as e:
            args.parser.error(str(e))
        run_dir = ckpt.parent
        out = Path(args.out) if args.out else run_dir
    else:
        cfg = _load(args, args.recipe or DEFAULT_RECIPE)
        run_dir, out = None, Path(args.out) if args.out else cfg.out_dir
    check_recipe_data(cfg, args.parser)  # before any work, not at the first forward or at the end's samples
    phase.out = out
    ctx = init_distributed(device.type if device is not None else None)  # gloo for --device cpu
    lock = RunLock(out) if ctx.is_main else None
    try:
        if lock is not None:  # before anything in `out` is read or written: one run per directory
            _note(lock.acquire().stale_note)
            remove_leftovers(out)
        state = identity = None
        samples_only = False  # a finished run whose final samples were never drawn: only those
        if args.resume:
            state = load_checkpoint(ckpt) if ckpt.is_file() else read_checkpoint_meta(ckpt)
            try:
                cfg = _load(args) if args.recipe else config_from_dict(state["config"], f"of checkpoint {ckpt}",
                                                                       args.overrides)
            except RecipeError as e:
                args.parser.error(str(e))
            identity = state.get("identity")
            changed = check_same_run(state["config"], identity, cfg, run_dir=run_dir,
                                     allow_precision_change=args.allow_precision_change)
            if changed and ctx.is_main:
                _note(f"note: continuing in another precision, as asked: {', '.join(changed)}")
            done, end = state["progress"]["step"], min(total_steps(cfg), args.max_steps or total_steps(cfg))
            phase.resume_step = done
            redraw = done >= total_steps(cfg) and cfg.train.sample_prompts and not (out / "samples.png").exists()
            if done >= end and not redraw:
                limit = (f"--max-steps (now {args.max_steps})" if end < total_steps(cfg)
                         else f"train.train_samples (now {cfg.train.train_samples}) with --set")
                print(f"{run_dir}: the run is at step {done} of {end}; nothing to train, nothing changed. "
                      f"To train longer, raise {limit}.", file=sys.stderr)
                return 0
            samples_only = done >= end
        if run_dir is None or out.resolve() != run_dir.resolve():
            if ctx.is_main:
                _note(check_new_run(out, overwrite=args.overwrite))
            _barrier(ctx)
        callbacks = []
        if cfg.mlperf.enabled:  # constructed first: the timed MLPerf "init" phase starts here
            from .mlperf import MLPerfCallback

            callbacks.append(MLPerfCallback(out, cfg, rank=ctx.rank, world_size=ctx.world_size))
        trainer = Trainer(cfg, ctx=ctx, device=device, out_dir=out, callbacks=callbacks)
        if state is not None:
            check_same_data(identity, trainer.train_set, run_dir=run_dir)
            if ckpt.is_file():
                trainer.load_state_dict(state)
            else:
                trainer.resume(ckpt)
        del state
        if ctx.is_main:
            r = trainer.precision_report
            print(f"{cfg.name}: {cfg.model.name}, {cfg.precision.name}: {len(r.swapped)} linears swapped, "
                  f"{len(r.kept_bf16)} kept bf16; data {trainer.data_root}; world {ctx.world_size}; "
                  f"device {trainer.device}; out {trainer.out_dir}"
                  + (f"; resuming at step {trainer.step}" if trainer.step else ""))
        phase.phase, phase.trainer = "training", trainer
        if not samples_only:
            try:
                result = trainer.fit(progress=not args.no_progress, max_steps=args.max_steps)
            except TrainingInterrupted as e:
                if ctx.is_main:
                    print(f"{signal_name(e.signum)}: stopped after step {e.step}; checkpoint {e.checkpoint}; "
                          f"continue with: mxflux train --resume {out}", file=sys.stderr)
                return e.exit_code
        else:
            trainer.last_checkpoint = ckpt
            result = {"step": trainer.step, "samples": trainer.samples, "eval_loss": trainer.last_eval}
        if ctx.is_main:
            phase.phase = "sampling"
            if cfg.train.sample_prompts:
                with trainer.sampling_weights():  # the EMA of the weights, where the recipe keeps one
                    grid = _sample_to_grid(trainer.model, trainer.train_set, list(cfg.train.sample_prompts),
                                           steps=cfg.train.sample_steps, seed=cfg.train.seed,
                                           out=trainer.out_dir / "samples.png", dtype=trainer.compute_dtype,
                                           guidance=cfg.train.sample_guidance, time_shift=cfg.train.sampler_shift,
                                           distilled_guidance=cfg.train.distilled_guidance)
                if grid:
                    result["samples_png"] = str(grid)
            result["checkpoint"] = str(trainer.last_checkpoint)
            result["loss_curve"] = str(trainer.out_dir / "loss_curve.png")
            print(json_text(result))
    finally:
        cleanup()
        if lock is not None:
            lock.release()
    return 0


def _note(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr)


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
    p = sub.add_parser("eval", help="validation loss of a checkpoint or of released Flux weights (fixed t = k/8, fixed noise)",
                       description="The validation loss of a checkpoint on its recipe's eval split, as training "
                                   "logs it: each sample at its fixed timestep t = k/8 with fixed noise, "
                                   "sum(loss)/count. Prints one JSON object; writes nothing.")
    p.add_argument("checkpoint", nargs="?", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--weights", metavar="PATH",
                   help="instead of a run checkpoint: released Flux weights (BFL .safetensors, diffusers "
                        "transformer/ or pipeline folder), evaluated under --recipe")
    p.add_argument("--recipe", help="with --weights: the recipe giving the model config, precision, data and "
                                    "eval settings (a built-in name or a YAML file)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --weights: override a recipe field (repeatable)")
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
        # The checkpoint holds the trained weights: the run's init_from weights are not read again.
        cfg = _with_init_from(config_from_dict(state["config"], f"of checkpoint {path}"), None)
    except RecipeError as e:
        args.parser.error(str(e))
    if cfg.data.root is None:  # a demo run: read the demo dataset, never build it here
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": str(_demo_root(args))})})
    trainer = Trainer(cfg, ctx=alone(device.type if device is not None else None), device=device)
    if path.is_dir():
        trainer.resume(path)
    else:
        trainer.load_state_dict(state)
    return trainer


def _demo_root(args) -> Path:
    """The built-in demo dataset, for commands that write nothing but their output (eval, sample):
    `runs/demo-data` where a run built it, else built (the same seeded data) in a temporary
    directory that lives as long as the command."""
    import tempfile

    from ..data import ensure_demo_dataset
    from ..data.shards import META_FILE
    from .trainer import DEMO_DATA_DIR

    if (DEMO_DATA_DIR / META_FILE).is_file():
        return DEMO_DATA_DIR
    args.scratch = tempfile.TemporaryDirectory(prefix="mxflux-demo-")
    return ensure_demo_dataset(Path(args.scratch.name) / "demo-data")


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
        trainer = _trainer_from_checkpoint(args)
    loss = trainer.evaluate(args.samples)
    print(json_text({"checkpoint": args.checkpoint or args.weights, "step": trainer.step,
                     "samples": trainer.samples, "eval_loss": loss}))
    return 0


def add_sample_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate images for prompts with a checkpoint or released Flux weights "
                                      "(Euler, rectified flow)",
                       description="Generate one image per prompt (Euler steps of the rectified flow, optional "
                                   "classifier-free guidance) and save them as a captioned PNG grid. The demo "
                                   "dataset decodes by itself; real prompts need --vae, --t5 and --clip.")
    p.add_argument("checkpoint", nargs="?", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--weights", metavar="PATH",
                   help="instead of a run checkpoint: Flux weights (BFL .safetensors, diffusers transformer/ "
                        "or pipeline folder); the model config is inferred from them unless --model is given")
    p.add_argument("--model", help="with --weights: a built-in model config the weights must fit (e.g. flux-12b)")
    p.add_argument("--data", metavar="ROOT", help="with --weights and no --t5/--clip: the dataset whose own text "
                                                  "encoder (and decoder, without --vae) to use (default: the demo)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--steps", type=positive_int, default=20, help="Euler steps (default: 20)")
    p.add_argument("--shift", type=float, metavar="S",
                   help="time shift of the Euler steps towards the noise, 1 = evenly spaced (default: the "
                        "checkpoint recipe's train.sample_shift, else its train.timestep_shift; 1 with --weights)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale, 1 = none (default: the "
                                                  "checkpoint recipe's train.sample_guidance; 1 with --weights)")
    p.add_argument("--distilled-guidance", type=float, default=None, metavar="G",
                   help="the guidance input of a guidance-distilled model (FLUX.1-dev; default: the checkpoint "
                        "recipe's train.distilled_guidance; 3.5 with --weights)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the initial noise (default: 0)")
    p.add_argument("--out", default="samples.png",
                   help="PNG grid to write, or a directory for DIR/samples.png (default: samples.png)")
    p.add_argument("--no-ema", action="store_true",
                   help="draw with the checkpoint's weights, not their moving average (which a run whose recipe "
                        "sets train.ema_decay keeps and draws with by default)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
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
    out = Path(args.out)
    if args.out.endswith(("/", os.sep)) or out.is_dir():
        out = out / "samples.png"
    elif out.suffix.lower() != ".png":
        args.parser.error(f"--out {args.out}: expected a .png file or a directory (for DIR/samples.png)")
    if args.no_ema and args.weights:
        args.parser.error("--no-ema goes with a run checkpoint; --weights are drawn with as they are")
    if (args.t5 or args.clip) and not (args.vae and args.t5 and args.clip):
        args.parser.error("--t5 and --clip: give them with --vae (all three), or none for the demo encoder")
    if args.weights:
        from ..data import LatentDataset
        from ..model import FluxWeightsError, flux_config, flux_from_checkpoint
        from .distributed import alone

        device = _device(args) or alone().device
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda"
                                                                 else torch.float32)
        try:
            config = flux_config(args.model) if args.model else None
            model = flux_from_checkpoint(args.weights, config, device=device, dtype=dtype)
        except (FluxWeightsError, ValueError) as e:
            args.parser.error(f"--weights: {e}")
        # Without real text encoders, prompts go through a dataset's own (the demo's) encoder.
        dataset = None if args.t5 else LatentDataset(args.data or _demo_root(args), "train")
        default_guidance, default_shift, trained_distilled = 1.0, 1.0, None
        weights = contextlib.nullcontext()
    else:
        trainer = _trainer_from_checkpoint(args)
        model, dataset, device = trainer.model, trainer.train_set, trainer.device
        dtype = getattr(torch, args.dtype) if args.dtype else trainer.compute_dtype
        default_guidance, default_shift = trainer.cfg.train.sample_guidance, trainer.cfg.train.sampler_shift
        trained_distilled = trainer.cfg.train.distilled_guidance
        weights = contextlib.nullcontext() if args.no_ema else trainer.sampling_weights()
    guidance = default_guidance if args.guidance is None else args.guidance
    if guidance < 0:
        args.parser.error(f"--guidance: expected a scale >= 0, got {guidance}")
    time_shift = default_shift if args.shift is None else args.shift
    if time_shift <= 0:
        args.parser.error(f"--shift: expected a shift > 0, got {time_shift}")
    from .guidance import sampling_distilled_guidance

    try:
        distilled = sampling_distilled_guidance(model.config.guidance_embed, args.distilled_guidance, trained_distilled)
    except ValueError as e:
        args.parser.error(str(e))

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
        with weights:
            grid = _sample_to_grid(model, dataset, args.prompt, steps=args.steps, seed=args.seed,
                                   out=out, dtype=dtype, encoders=encoders, guidance=guidance, vae=vae,
                                   image_size=size, distilled_guidance=distilled,
                                   time_shift=time_shift)
    except ValueError as e:
        args.parser.error(str(e))
    if grid is None:
        args.parser.error("this dataset has no built-in decoder: pass --vae, --t5 and --clip")
    print(json_text({"samples": str(grid), "prompts": args.prompt}))
    return 0


def _sample_to_grid(model, dataset, prompts, *, steps, seed, out, dtype, encoders=None, guidance=1.0, vae=None,
                    image_size=None, distilled_guidance=None, time_shift=1.0):
    """Encode prompts, sample latents, decode and save a grid; None if no decoder is known.

    Text: `encoders` (real T5 and CLIP), else the dataset's own encoder (the demo's). Decoder and
    latent geometry: a VAE (`encoders.vae` or `vae`; `image_size` pixels, default the dataset's
    latent size), else the dataset's built-in decoder.
    """
    from ..data import load_empty_encodings

    from .sample import VaeDecoder, generate_latents, save_grid

    if encoders is not None:
        encode = encoders.captions
        vae = VaeDecoder(encoders.vae, device=encoders.device, dtype=encoders.dtype)
    else:
        source = dataset.meta.source
        if source.get("kind") != "demo" and not source.get("decoder"):
            return None
        from ..data import encode_demo_prompts as encode

        warn_unknown_prompt_words(prompts)

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
                         distilled_guidance=distilled_guidance, time_shift=time_shift)
    images = decode(z if vae is not None else z.cpu())
    return save_grid(images.cpu(), out, captions=list(prompts))
