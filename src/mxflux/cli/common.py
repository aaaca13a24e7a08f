"""What the training commands share: loading a recipe with its overrides, the device, a run's
trainer from its checkpoint or from released weights, and their one-line notes."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


DEFAULT_RECIPE = "tiny-mxfp6"


def recipe_args(p: argparse.ArgumentParser, *, default: str | None = DEFAULT_RECIPE) -> None:
    shown = f" (default: {default})" if default else ""
    p.add_argument("recipe", nargs="?", default=default,
                   help=f"built-in recipe name (`mxflux recipes` lists them) or a YAML file{shown}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=3e-4 (repeatable)")


def load_run_config(args, recipe: str | None = None):
    from ..train.config import RecipeError, load_recipe

    try:
        return load_recipe(recipe or args.recipe, args.overrides)
    except RecipeError as e:
        args.parser.error(str(e))


def device_from_args(args):
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


def recipe_paths(cfg) -> list[tuple[str, str]]:
    """(field, path) of every input path a recipe names."""
    paths = [("data.root", cfg.data.root)]
    init_from = getattr(cfg.model, "init_from", None)
    if isinstance(init_from, str):
        paths.append(("model.init_from", init_from))
    return [(f, p) for f, p in paths if p]


def check_init_from(cfg, parser, *, missing_ok: bool = False) -> None:
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


def with_init_from(cfg, weights: str | None):
    """The config with model.init_from replaced (None: a run checkpoint supplies the weights)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": weights})})


def note(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr)


def barrier(ctx) -> None:
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


def trainer_from_checkpoint(args):
    """A trainer with a checkpoint's recipe and state, alone in this process; writes nothing."""
    from ..train.checkpoint import CheckpointNotFoundError, load_checkpoint, read_checkpoint_meta, resolve_checkpoint
    from ..train.config import RecipeError, config_from_dict
    from ..train.distributed import alone
    from ..train.identity import check_run_id
    from ..train.trainer import Trainer

    device = device_from_args(args)
    try:
        path = resolve_checkpoint(args.checkpoint)
    except CheckpointNotFoundError as e:
        args.parser.error(str(e))
    # A sharded checkpoint: the config alone first, then the shards straight into the model.
    state = read_checkpoint_meta(path) if path.is_dir() else load_checkpoint(path, map_location="cpu")
    check_run_id(state, path.parent, path)
    try:
        cfg = config_from_dict(state["config"], f"of checkpoint {path}")
        if cfg.lora is None:  # the checkpoint holds the trained weights: init_from's are not read again
            cfg = with_init_from(cfg, None)  # (a LoRA run's holds its adapters; the base is rebuilt from init_from)
    except RecipeError as e:
        args.parser.error(str(e))
    if cfg.data.root is None:  # a demo run: read the demo dataset, never build it here
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": str(demo_root(args))})})
    trainer = Trainer(cfg, ctx=alone(device.type if device is not None else None), device=device)
    if path.is_dir():
        trainer.resume(path)
    else:
        trainer.load_state_dict(state)
    return trainer


def demo_root(args) -> Path:
    """The built-in demo dataset, for commands that write nothing but their output (eval, sample):
    `runs/demo-data` where a run built it, else built (the same seeded data) in a temporary
    directory that lives as long as the command."""
    import tempfile

    from ..data import ensure_demo_dataset
    from ..data.shards import META_FILE
    from ..train.trainer import DEMO_DATA_DIR

    if (DEMO_DATA_DIR / META_FILE).is_file():
        return DEMO_DATA_DIR
    args.scratch = tempfile.TemporaryDirectory(prefix="mxflux-demo-")
    return ensure_demo_dataset(Path(args.scratch.name) / "demo-data")


def trainer_from_weights(args):
    """A Trainer of --recipe (with --set overrides) whose model starts from --weights."""
    from ..train.config import RecipeError, load_recipe
    from ..train.trainer import Trainer

    if not args.recipe:
        args.parser.error("--weights needs --recipe: the model config, precision, data and eval settings")
    try:
        cfg = with_init_from(load_recipe(args.recipe, args.overrides), args.weights)
    except RecipeError as e:
        args.parser.error(str(e))
    check_init_from(cfg, args.parser)
    return Trainer(cfg, device=args.device)
