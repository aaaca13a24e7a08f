"""Convergence study: the same small Flux trained in bf16, torchao FP8 and MXFP6, from several seeds.

    PYTHONPATH=src python benchmarks/convergence.py [--steps 3000] [--width 768] [--seeds 0,1,2]
        [--precisions bf16 fp8 mxfp6 mxfp6-held mxfp6-held0] [--parallel 3] [--out benchmarks]

Each (precision, seed) is one run in its own process, at most --parallel at a time on one GPU; a seed
fixes the initial weights, the data order, the noise and the timesteps, so the three precisions of one
seed see the same data. The JSON holds every run's validation curve and, per precision and evaluation
step, the mean, min and max over seeds, and the ratio of each precision's mean to bf16's with the
range of the per-seed ratios; the plot draws each precision's mean with its min-max band. With
--deadline (a machine with a time limit) the runs still training then are stopped and only the
evaluation steps every run reached are summarized ("complete": false in the JSON). A claim
from it states the spread ("within x % on n seeds, per-seed ratios a-b").

Data: the built-in demo dataset (real captions, learnable; docs/DATA_FORMAT.md), so the
validation loss falls far below its start. Model: `flux-tiny` widened by `model.overrides`
(default width 768, 12 heads, 2 double + 4 single blocks), with the same evaluation points in every
run. Writes `convergence_<date>_width<W>.png` and `.json`.

`mxfp6-held` is MXFP6 with `precision.held_col_erefs` (the weight gradient's col operands encoded
against the last step's column e_ref, docs/design.md "The one-pass packer"): its rows compare it
with bf16 and, seed by seed, with `mxfp6`; the JSON counts each run's blocks below the fold window.
`mxfp6-held0` is the same with no headroom (`precision.held_headroom_x` / `_dy` 0).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = {"bf16": "tiny-bf16", "fp8": "tiny-bf16", "mxfp6": "tiny-mxfp6", "mxfp6-held": "tiny-mxfp6",
           "mxfp6-held0": "tiny-mxfp6"}
PRECISION_OVERRIDES = {
    # torchao float8 (tensor-wise, its default recipe) on tiny-bf16's model: the FP8 people train with (CUDA only)
    "fp8": ["precision={fp8: hybrid}", "precision.fp8_scaling=tensorwise"],
    # the col operands against the last step's column e_ref (the one-pass packer's numerics). The MLPs unfused so
    # that the setting reaches their linears too, as in the flux-12b recipes; fused and unfused give the same bits
    "mxfp6-held": ["precision.held_col_erefs=true", "precision.fused_mlp='off'"],
    # ... with no headroom: a column keeps its exact window wherever its maximum did not grow
    "mxfp6-held0": ["precision.held_col_erefs=true", "precision.fused_mlp='off'", "precision.held_headroom_x=0",
                    "precision.held_headroom_dy=0"],
}
# Variants of a precision compared, seed by seed, with it as well as with bf16
VARIANT_OF = {"mxfp6-held": "mxfp6", "mxfp6-held0": "mxfp6"}
ORDER = ["bf16", "fp8", "mxfp6", "mxfp6-held", "mxfp6-held0"]


def _overrides(args, out_dir: str) -> list[str]:
    heads = args.width // 64
    return [
        f"model.overrides={{hidden_size: {args.width}, num_heads: {heads}, depth: {args.depth}, "
        f"depth_single_blocks: {args.single}}}",
        f"model.compile={str(args.compile).lower()}",
        f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}",
        f"batch.global_batch_size={args.batch}", f"batch.micro_batch_size={args.batch}",
        f"train.train_samples={args.steps * args.batch}",
        f"train.eval_every_samples={args.eval_every * args.batch}",
        f"train.eval_samples={args.eval_samples}", "train.log_every=50", "train.sample_prompts=[]",
        f"train.seed={args.worker_seed if args.worker else 0}", "data.num_workers=2", f"train.out_dir={out_dir}",
        "train.checkpoint_every=null",  # the demo recipes' periodic checkpoints: gigabytes each at width 3072
    ]


def worker(args) -> None:
    """Train one precision; the trainer writes metrics.csv under --run-dir."""
    from mxflux.train import load_recipe
    from mxflux.train.trainer import Trainer

    cfg = load_recipe(RECIPES[args.worker], [*PRECISION_OVERRIDES.get(args.worker, []),
                                             *_overrides(args, args.run_dir)])
    Trainer(cfg).fit(progress=False)


def eval_curve(metrics: Path) -> list[tuple[int, float]]:
    with open(metrics) as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f) if r["split"] == "eval"]


def blocks_outside_window(metrics: Path) -> int | None:
    """The run's MX blocks below their fold window, the count its last training row logs (cumulative
    over the run, the validation forwards' included; None for a precision that logs none): how many
    blocks the fold rounded to E4M3's grid."""
    with open(metrics) as f:
        counts = [r.get("blocks_outside_window") for r in csv.DictReader(f) if r["split"] == "train"]
    return int(counts[-1]) if counts and counts[-1] not in (None, "") else None


def _copy_metrics(base: Path, dest: Path, runs) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if (base / run / "metrics.csv").exists():
            shutil.copyfile(base / run / "metrics.csv", dest / f"{run}.csv")


def summarize(curves: dict[str, dict[str, list]]) -> dict:
    """Per precision and evaluation step: mean, min, max over seeds; and each precision's mean over
    bf16's, with the min and max of the per-seed ratios (seed by seed: the same data and noise); a
    variant (VARIANT_OF) the same against the precision it varies (`ratio_to_<that>_*`)."""
    out = {}
    for prec, by_seed in curves.items():
        steps = sorted({s for pts in by_seed.values() for s, _ in pts})
        rows = []
        for step in steps:
            vals = {seed: v for seed, pts in by_seed.items() for s, v in pts if s == step}
            row = {"step": step, "seeds": len(vals), "mean": sum(vals.values()) / len(vals),
                   "min": min(vals.values()), "max": max(vals.values())}
            for ref in ("bf16", VARIANT_OF.get(prec)):
                base = {seed: v for seed, pts in curves.get(ref, {}).items() for s, v in pts if s == step}
                ratios = [vals[seed] / base[seed] for seed in vals if seed in base]
                if prec != ref and ratios:
                    row[f"ratio_to_{ref}_mean"] = row["mean"] / (sum(base.values()) / len(base))
                    row[f"ratio_to_{ref}_min"], row[f"ratio_to_{ref}_max"] = min(ratios), max(ratios)
            rows.append(row)
        out[prec] = rows
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250, help="steps between validations")
    ap.add_argument("--eval-samples", type=int, default=1024)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: one run per precision and seed")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (processes sharing the GPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "mxfp6"], choices=sorted(RECIPES),
                    help="fp8 needs CUDA (torchao)")
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--runs", help="copy each precision's metrics.csv to DIR/<precision>.csv every 30 s while "
                                   "the runs train (on a machine with a time limit: a cut run's curve so far)")
    ap.add_argument("--deadline", type=float, help="seconds: then stop the runs still training and summarize the "
                                                      "evaluation steps every run reached (marked complete: false)")
    ap.add_argument("--summarize", metavar="DIR",
                    help="no training: summarize the <precision>-seed<n>.csv curves in DIR (what --runs copies, "
                         "gathered from calls that each trained some of the runs with the same arguments)")
    ap.add_argument("--provenance-from", metavar="JSON",
                    help="with --summarize: the provenance of a result JSON written where the runs trained "
                         "(the machine summarizing is not the one that measured)")
    ap.add_argument("--worker", choices=sorted(RECIPES), help=argparse.SUPPRESS)
    ap.add_argument("--worker-seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.summarize:
        return summarize_runs(args)

    from mxflux.data import ensure_demo_dataset
    from mxflux.train.trainer import DEMO_DATA_DIR

    ensure_demo_dataset(DEMO_DATA_DIR)  # once, before the workers start
    base = Path(tempfile.mkdtemp(prefix="convergence-"))
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    runs = [(prec, seed) for seed in seeds for prec in args.precisions]  # a seed's precisions together
    procs, pending = {}, list(runs)
    passthrough = argv if argv is not None else sys.argv[1:]
    copied = started = time.monotonic()
    cut = False
    while pending or any(proc.poll() is None for proc in procs.values()):
        if args.deadline and time.monotonic() - started > args.deadline:
            cut = True  # the runs still training stop here; their curves so far are summarized below
            pending.clear()
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()  # not TERM: the trainer would write a checkpoint first
            for proc in procs.values():
                proc.wait()
            break
        while pending and sum(proc.poll() is None for proc in procs.values()) < args.parallel:
            prec, seed = pending.pop(0)
            name = f"{prec}-seed{seed}"
            cmd = [sys.executable, __file__, "--worker", prec, "--worker-seed", str(seed), "--run-dir",
                   str(base / name), *passthrough]
            procs[name] = subprocess.Popen(cmd, env=os.environ.copy())
        if args.runs and time.monotonic() - copied >= 30:
            _copy_metrics(base, Path(args.runs), procs)
            copied = time.monotonic()
        time.sleep(1)
    if args.runs:
        _copy_metrics(base, Path(args.runs), procs)
    failed = [name for name, proc in procs.items() if proc.wait() != 0]
    if failed and not cut:
        raise SystemExit(f"convergence: the {failed} run(s) failed")

    curves = {p: {str(seed): eval_curve(base / f"{p}-seed{seed}" / "metrics.csv")
                  if (base / f"{p}-seed{seed}" / "metrics.csv").exists() else [] for seed in seeds}
              for p in args.precisions}
    outside = {p: {str(seed): blocks_outside_window(base / f"{p}-seed{seed}" / "metrics.csv")
                   for seed in seeds if (base / f"{p}-seed{seed}" / "metrics.csv").exists()}
               for p in args.precisions}
    if cut:  # compare like with like: only the evaluation steps every run reached
        common = set.intersection(*({s for s, _ in pts} for by_seed in curves.values() for pts in by_seed.values()))
        curves = {p: {seed: [(s, v) for s, v in pts if s in common] for seed, pts in by_seed.items()}
                  for p, by_seed in curves.items()}
        print(f"convergence: stopped at the {args.deadline:.0f} s deadline; summarizing steps {sorted(common)}")
    from mxflux.bench.provenance import provenance

    write_results(args, curves, complete=not cut, prov=provenance(), outside=outside)


def summarize_runs(args) -> None:
    """--summarize: the study from the curves in a directory, with the measuring machine's provenance."""
    runs = sorted(Path(args.summarize).glob("*-seed*.csv"))
    if not runs:
        raise SystemExit(f"--summarize {args.summarize}: no <precision>-seed<n>.csv files there")
    curves: dict[str, dict[str, list]] = {}
    outside: dict[str, dict[str, int | None]] = {}
    for csv_file in runs:
        prec, _, seed = csv_file.stem.partition("-seed")
        curves.setdefault(prec, {})[seed] = eval_curve(csv_file)
        outside.setdefault(prec, {})[seed] = blocks_outside_window(csv_file)
    steps = {tuple(s for s, _ in pts) for by_seed in curves.values() for pts in by_seed.values()}
    if len(steps) != 1:
        raise SystemExit(f"--summarize {args.summarize}: the runs reached different evaluation steps {sorted(steps)}")
    prov = json.loads(Path(args.provenance_from).read_text())["provenance"] if args.provenance_from else {}
    args.precisions = sorted(curves, key=ORDER.index)
    args.seeds = ",".join(sorted({seed for by_seed in curves.values() for seed in by_seed}))
    write_results(args, {p: curves[p] for p in args.precisions}, complete=True,
                  prov={**prov, "summarized_from": sorted(p.name for p in runs)}, outside=outside)


def write_results(args, curves: dict, *, complete: bool, prov: dict, outside: dict) -> None:
    """The JSON (curves, summary, blocks outside the fold window per run, provenance) and the plot,
    named by date and width."""
    seeds = args.seeds.split(",")
    summary = summarize(curves)
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in vars(args).items()
            if not k.startswith("worker") and k not in ("run_dir", "summarize", "provenance_from")}
    result = {"date": date, "complete": complete, "args": kept, "curves": curves, "summary": summary,
              "blocks_outside_window": {p: by_seed for p, by_seed in outside.items()
                                        if any(v is not None for v in by_seed.values())}}
    (out / f"convergence_{date}_width{args.width}.json").write_text(json.dumps({"provenance": prov, **result}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p, rows in summary.items():
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["mean"] for r in rows], marker="o", ms=3, label=f"{p} (mean of {len(seeds)} seeds)")
        ax.fill_between(steps, [r["min"] for r in rows], [r["max"] for r in rows], alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (fixed t = k/8)")
    ax.set_yscale("log")
    ax.set_title(f"Flux width {args.width}, {args.depth}+{args.single} blocks, batch {args.batch}, demo data; "
                 f"band: min-max over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"convergence_{date}_width{args.width}.png", dpi=120)
    for p, rows in summary.items():
        print(f"{p:10s} " + "  ".join(
            f"{r['step']}:{r['mean']:.4f}" + "".join(
                f" ({r[f'ratio_to_{ref}_min']:.3f}-{r[f'ratio_to_{ref}_max']:.3f}x {ref})"
                for ref in ("bf16", VARIANT_OF.get(p)) if f"ratio_to_{ref}_min" in r) for r in rows))


if __name__ == "__main__":
    main()
