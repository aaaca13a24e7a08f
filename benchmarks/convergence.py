"""Convergence study: the same small Flux trained in bf16 and in MXFP6 from the same seed.

    PYTHONPATH=src python benchmarks/convergence.py [--steps 3000] [--width 768] [--out benchmarks]

Data: the built-in demo dataset (real captions, learnable; docs/DATA_FORMAT.md), so the
validation loss falls far below its start. Model: `flux-tiny` widened by `model.overrides`
(default width 768, 12 heads, 2 double + 4 single blocks). Both precisions run at once as two
processes on one GPU (each trains alone on its own CUDA stream; the GPU is far from full at
this size), with identical seeds, data order and evaluation points. Writes
`convergence_<date>.png` (validation-loss curves in one plot) and `.json` (the curves and the
final MXFP6/bf16 validation-loss ratio).
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

RECIPES = {"bf16": "tiny-bf16", "mxfp6": "tiny-mxfp6"}


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
        f"train.seed={args.seed}", "data.num_workers=2", f"train.out_dir={out_dir}",
        "train.checkpoint_every=null",  # the demo recipes' periodic checkpoints: gigabytes each at width 3072
    ]


def worker(args) -> None:
    """Train one precision; the trainer writes metrics.csv under --run-dir."""
    from mxflux.train import load_recipe
    from mxflux.train.trainer import Trainer

    cfg = load_recipe(RECIPES[args.worker], _overrides(args, args.run_dir))
    Trainer(cfg).fit(progress=False)


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f) if r["split"] == "eval"]


def _copy_metrics(base: Path, dest: Path, precisions) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for p in precisions:
        if (base / p / "metrics.csv").exists():
            shutil.copyfile(base / p / "metrics.csv", dest / f"{p}.csv")


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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "mxfp6"], choices=sorted(RECIPES))
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--runs", help="copy each precision's metrics.csv to DIR/<precision>.csv every 30 s while "
                                   "the runs train (on a machine with a time limit: a cut run's curve so far)")
    ap.add_argument("--worker", choices=sorted(RECIPES), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    from mxflux.data import ensure_demo_dataset
    from mxflux.train.trainer import DEMO_DATA_DIR

    ensure_demo_dataset(DEMO_DATA_DIR)  # once, before the workers start
    base = Path(tempfile.mkdtemp(prefix="convergence-"))
    procs = {}
    for prec in args.precisions:
        run_dir = base / prec
        cmd = [sys.executable, __file__, "--worker", prec, "--run-dir", str(run_dir),
               *(argv if argv is not None else sys.argv[1:])]
        procs[prec] = subprocess.Popen(cmd, env=os.environ.copy())
    if args.runs:
        while any(proc.poll() is None for proc in procs.values()):
            _copy_metrics(base, Path(args.runs), procs)
            time.sleep(30)
        _copy_metrics(base, Path(args.runs), procs)
    failed = [p for p, proc in procs.items() if proc.wait() != 0]
    if failed:
        raise SystemExit(f"convergence: the {failed} run(s) failed")

    curves = {p: eval_curve(base / p) for p in args.precisions}
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": date, "args": {k: v for k, v in vars(args).items() if k not in ("worker", "run_dir")},
              "curves": curves}
    if "bf16" in curves and "mxfp6" in curves:
        result["final_ratio_mxfp6_over_bf16"] = curves["mxfp6"][-1][1] / curves["bf16"][-1][1]
    from mxflux.bench.provenance import provenance
    (out / f"convergence_{date}.json").write_text(json.dumps({"provenance": provenance(), **result}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p, pts in curves.items():
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, label=p)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (fixed t = k/8)")
    ax.set_yscale("log")
    ratio = result.get("final_ratio_mxfp6_over_bf16")
    ax.set_title(f"Flux width {args.width}, {args.depth}+{args.single} blocks, batch {args.batch}, demo data"
                 + (f"\nfinal MXFP6/bf16 = {ratio:.4f}" if ratio else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"convergence_{date}.png", dpi=120)
    for p, pts in curves.items():
        print(f"{p:6s} " + "  ".join(f"{s}:{v:.4f}" for s, v in pts))
    if ratio:
        print(f"final validation loss ratio MXFP6/bf16 = {ratio:.4f}")


if __name__ == "__main__":
    main()
