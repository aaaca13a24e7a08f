"""`mxflux bench step`: the command line of the training-step throughput harness (torch-free
to import; the harness itself is `mxflux.bench.step`, the settings and their processes
`mxflux.bench.compare`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..argtypes import non_negative_int, positive_float, positive_int
from ..bench.compare import DEFAULT_SETTINGS, PROXY_OVERRIDES, PROXY_RECIPE, SETTING_ENV, SETTINGS, parse_settings
from .common import device_from_args

__all__ = ["add_bench_parser"]


def _settings(text: str) -> list[str]:
    try:
        return parse_settings(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: `mxflux bench step` (training-step throughput, MFU, memory)")
    bench = p.add_subparsers(title="benchmarks", metavar="BENCH")
    s = bench.add_parser(
        "step", help="training-step throughput of a recipe in several precisions side by side: images/s per "
                     "device (GPU or CPU), "
                     "MFU, memory, device-time split, the bare loop",
        description="Build the trainer of a recipe, run warm-up steps, then time optimizer steps (one device "
                    "synchronisation after them); optionally profile more steps for the device-time split and "
                    "time the bare loop of the same recipe next to the trainer. Each setting (a precision) runs "
                    "in its own process, one after the other, and one table compares them. Batches are read "
                    "before timing and reused, so data loading is not timed; the host-to-device copy is. Under "
                    "torchrun (one setting per job): images/s/GPU = global images/s / world size, memory = the "
                    "largest over ranks. A setting this machine cannot run (torchao FP8 without a CUDA GPU of "
                    "compute capability 8.9+, a CUDA-graph setting without CUDA) is skipped and named in one line.")
    s.add_argument("--recipe", help="built-in recipe name or a YAML file (required unless --proxy)")
    s.add_argument("--proxy", action="store_true",
                   help=f"the flux-12b-width throughput proxy: --recipe {PROXY_RECIPE} with "
                        f"{' '.join(PROXY_OVERRIDES)} and synthetic data (256 image + 256 text tokens)")
    s.add_argument("overrides", nargs="*", metavar="[RECIPE] KEY=VALUE",
                   help="the recipe (a built-in name or a YAML file, as for `mxflux train`), then recipe overrides "
                        "for every setting, applied after the setting's own")
    s.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override, as for `mxflux train` (repeatable)")
    s.add_argument("--settings", type=_settings, default=list(DEFAULT_SETTINGS),
                   help=f"comma-separated settings, each run in its own process, in this order (default: "
                        f"{','.join(DEFAULT_SETTINGS)}; 'recipe' = the recipe's own precision); one of: "
                        + "; ".join(f"{k}: {' '.join(v) or '(no overrides)'}" for k, v in SETTINGS.items()))
    s.add_argument("--mbs", type=positive_int,
                   help="micro-batch per GPU; the global batch becomes MBS x world size (no accumulation)")
    s.add_argument("--steps", type=positive_int, default=8, help="timed optimizer steps (default: 8)")
    s.add_argument("--warmup", type=non_negative_int, default=3, help="untimed warm-up steps first (default: 3)")
    s.add_argument("--profile-steps", type=non_negative_int, default=0,
                   help="steps profiled with torch.profiler after the timed ones, for the device-time split "
                        "(default: 0)")
    s.add_argument("--bare-loop", action="store_true",
                   help="also time the bare loop of the same recipe (same model, precision, compile, optimizer; "
                        "random on-device inputs, no data loader, no logging) and report trainer / bare loop")
    s.add_argument("--cuda-graph", action="store_true",
                   help="also time the bare loop captured as one CUDA graph per step and replayed (one process, "
                        "CUDA only): what the host's per-op cost still costs a step")
    s.add_argument("--memory", metavar="PATH",
                   help="write the memory breakdown of one more step (alive at the peak by allocating frame; "
                        "saved for backward by dtype and module) as JSON, one entry per setting, and print it")
    s.add_argument("--rounds", type=positive_int, default=1,
                   help="run the settings this many times, alternating (every setting, then every setting again, "
                        "each run a fresh process): the table shows each setting's median round, the spread of "
                        "its step times, and its ratio to bf16 and FP8 within each round, where they ran back to "
                        "back (default: 1)")
    s.add_argument("--setting-timeout", type=positive_float, metavar="SECONDS",
                   help="stop a setting's process after this long (it is reported as failed)")
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
    s.add_argument("--json", metavar="PATH", help="also write the results (a list, one per setting) as JSON")
    # A comparison's child process: a setting this machine cannot run is written as skipped (with
    # the reason) instead of being an error, so that the comparison runs the others.
    s.add_argument("--skip-unavailable", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(handler=_step, parser=s)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1], parser=p)


def _user_overrides(args) -> list[str]:
    proxy = list(PROXY_OVERRIDES) if args.proxy else []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mbs = [f"batch.micro_batch_size={args.mbs}", f"batch.global_batch_size={args.mbs * world}"] if args.mbs else []
    return [*proxy, *mbs, *args.overrides, *args.set_overrides]


def _child_argv(args, setting: str, json_path: Path, memory_path: Path) -> list[str]:
    """The argv of one setting's own process: this command with that one setting."""
    argv = ["--recipe", args.recipe, "--settings", setting, "--json", str(json_path), "--skip-unavailable",
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
            "--image-size", str(args.image_size), "--text-len", str(args.text_len)]
    for flag, on in (("--proxy", args.proxy), ("--bare-loop", args.bare_loop), ("--cuda-graph", args.cuda_graph),
                     ("--synthetic", args.synthetic)):
        if on:
            argv.append(flag)
    for flag, value in (("--mbs", args.mbs), ("--data-dir", args.data_dir), ("--peak-tflops", args.peak_tflops),
                        ("--device", args.device)):
        if value is not None:
            argv += [flag, str(value)]
    if args.memory:
        argv += ["--memory", str(memory_path)]
    for o in [*args.overrides, *args.set_overrides]:
        argv += ["--set", o]
    return argv


def _step(args) -> int:
    # The recipe is named as `mxflux train` names it (positionally); --recipe stays for scripts.
    if args.recipe is None and args.overrides and "=" not in args.overrides[0]:
        args.recipe, args.overrides = args.overrides[0], args.overrides[1:]
    if args.proxy:
        if args.recipe not in (None, PROXY_RECIPE):
            args.parser.error(f"--proxy benchmarks {PROXY_RECIPE}; drop --recipe {args.recipe}")
        args.recipe, args.synthetic = PROXY_RECIPE, True
    if not args.recipe:
        args.parser.error("name a recipe: `mxflux bench step RECIPE [KEY=VALUE ...]`, --recipe RECIPE, or --proxy "
                          "(`mxflux recipes` lists them)")
    if args.synthetic and args.image_size % 16:
        args.parser.error(f"--image-size {args.image_size}: synthetic images need a multiple of 16 pixels (the VAE's "
                          f"/8, then 2x2 patches)")
    device_from_args(args)  # a device this machine lacks: one line here, before any setting starts
    user = [*args.overrides, *args.set_overrides]
    if len(args.settings) > 1 and any(o.split("=", 1)[0].strip() == "precision" for o in user):
        args.parser.error("a whole 'precision=...' override would make every setting the same precision; "
                          "give it with --settings recipe, or override single fields (precision.KEY=VALUE)")
    if len(args.settings) > 1 or args.rounds > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            args.parser.error("under torchrun, give one setting per job (--settings NAME) and no --rounds")
        return _compare(args)
    return _one(args)


def _device(name: str | None):
    """The device a setting will run on, as `bench_step` picks it (under torchrun: LOCAL_RANK's GPU)."""
    import torch

    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _one(args) -> int:
    """One setting, in this process (also under torchrun)."""
    from ..train.config import RecipeError
    from ..train.distributed import cleanup
    from ..bench import step
    from ..bench.availability import setting_unavailability
    from ..bench.report import print_table, write_json

    (setting,) = args.settings
    for var, value in SETTING_ENV.get(setting, {}).items():  # read at import: too late to set here
        if os.environ.get(var) != value:
            args.parser.error(f"--settings {setting}: needs {var}={value} in the environment (it is set for it when "
                              f"it runs beside another setting)")
    try:
        cfg = step.load_bench_recipe(args.recipe, [*SETTINGS[setting], *_user_overrides(args)])
    except RecipeError as e:
        args.parser.error(str(e))
    device = _device(args.device)
    unavailable = setting_unavailability(cfg, device)
    if unavailable:
        if not args.skip_unavailable:
            args.parser.error(f"--settings {setting}: cannot run here: {unavailable}")
        if args.json:
            write_json(args.json, [{"label": setting, "skipped": unavailable}])
        return 0
    if args.cuda_graph or cfg.train.cuda_graph:
        refused = step.captured_step_error(cfg, cuda_graph=args.cuda_graph, warmup=args.warmup,
                                           device_type=device.type,
                                           world_size=int(os.environ.get("WORLD_SIZE", "1")))
        if refused:
            args.parser.error(refused)
    try:
        result = step.bench_step(cfg, steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                                 bare_loop=args.bare_loop, cuda_graph=args.cuda_graph, memory_path=args.memory,
                                 synthetic=args.synthetic, image_size=args.image_size, text_len=args.text_len,
                                 data_dir=args.data_dir, peak_tflops=args.peak_tflops, device=args.device,
                                 recipe=args.recipe, label=setting if setting != "recipe" else None, distributed=True)
    finally:
        cleanup()  # under torchrun: the group torn down here, not left to interpreter exit
    if result is not None:  # rank 0
        print_table([result])
        if args.json:
            from ..bench.provenance import provenance

            write_json(args.json, [{**result, "provenance": provenance(args.command_line)}])
    return 0


def _compare(args) -> int:
    """Several settings (or rounds), each run in its own process (why: `mxflux.bench.compare`),
    one table. A setting whose recipe does not validate is reported as failed without a process.
    With rounds, the memory report is each setting's last successful one."""
    from ..train.config import RecipeError, load_recipe
    from ..bench.compare import combine_rounds, run_in_subprocesses
    from ..bench.report import print_table, skipped_line, write_json

    invalid = {}
    for name in args.settings:
        try:
            load_recipe(args.recipe, [*SETTINGS[name], *_user_overrides(args)])
        except RecipeError as e:
            invalid[name] = {"label": name, "failed": f"the recipe does not validate: {e}"}
    runnable = [n for n in args.settings if n not in invalid]
    if not runnable:
        args.parser.error("no setting validates:\n" + "\n".join(r["failed"] for r in invalid.values()))
    rounds, memory = [], {}
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"=== round {i + 1} of {args.rounds}", flush=True)
        ran, round_memory = run_in_subprocesses(
            runnable, lambda name, j, m: _child_argv(args, name, j, m), timeout_s=args.setting_timeout)
        rounds.append(ran)
        memory.update(round_memory)
    ran = combine_rounds(rounds) if args.rounds > 1 else rounds[0]
    by_name = {r["label"]: r for r in ran}
    results = [invalid.get(n) or by_name[n] for n in args.settings]
    if all(r.get("skipped") for r in results):
        args.parser.error("no setting can run here: " + skipped_line(results))
    print_table(results)
    if args.json:
        from ..bench.fairness import comparison_warnings
        from ..bench.provenance import provenance

        # this command's provenance (the one a reader reruns); each child's own stays as child_provenance
        stamp = provenance(args.command_line)
        stamped = [{**r, "child_provenance": r.get("provenance"), "provenance": stamp} for r in results]
        warnings = comparison_warnings(stamped)
        write_json(args.json, [{**r, "comparison_warnings": warnings} for r in stamped])
    if args.memory:
        write_json(args.memory, memory)
    return 0 if all(not r.get("failed") for r in results) else 1
