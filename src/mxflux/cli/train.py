"""`mxflux train`: a new run, `--resume` or `--overwrite`, under the run directory's lock."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..argtypes import positive_int
from ..train.datacheck import check_recipe_data
from .common import DEFAULT_RECIPE, barrier, device_from_args, json_text, load_run_config, note, recipe_args, signal_name
from .sample import sample_to_grid


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a Flux model from a recipe (default: the tiny MXFP6 demo)",
                       description="Train with rectified flow. Writes metrics.csv, TensorBoard logs, "
                                   "loss_curve.png, checkpoints and samples.png to the run directory. A run "
                                   "directory belongs to one run: a new run refuses a directory that holds "
                                   "one (--resume continues it there, --overwrite starts over). Ctrl-C "
                                   "(SIGINT), SIGTERM or SIGHUP finishes the step, writes a checkpoint and exits. One "
                                   "command at a time owns a run directory (a lock held for the run's life).")
    recipe_args(p, default=None)
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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: plain lines every 30 s instead (as when stdout is not a terminal; "
                        "train.log in the run directory has them either way)")
    p.set_defaults(handler=_train, parser=p)


def _train(args) -> int:
    from ..train.phases import DISK_FULL, TrainPhase
    from ..train.stop import Interrupted, signals_raise

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
    from ..train.checkpoint import CheckpointNotFoundError, load_checkpoint, read_checkpoint_meta, resolve_checkpoint
    from ..train.config import RecipeError, config_from_dict
    from ..train.distributed import cleanup, init_distributed
    from ..train.identity import check_run_id, check_same_data, check_same_run, record_run_id, with_absolute_data_root
    from ..train.rundir import check_new_run, remove_leftovers
    from ..train.runlock import RunLock
    from ..train.runlog import LogLines, RunLog, stdout_is_terminal, summary_lines
    from ..train.stop import TrainingInterrupted
    from ..train.step_path import step_path, step_path_line
    from ..train.trainer import Trainer, total_steps

    device = device_from_args(args)
    if args.resume:
        try:
            ckpt = resolve_checkpoint(args.resume)
        except CheckpointNotFoundError as e:
            args.parser.error(str(e))
        run_dir = ckpt.parent
        out = Path(args.out) if args.out else run_dir
    else:
        cfg = with_absolute_data_root(load_run_config(args, args.recipe or DEFAULT_RECIPE))
        run_dir, out = None, Path(args.out) if args.out else cfg.out_dir
        check_recipe_data(cfg, args.parser)  # before any work, not at the first forward or at the end's samples
    phase.out = out
    ctx = init_distributed(device.type if device is not None else None)  # gloo for --device cpu
    lock = RunLock(out) if ctx.is_main else None
    trainer = None
    bar = not args.no_progress and stdout_is_terminal()  # plain lines where the bar cannot be seen as it moves
    runlog = RunLog(None, echo=not bar, enabled=ctx.is_main)
    t_start = time.monotonic()
    try:
        if lock is not None:  # before anything in `out` is read or written: one run per directory
            note(lock.acquire().stale_note)
            remove_leftovers(out)
        state = identity = None
        samples_only = False  # a finished run whose final samples were never drawn: only those
        if args.resume:
            state = load_checkpoint(ckpt) if ckpt.is_file() else read_checkpoint_meta(ckpt)
            try:
                cfg = load_run_config(args) if args.recipe else config_from_dict(state["config"],
                                                                                 f"of checkpoint {ckpt}", args.overrides)
            except RecipeError as e:
                args.parser.error(str(e))
            cfg = with_absolute_data_root(cfg)
            check_recipe_data(cfg, args.parser)
            check_run_id(state, run_dir, ckpt)  # before anything of the directory's is rewritten
            identity = state.get("identity")
            changed = check_same_run(state["config"], identity, cfg, run_dir=run_dir,
                                     allow_precision_change=args.allow_precision_change)
            if changed and ctx.is_main:
                note(f"note: the resumed run changes {'; '.join(changed)}")
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
                note(check_new_run(out, overwrite=args.overwrite))
            barrier(ctx)
        runlog.line(f"mxflux train {' '.join(args.command_line[2:])}".rstrip(), console=False)
        callbacks = [LogLines(runlog)] if ctx.is_main else []
        if cfg.mlperf.enabled:  # constructed first: the timed MLPerf "init" phase starts here
            from ..train.mlperf import MLPerfCallback

            callbacks.append(MLPerfCallback(out, cfg, rank=ctx.rank, world_size=ctx.world_size))
        with runlog.phase("set up: model, data and optimizer"):
            trainer = Trainer(cfg, ctx=ctx, device=device, out_dir=out, callbacks=callbacks)
        if state is not None:
            check_same_data(identity, trainer.train_set, run_dir=run_dir)
            with runlog.phase(f"loaded checkpoint {ckpt}"):
                if ckpt.is_file():
                    trainer.load_state_dict(state)
                else:
                    trainer.resume(ckpt)
        del state
        if ctx.is_main:
            record_run_id(out, trainer.run_id)
        runlog.attach(out)  # the run has started: its directory is its own (locked, checked, set up)
        start_samples = trainer.samples
        if ctx.is_main:
            r = trainer.precision_report
            runlog.line(f"{cfg.name}: {cfg.model.name}, {cfg.precision.name}: {len(r.swapped)} linears swapped, "
                        f"{len(r.kept_bf16)} kept bf16; data {trainer.data_root}; world {ctx.world_size}; "
                        f"device {trainer.device}; out {trainer.out_dir}"
                        + (f"; resuming at step {trainer.step}" if trainer.step else ""), console=True)
        phase.phase, phase.trainer = "training", trainer
        if not samples_only:
            try:
                result = trainer.fit(progress=bar, max_steps=args.max_steps)
            except TrainingInterrupted as e:
                if ctx.is_main:
                    print(f"{signal_name(e.signum)}: stopped after step {e.step}; checkpoint {e.checkpoint}; "
                          f"continue with: mxflux train --resume {out}", file=sys.stderr)
                return e.exit_code
            path = step_path(trainer)  # every rank: the compile counts are gathered
            if ctx.is_main:
                line = step_path_line(path, trainer.device.type)
                runlog.line(line, console=False)
                print(line, file=sys.stderr)
                result["step_path"] = path
        else:
            trainer.last_checkpoint = ckpt
            result = {"step": trainer.step, "samples": trainer.samples, "eval_loss": trainer.last_eval}
        if ctx.is_main:
            phase.phase = "sampling"
            if cfg.train.sample_prompts:
                # with the EMA of the weights, where the recipe keeps one
                with trainer.sampling_weights(), runlog.phase("drew samples.png"):
                    grid = sample_to_grid(trainer.model, trainer.train_set, list(cfg.train.sample_prompts),
                                           steps=cfg.train.sample_steps, seed=cfg.train.seed,
                                           out=trainer.out_dir / "samples.png", dtype=trainer.compute_dtype,
                                           guidance=cfg.train.sample_guidance, time_shift=cfg.train.sampler_shift,
                                           distilled_guidance=cfg.train.distilled_guidance)
                if grid:
                    result["samples_png"] = str(grid)
            result["checkpoint"] = str(trainer.last_checkpoint)
            result["loss_curve"] = str(trainer.out_dir / "loss_curve.png")
            for line in summary_lines(result, out_dir=trainer.out_dir, wall_s=time.monotonic() - t_start,
                                      images=trainer.samples - start_samples):
                runlog.line(line, console=True)
            print(json_text(result))  # last, on a line of its own: for scripts
        barrier(ctx)  # no rank tears the group down while another still uses it (gloo aborts then)
    finally:
        # The model's DDP/FSDP2 state holds the process group: freed before the group is destroyed.
        phase.release_trainer()
        trainer = None
        cleanup()
        if lock is not None:
            lock.release()
    return 0
