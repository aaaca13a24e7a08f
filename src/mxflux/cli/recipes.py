"""`mxflux recipes` and `mxflux check-config`: the built-in recipes, and one validated without running it."""

from __future__ import annotations

import sys
from pathlib import Path

from ..train.datacheck import check_recipe_data
from .common import check_init_from, load_run_config, recipe_args, recipe_paths


def add_recipes_parser(sub) -> None:
    p = sub.add_parser("recipes", help="list the built-in recipes, one line each",
                       description="The built-in recipes with their descriptions. Any command that takes a "
                                   "recipe takes one of these names or the path of a YAML file.")
    p.set_defaults(handler=_recipes, parser=p)


def _recipes(args) -> int:
    from ..train.config import recipe_descriptions

    items = recipe_descriptions()
    width = max(map(len, items))
    for name, text in items.items():
        print(f"{name:<{width}}  {text}")
    return 0


def add_check_config_parser(sub) -> None:
    p = sub.add_parser("check-config", help="validate a recipe (and overrides) without running it",
                       description="Validate a recipe with its overrides and print the full config as YAML; "
                                   "warns (on stderr) about paths in it that do not exist.")
    recipe_args(p)
    p.set_defaults(handler=_check_config, parser=p)


def _lora_summary(cfg, model, parser) -> None:
    """The adapters a LoRA recipe trains and the frozen base it keeps, from the meta model (patterns
    checked against the real module names, as `train` checks them)."""
    from ..nn import MXFP6Linear
    from ..nn.lora import lora_targets

    try:
        names = lora_targets(model, cfg.lora.include, cfg.lora.exclude)
    except ValueError as e:
        parser.error(str(e))
    adapters = sum(cfg.lora.rank * (m.in_features + m.out_features) for m in map(model.get_submodule, names))
    mx = {id(m.weight) for m in model.modules() if isinstance(m, MXFP6Linear)}
    base = sum(p.numel() * (1 if id(p) in mx else 2) for p in model.parameters())
    print(f"# lora: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {len(names)} linears: {adapters / 1e6:.1f} M "
          f"trained parameters; the frozen base holds {base / 2**30:.2f} GiB ({cfg.precision.name} linears "
          f"{'1 byte' if mx else '2 bytes'} per weight, the rest bf16)", file=sys.stderr)


def _check_config(args) -> int:
    import yaml

    cfg = load_run_config(args)
    check_init_from(cfg, args.parser, missing_ok=True)
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
    if cfg.lora is not None:
        _lora_summary(cfg, model, args.parser)
    for field, path in recipe_paths(cfg):
        if not Path(path).exists():
            print(f"# warning: {field} {path!r} does not exist", file=sys.stderr)
        elif field == "data.root" and not Path(path).is_dir():
            print(f"# warning: {field} {path!r} is a file, expected a dataset directory", file=sys.stderr)
    print(f"# OK: {cfg.name} is valid ({cfg.precision.name}, model {cfg.model.name}, "
          f"global batch {cfg.batch.global_batch_size})", file=sys.stderr)
    return 0
