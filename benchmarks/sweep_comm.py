"""Communication granularity sweep: FSDP2 blocks per unit (and DDP bucket sizes), one recipe.

    torchrun --nproc_per_node 8 benchmarks/sweep_comm.py --recipe flux12b-mxfp6-mlperf \\
        [--units 1,2,4] [--reshard true] [--ddp-buckets 25,100] [--mbs 64] [--steps 6] \\
        [--warmup 2] [--profile-steps 1] [--json sweep.json] [KEY=VALUE ...]

The seed swept DDP's `ddp_bucket_size` for its 8-GPU runs. Under FSDP2 (our default, and the
only strategy that holds Flux-12B's AdamW state on H200s) the analogue is how many consecutive
transformer blocks share one unit (`distributed.fsdp_blocks_per_unit`): one parameter all-gather
and one gradient reduce-scatter per unit. Larger units mean fewer, larger collectives and more
unsharded parameters alive at once. Every setting runs through `mxflux bench step` (the same
harness as every published number) in this one torchrun job, so the settings are measured side
by side (in-process: the settings share one precision and its compiled code, and a torchrun job
per setting would pay the start-up and compile each time); the table adds, from a profiled step,
the communication share of device busy time and the exposed part of it (NCCL time that no other
kernel overlaps). Results go to --json and the optimum (most
images/s/GPU) is printed last.
"""

from __future__ import annotations

import argparse


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _floats(text: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return vals


def settings(units: list[int], reshard: list[bool], ddp_buckets: list[float]) -> list[tuple[str, list[str]]]:
    """(label, recipe overrides) for every setting of the sweep, FSDP first."""
    out = []
    for n in units:
        for r in reshard:
            label = f"fsdp u{n}" + ("" if r else " keep")
            out.append((label, ["distributed.strategy=fsdp", f"distributed.fsdp_blocks_per_unit={n}",
                                f"distributed.fsdp_reshard_after_forward={str(r).lower()}"]))
    for mb in ddp_buckets:
        out.append((f"ddp {mb:g}MB", ["distributed.strategy=ddp", f"distributed.ddp_bucket_mb={mb}"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="flux12b-mxfp6-mlperf")
    ap.add_argument("--units", type=_ints, default=[1, 2, 4], help="FSDP2 blocks per unit, comma-separated")
    ap.add_argument("--reshard", default="true", choices=["true", "false", "both"],
                    help="fsdp_reshard_after_forward for the FSDP settings")
    ap.add_argument("--ddp-buckets", type=_floats, default=[], help="DDP bucket sizes in MB, comma-separated")
    ap.add_argument("--mbs", type=int, default=None, help="micro-batch per GPU (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=1)
    ap.add_argument("--synthetic", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--image-size", type=int, default=256, help="synthetic data: image side in pixels")
    ap.add_argument("--text-len", type=int, default=256, help="synthetic data: T5 tokens")
    ap.add_argument("--json", help="write the list of results as JSON")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more recipe overrides for every setting")
    args = ap.parse_args(argv)
    if not args.units and not args.ddp_buckets:
        ap.error("nothing to sweep: give --units and/or --ddp-buckets")

    import torch.distributed as dist

    from mxflux.bench.report import print_table, write_json
    from mxflux.bench.step import bench_settings
    from mxflux.train.distributed import init_distributed

    world = init_distributed().world_size
    reshard = {"true": [True], "false": [False], "both": [True, False]}[args.reshard]
    common = list(args.overrides)
    if args.mbs:
        common = [f"batch.micro_batch_size={args.mbs}", f"batch.global_batch_size={args.mbs * world}", *common]
    results = bench_settings(args.recipe, settings(args.units, reshard, args.ddp_buckets), common=common,
                             steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                             synthetic=args.synthetic, image_size=args.image_size, text_len=args.text_len)
    for r in results:  # the collective time, and the part of it no compute hid
        b = r.get("breakdown") or {}
        r["communication_ms_per_step"] = (b.get("categories", {}).get("communication") or {}).get("ms_per_step")
        r["exposed_communication_ms_per_step"] = b.get("exposed_communication_ms_per_step")
    if results:
        print_table(results)
        best = max(results, key=lambda r: r["images_per_s_per_gpu"])
        print(f"optimum: {best['label']} ({best['images_per_s_per_gpu']:.2f} images/s/GPU on {world} ranks)")
        if args.json:
            from mxflux.bench.provenance import provenance

            write_json(args.json, [{**r, "provenance": provenance()} for r in results])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
