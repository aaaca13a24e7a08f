"""`mxflux bench step`: the command line of the training-step throughput harness (torch-free
to import; the harness itself is `mxflux.bench.step`)."""

from __future__ import annotations


from ..argtypes import non_negative_int, positive_float, positive_int

__all__ = ["add_bench_parser"]


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: `mxflux bench step` (training-step throughput, MFU, memory)")
    bench = p.add_subparsers(title="benchmarks", metavar="BENCH")
    s = bench.add_parser(
        "step", help="training-step throughput of a recipe: images/s/GPU, ms per 512 images, MFU, peak memory",
        description="Build the trainer of a recipe, run warm-up steps, then time optimizer steps (device-"
                    "synchronised wall clock); optionally profile more steps for a breakdown of device time "
                    "(GEMMs, MX packers, attention, communication, the rest). Warm-up and profiled steps are "
                    "excluded from the timing. Batches are read before timing and reused, so data loading is "
                    "not timed; the host-to-device copy is. Under torchrun: images/s/GPU = global images/s / "
                    "world size, peak memory = the largest over ranks.")
    s.add_argument("overrides", nargs="*", metavar="[RECIPE] KEY=VALUE",
                   help="the recipe (a built-in name or a YAML file, as for `mxflux train`), then recipe "
                        "overrides, e.g. batch.micro_batch_size=32 'precision={fp8: hybrid}'")
    s.add_argument("--recipe", help="the recipe, for scripts that name it this way")
    s.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override, as for `mxflux train` (repeatable)")
    s.add_argument("--steps", type=positive_int, default=8, help="timed optimizer steps (default: 8)")
    s.add_argument("--warmup", type=non_negative_int, default=3, help="untimed warm-up steps first (default: 3)")
    s.add_argument("--profile-steps", type=non_negative_int, default=0,
                   help="steps profiled with torch.profiler after the timed ones, for the breakdown (default: 0)")
    s.add_argument("--synthetic", action="store_true",
                   help="random MLPerf-shaped data with the model's dims (also used when the recipe's data "
                        "is missing or does not fit the model)")
    s.add_argument("--image-size", type=positive_int, default=256,
                   help="synthetic data: image side in pixels (latent side = /8; default: 256)")
    s.add_argument("--text-len", type=positive_int, default=256, help="synthetic data: T5 tokens (default: 256)")
    s.add_argument("--data-dir", help="where synthetic data is written and reused (default: a directory "
                                      "under the system temp dir, keyed by the data's shape)")
    s.add_argument("--peak-tflops", type=positive_float,
                   help="the device's peak dense bf16 TFLOP/s for MFU (default: 989 on H100/H200; none on CPU)")
    s.add_argument("--device", help="cpu, cuda, cuda:1 … (default: cuda if available; LOCAL_RANK under torchrun)")
    s.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    s.set_defaults(handler=_step, parser=s)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1], parser=p)


def _step(args) -> int:
    from ..train.config import RecipeError
    from . import step

    if args.recipe is None and args.overrides and "=" not in args.overrides[0]:
        args.recipe, args.overrides = args.overrides[0], args.overrides[1:]
    if args.recipe is None:
        args.parser.error("name a recipe: `mxflux bench step RECIPE [KEY=VALUE ...]` or --recipe RECIPE (`mxflux recipes` lists them)")
    try:
        cfg = step.load_bench_recipe(args.recipe, [*args.overrides, *args.set_overrides])
    except RecipeError as e:
        args.parser.error(str(e))
    result = step.bench_step(cfg, steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                             synthetic=args.synthetic, image_size=args.image_size, text_len=args.text_len,
                             data_dir=args.data_dir, peak_tflops=args.peak_tflops, device=args.device,
                             recipe=args.recipe, distributed=True)
    if result is not None:  # rank 0
        step.print_table([result])
        if args.json:
            step.write_json(args.json, result)
    return 0
