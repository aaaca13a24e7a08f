"""Where a GEMM's time goes, by Nsight Compute: our CuTe GEMM (the default's promoted sums, `fp32`, and the halves
trial, `fp32h`) beside cuBLAS's tensor-wise GEMM with and without fast accumulation and its row-scaled GEMM, one
profiled launch each at the named Flux problems, on operands packed as the step packs them.

Why: in the step our kernel trails cuBLAS's most where K is 3072 and N wide (a cost per output tile), by up to 4.5 %
where K is long (a cost per k-tile), and timing alone has not told the two apart (benchmarks/NOTES.md, "quack-kernels'
ping-pong and cooperative GEMMs in the step"). The sections kept (speed of light, compute and memory workload,
warp states, scheduler, occupancy, launch) say whether the tensor pipe idles, and on what the warps wait.

    # on the device (gpu_run.sh ncugemm): the profile, then its summary
    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... --csv --page details \\
        python3 benchmarks/probe_gemm_ncu.py --problems linear1:fprop,linear2:dgrad --labels $OUT/labels.json \\
        > $OUT/ncu.csv
    python3 benchmarks/probe_gemm_ncu.py --summarize $OUT/ncu.csv --labels $OUT/labels.json --json $OUT/ncu.json

Each kernel runs three times unprofiled (builds, warm caches and clocks), then once between
cudaProfilerStart and cudaProfilerStop, in the order written to `--labels`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

# The kernels profiled per problem, in launch order: (label, how)
KERNELS = ("cublas-tensorwise", "cublas-tensorwise-fast", "cublas-rowscaled", "ours-fp32", "ours-fp32h")
# Metrics printed in the summary where the sections report them (every metric is kept in the JSON)
HEADLINE = ("Duration", "SM Frequency", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput",
            "Issue Slots Busy", "Executed Ipc Active", "Warp Cycles Per Issued Instruction", "L2 Hit Rate")
# a profiled launch is one of ours or cuBLAS's GEMM kernels, not a cast or memset torch may launch around them
GEMM_KERNEL_MARKS = ("nvjet", "cutlass", "gemm", "Gemm")


def parse_problems(text: str, tokens: int) -> list[tuple]:
    """`linear:kind` pairs (e.g. linear1:fprop) as probe_cute_rowwise_gemm's problems at `tokens`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from probe_cute_rowwise_gemm import _problems

    known = {(p[0], p[1]): p for p in _problems([tokens])}
    wanted = [tuple(item.split(":", 1)) for item in text.split(",") if item]
    bad = [":".join(w) for w in wanted if w not in known]
    if bad or not wanted:
        pairs = sorted(":".join(k) for k in known)
        raise SystemExit(f"probe_gemm_ncu: --problems: expected linear:kind pairs of {pairs}, got {text!r}")
    return [known[w] for w in wanted]


def run(problems: list[tuple], labels_path: str) -> None:
    """Each problem's kernels, three warm-up calls each, then one profiled call each (labels written in order)."""
    import torch

    from probe_cute_rowwise_gemm import packed_operands
    from mxflux.kernels.gemm_cute import available, prepared_gemm

    if not available():
        raise SystemExit("probe_gemm_ncu: needs CuTe DSL and a Hopper GPU (gpu_run.sh cutedsl)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones((), device="cuda")
    labels = []
    for name, kind, m, n, k, has_bias, fp32_out in problems:
        (a, b, sa, sb), _, bias = packed_operands(m, k, n, gen)
        bias = bias if has_bias else None
        out_dtype = torch.float32 if fp32_out else torch.bfloat16
        out = torch.empty(m, n, dtype=out_dtype, device="cuda")
        calls = {
            "cublas-tensorwise": lambda: torch._scaled_mm(a, b.t(), one, one, bias=bias, out_dtype=out_dtype),
            "cublas-tensorwise-fast": lambda: torch._scaled_mm(a, b.t(), one, one, bias=bias, out_dtype=out_dtype,
                                                               use_fast_accum=True),
            "cublas-rowscaled": lambda: torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype),
            "ours-fp32": prepared_gemm(a, sa, b, sb, bias, out, accumulation="fp32"),
            "ours-fp32h": prepared_gemm(a, sa, b, sb, bias, out, accumulation="fp32h"),
        }
        for label in KERNELS:
            for _ in range(3):
                calls[label]()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            calls[label]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            labels.append(dict(linear=name, kind=kind, m=m, n=n, k=k, bias=has_bias, fp32_out=fp32_out,
                               kernel=label))
            print(f"{name} {kind} M={m} N={n} K={k}: {label} profiled", file=sys.stderr, flush=True)
    with open(labels_path, "w") as f:
        json.dump(labels, f, indent=1)


def summarize(csv_path: str, labels_path: str) -> list[dict]:
    """ncu's `--csv --page details` output, one row per metric, as one record per profiled GEMM kernel (matched in
    launch order to the labels), every metric kept by section."""
    with open(labels_path) as f:
        labels = json.load(f)
    with open(csv_path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines ("==PROF==") are not CSV
    by_id: dict[str, dict] = {}
    for row in csv.DictReader(lines):
        rec = by_id.setdefault(row["ID"], {"kernel_name": row["Kernel Name"], "metrics": {}})
        section = rec["metrics"].setdefault(row["Section Name"], {})
        section[row["Metric Name"]] = {"unit": row.get("Metric Unit", ""), "value": row["Metric Value"]}
    gemms = [rec for _, rec in sorted(by_id.items(), key=lambda kv: int(kv[0]))
             if any(mark in rec["kernel_name"] for mark in GEMM_KERNEL_MARKS)]
    if len(gemms) != len(labels):
        raise SystemExit(f"probe_gemm_ncu: {len(gemms)} GEMM kernels profiled, {len(labels)} launches labelled "
                         f"(names: {[g['kernel_name'][:40] for g in gemms]})")
    out = []
    for label, rec in zip(labels, gemms):
        flat = {name: v for section in rec["metrics"].values() for name, v in section.items()}
        head = {name: f"{flat[name]['value']} {flat[name]['unit']}".strip() for name in HEADLINE if name in flat}
        out.append({**label, "kernel_name": rec["kernel_name"], "headline": head, "sections": rec["metrics"]})
        print(f"{label['linear']:8s} {label['kind']:6s} {label['kernel']:23s} " +
              "; ".join(f"{k} {v}" for k, v in head.items()), flush=True)
    return out


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--problems", default="linear1:fprop,linear2:dgrad,linear1:wgrad",
                help="comma-separated linear:kind pairs (kind: fprop, dgrad, wgrad)")
ap.add_argument("--m", type=int, default=32768, help="tokens")
ap.add_argument("--labels", required=True, help="JSON of the profiled launches, in order (written, then read)")
ap.add_argument("--summarize", metavar="CSV", help="read ncu's CSV instead of running the kernels")
ap.add_argument("--json")


def main() -> int:
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.summarize:
        rows = summarize(args.summarize, args.labels)
        if args.json:
            from probe_cute_rowwise_gemm import write_json

            write_json(args.json, "packed", {k: k for k in KERNELS}, rows)
        return 0
    run(parse_problems(args.problems, args.m), args.labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
