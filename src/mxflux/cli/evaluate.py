"""`mxflux eval`: a run's (or released weights') validation loss, t = k/8 per sample, fixed noise."""

from __future__ import annotations


from ..argtypes import positive_int
from .common import json_text, trainer_from_checkpoint, trainer_from_weights


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


def _eval(args) -> int:
    if (args.checkpoint is None) == (args.weights is None):
        args.parser.error("give a run checkpoint or --weights PATH (with --recipe), not both")
    if args.weights is None and (args.recipe or args.overrides):
        args.parser.error("--recipe and --set go with --weights; a run checkpoint carries its own recipe")
    if args.weights:
        trainer = trainer_from_weights(args)
    else:
        trainer = trainer_from_checkpoint(args)
    loss = trainer.evaluate(args.samples)
    print(json_text({"checkpoint": args.checkpoint or args.weights, "step": trainer.step,
                     "samples": trainer.samples, "eval_loss": loss}))
    return 0
