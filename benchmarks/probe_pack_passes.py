"""Time the ROWWISE packer's two passes apart, at several grid sizes, on one GPU.

The row granularity (the recipes' `mx_gemm: rowwise`) runs two kernels per call: pass 1 (block
exponents, per-row and per-column maxima by atomic max) and pass 2 (encode both orientations).
This probe times each pass of one call with the torch profiler (median over calls, inputs
rotating past L2), for activations (bf16), gradients (bf16 with column sums) and master weights
(fp32), under the packer's own grids (`auto`: each pass sized for its own occupancy) and under one
fixed grid of about N waves of two resident programs per SM for both passes (`--grids auto,2,4`:
the rule before `persistent_row_programs`), so a
change to either pass or to the grid can be judged per pass. Prints a table; `--json PATH` writes
the numbers.

    PYTHONPATH=src python3 benchmarks/probe_pack_passes.py --grids auto,2 --json $OUT/pack_passes.json

A/B of another branch's packer in the same device call, each in its own process:

    git show BRANCH:src/mxflux/kernels/operands_cuda.py > ab_branch.py       # here, then on the GPU:
    for v in src/mxflux/kernels/operands_cuda.py ab_branch.py src/mxflux/kernels/operands_cuda.py; do
        python3 benchmarks/probe_pack_passes.py --variant $v --json $OUT/pp_$(basename $v .py).json; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

CASES = (  # (name, rows, cols, dtype, colsum)
    ("X bf16", 16384, 3072, torch.bfloat16, False),
    ("X bf16 wide", 16384, 12288, torch.bfloat16, False),
    ("X bf16 widest", 32768, 15360, torch.bfloat16, False),
    ("dY bf16 +colsum", 16384, 9216, torch.bfloat16, True),
    ("W fp32", 9216, 3072, torch.float32, False),
)


def _pass_times(fn, calls: int) -> tuple[list[float], list[float]]:
    """µs of every pass-1 and pass-2 kernel over `calls` calls of fn (two `_pack_kernel` launches each)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.name == "_pack_kernel" and e.device_type.name == "CUDA"),
                key=lambda e: e.time_range.start)
    durs = [e.time_range.end - e.time_range.start for e in ev]
    return durs[0::2], durs[1::2]


def load_packer(path: str | None):
    """The packer module: mxflux's own, or a variant copy of operands_cuda.py (another branch's)
    loaded as a module of the mxflux.kernels package, so that its relative imports resolve to this
    tree. Triton compiles its kernels from that file's source, apart from the tree's own."""
    import importlib
    import importlib.util

    if path is None:
        return importlib.import_module("mxflux.kernels.operands_cuda")
    importlib.import_module("mxflux.kernels")
    spec = importlib.util.spec_from_file_location("mxflux.kernels._probe_variant", path)
    if spec is None:
        raise SystemExit(f"--variant: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grids", default="auto", help="comma-separated: auto (the packer's grid) or N, a fixed "
                    "~N waves of resident programs (programs per strip = ceil(N x resident / strips))")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--variant", metavar="FILE", help="time this copy of operands_cuda.py instead of the tree's")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_pack_passes: needs a CUDA device")

    from mxflux.mx import FoldGranularity

    oc = load_packer(args.variant)
    mx_operands_cuda = oc.mx_operands_cuda
    # (older variants have one grid for both passes and no per-pass sizing)
    # where the default grid is chosen: operands_plan, or an older variant itself
    planner = sys.modules[(getattr(oc, "LaunchPlan", None) or oc._LaunchPlan).__module__]
    grid0, size0 = planner._grid, getattr(oc, "_size_grids_per_pass", None)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for waves in args.grids.split(","):
        def grid(n_col_tiles, n_row_tiles, device, warps, waves=waves):
            if waves == "auto":
                return grid0(n_col_tiles, n_row_tiles, device, warps)
            sms = oc.num_sms(device.index if device.index is not None else torch.cuda.current_device())
            resident = 2 if warps <= 8 else 1
            p = max(1, min(n_row_tiles, -(-int(float(waves) * resident * sms) // n_col_tiles)))
            return (n_col_tiles, p)

        planner._grid = grid
        if size0 is not None:  # a fixed grid for both passes; auto: each pass sized for its own occupancy
            oc._size_grids_per_pass = size0 if waves == "auto" else (lambda plan, args: None)
        oc.clear_launch_plans()
        for name, r, c, dtype, colsum in CASES:
            nbuf = max(2, -(-3 * l2 // (r * c * dtype.itemsize)))
            xs = [torch.randn(r, c, device="cuda").to(dtype) for _ in range(nbuf)]
            i = [0]

            def fn():
                i[0] = (i[0] + 1) % nbuf
                return mx_operands_cuda(xs[i[0]], granularity=FoldGranularity.ROWWISE, colsum=colsum)

            for _ in range(3):
                fn()
            p1, p2 = _pass_times(fn, args.calls)
            m1, m2 = statistics.median(p1), statistics.median(p2)
            floor1 = r * c * dtype.itemsize / 4.2e6  # µs at 4.2 TB/s: pass 1 reads x once
            floor2 = r * c * (dtype.itemsize + 2) / 4.2e6  # pass 2 reads x, writes 1 B per orientation
            plan = oc._PLANS[next(reversed(oc._PLANS))]
            grids = [list(getattr(plan, "grids", {}).get(p, plan.grid)) for p in plan.passes]
            rows.append(dict(variant=args.variant or "tree", waves=waves, case=name, rows=r, cols=c,
                             pass1_us=m1, pass2_us=m2, pass1_floor_us=floor1, pass2_floor_us=floor2, grids=grids))
            print(f"grid {waves:>4s} {name:16s} [{r}x{c}] grids {grids}: pass 1 {m1:7.1f} µs "
                  f"({100 * floor1 / m1:4.1f} % of floor), pass 2 {m2:7.1f} µs ({100 * floor2 / m2:4.1f} %)",
                  flush=True)
            del xs
    oc._grid = grid0
    if size0 is not None:
        oc._size_grids_per_pass = size0
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(), device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
