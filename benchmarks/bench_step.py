"""End-to-end training-step throughput, bf16 vs FP8 vs MXFP6, side by side in one process.

    PYTHONPATH=src python benchmarks/bench_step.py [--recipe flux535m-bf16] [--mbs 16] [--steps 8]
        [--warmup 3] [--profile-steps 2] [--compile] [--json out.json] [KEY=VALUE ...]

A thin loop over `mxflux bench step` (mxflux.bench.step): the same recipe with each precision
block in turn (bf16 `precision={}`, FP8 `precision={fp8: hybrid}`, MXFP6 `precision={fp6: e2m3,
fused_mlp: "off"}`), synthetic MLPerf-shaped data (256 image + 256 T5 tokens per sample), warm-up
and profiled steps excluded from the timing; prints one table with images/s/GPU relative to the
first precision. Works under torchrun too (`torchrun --nproc_per_node N benchmarks/bench_step.py`).
"""

from __future__ import annotations

import argparse

from mxflux.bench.step import bench_settings, print_table, write_json

PRECISIONS = {
    "bf16": "precision={}",
    "fp8": "precision={fp8: hybrid}",
    "mxfp6": 'precision={fp6: e2m3, fused_mlp: "off"}',
}


def _precision_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PRECISIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(PRECISIONS)}, got {text!r}")
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="flux535m-bf16", help="the recipe all precisions share")
    ap.add_argument("--model", help="override model.name (e.g. flux-small)")
    ap.add_argument("--mbs", type=int, default=16, help="micro-batch = global batch per GPU (default: 16)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (model.compile=true)")
    # One comma-separated argument: a space-separated list would swallow the KEY=VALUE overrides.
    ap.add_argument("--precisions", type=_precision_list, default=list(PRECISIONS),
                    help=f"comma-separated, in run order (default: {','.join(PRECISIONS)})")
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--json", help="write the list of results as JSON")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more recipe overrides for every run")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from mxflux.train.distributed import init_distributed

    world = init_distributed().world_size
    common = [f"model.compile={str(args.compile).lower()}", f"batch.global_batch_size={args.mbs * world}",
              f"batch.micro_batch_size={args.mbs}", *([f"model.name={args.model}"] if args.model else []),
              *args.overrides]
    results = bench_settings(args.recipe, [(p, [PRECISIONS[p]]) for p in args.precisions], common=common,
                             steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                             synthetic=True, peak_tflops=args.peak_tflops)
    if results:
        print_table(results)
        if args.json:
            write_json(args.json, results)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
