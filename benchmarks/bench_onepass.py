"""The one-pass row packer against the two-pass one, at every Flux-12B activation and gradient shape.

For each packed tensor of the proxy's linears (X [M, K] of every input width; dY [M, N] of every output
width, with its column sums) at M = 16384 and 32768, in one process on one GPU:

- `two_pass`: `mx_operands_cuda` at the row granularity (what the step runs today);
- `one_pass`: `mx_operands_onepass_cuda` with the columns' e_ref predicted from the same tensor's last
  call and `--headroom` binades (the steady state: the prediction holds, the fix-up kernel launches
  and returns);
- `first_call`: the same with no prediction (every live column fixed up: the first step);
- `copy`: a device-to-device copy of x's bytes (2 B read, 2 B written per element), the ceiling.

Bits, in the same call: the one-pass operands given the columns' own maxima (headroom 0) against the
two-pass packer's (must be identical), and at `--headroom` the rows identical and every col value
inside the window the same (data times scale).

Times are medians of triton.testing.do_bench; inputs rotate over buffers larger than L2 together.

    PYTHONPATH=src python3 benchmarks/bench_onepass.py --out $OUT      # ~1 min on an H100
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from mxflux.bench.provenance import provenance

WIDTHS = [  # (tensor, C, column sums): X of each distinct input width, dY of each distinct output width
    ("X qkv/proj/fc1/linear1", 3072, False),
    ("X fc2", 12288, False),
    ("X linear2", 15360, False),
    ("dY proj/fc2/linear2", 3072, True),
    ("dY qkv", 9216, True),
    ("dY fc1", 12288, True),
    ("dY linear1", 21504, True),
]
MS = (16384, 32768)


def _bench(fn, rep_ms=80):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")


def _inputs(m, c, count):
    """`count` activation-like tensors: rows at a spread of scales, a few outlier features (as a
    transformer's activations have), each column's range steady from tensor to tensor."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + c)
    feature = torch.exp2(torch.randint(-3, 4, (c,), device="cuda", generator=g).float())
    feature[torch.randint(0, c, (max(1, c // 512),), device="cuda", generator=g)] *= 64
    out = []
    for _ in range(count):
        token = torch.exp2(torch.randn(m, 1, device="cuda", generator=g))
        out.append((torch.randn(m, c, device="cuda", generator=g) * token * feature).bfloat16())
    return out


def bench_width(m, c, colsum, headroom, copy_gbs, piece_tiles=()):
    from mxflux.kernels import mx_operands_cuda, mx_operands_onepass_cuda

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbuf = max(2, -(-3 * l2 // (m * c * 2)))
    xs = _inputs(m, c, nbuf)
    none = torch.zeros(c, dtype=torch.int32, device="cuda")
    held = [mx_operands_onepass_cuda(x, none, colsum=colsum)[1] for x in xs]  # each tensor's own maxima
    # the prediction a step makes: the last tensor's maxima (the buffers stand for consecutive steps)
    last = [held[i - 1] for i in range(nbuf)]
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % nbuf
        return i[0]

    def two():
        mx_operands_cuda(xs[nxt()], colsum=colsum)

    def one():
        k = nxt()
        mx_operands_onepass_cuda(xs[k], last[k], headroom=headroom, colsum=colsum)

    def first():
        mx_operands_onepass_cuda(xs[nxt()], none, colsum=colsum)

    fixed = [int(mx_operands_onepass_cuda(xs[k], last[k], headroom=headroom, colsum=colsum)[2]) for k in range(nbuf)]
    kernels = {"two_pass": _kernel_times(two), "one_pass": _kernel_times(one)}
    res = {"M": m, "C": c, "colsum": colsum, "buffers": nbuf,
           "two_pass_ms": _bench(two), "one_pass_ms": _bench(one), "first_call_ms": _bench(first),
           "fixed_columns_steady": fixed, "kernel_us": kernels}
    res["speedup"] = res["two_pass_ms"] / res["one_pass_ms"]
    # walks that found a piece of their stripe unpublished and read its row maxima from x (the steady state)
    helped = torch.zeros(1, dtype=torch.int32, device="cuda")
    mx_operands_onepass_cuda(xs[0], last[0], headroom=headroom, colsum=colsum, _helped=helped)
    res["helped_walks"] = int(helped)
    for p in piece_tiles:  # other piece widths (tiles of 128 columns) than the kernel's
        def one_at(tiles=p):
            k = nxt()
            mx_operands_onepass_cuda(xs[k], last[k], headroom=headroom, colsum=colsum, _piece_tiles=tiles)

        res.setdefault("one_pass_ms_by_piece_tiles", {})[p] = _bench(one_at)
    res["copy_ms"] = 4 * m * c / (copy_gbs * 1e9) * 1e3
    res["one_pass_pct_copy"] = 100 * res["copy_ms"] / res["one_pass_ms"]
    res.update(_bits(xs[0], held[0], headroom, colsum))
    return res


def _kernel_times(fn, calls=5):
    """Device time per kernel name (µs per call, the mean of `calls` calls) under torch's profiler: which of
    a path's kernels the time goes to."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        t = getattr(evt, "cuda_time_total", 0) if t is None else t
        if t and "kernel" in evt.key:
            out[evt.key] = t / calls
    return out


def _bits(x, own, headroom, colsum):
    from mxflux.kernels import mx_operands_cuda, mx_operands_onepass_cuda

    want = mx_operands_cuda(x, colsum=colsum)
    exact, _, _ = mx_operands_onepass_cuda(x, own, colsum=colsum)
    fields = ("row_data", "row_scale", "col_data", "col_scale")
    same = {f: bool(torch.equal(getattr(exact, f).view(torch.uint8), getattr(want, f).view(torch.uint8)))
            for f in fields}
    placed, _, _ = mx_operands_onepass_cuda(x, own, headroom=headroom, colsum=colsum)
    values_col = torch.equal(placed.col_data.float() * placed.col_scale, want.col_data.float() * want.col_scale)
    return {"bits_equal_own_maxima": same, "rows_equal_at_headroom": bool(
                torch.equal(placed.row_data.view(torch.uint8), want.row_data.view(torch.uint8))),
            "col_values_equal_at_headroom": bool(values_col),
            "outside_two_pass": int(want.blocks_outside_window),
            "outside_at_headroom": int(placed.blocks_outside_window)}


def _profile_one(shape: str, headroom: int) -> int:
    """Launch `_pack_kernel` (pass 1, pass 2), then `_onepass_kernel`, once each on one X, its prediction its own
    maxima (no column to fix up): what `ncu -k regex:"_pack_kernel|_onepass_kernel" -c 3` captures in order."""
    from mxflux.kernels import mx_operands_cuda, mx_operands_onepass_cuda
    from mxflux.mx.operands import rowwise_erefs_reference

    try:
        m, c = (int(v) for v in shape.split(","))
    except ValueError:
        print(f"bench_onepass: --profile-one: expected M,C (two integers), got {shape!r}", file=sys.stderr)
        return 2
    x = _inputs(m, c, 1)[0]
    own = rowwise_erefs_reference(x)[1]  # (torch ops: no kernel of the captured names)
    mx_operands_cuda(x)
    mx_operands_onepass_cuda(x, own, headroom=headroom)
    torch.cuda.synchronize()
    print(f"profiled X [{m}, {c}]: the two passes, then the one-pass kernel")
    return 0


def copy_bandwidth():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a), rep_ms=200)
    return 2 * n / (ms * 1e-3) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_onepass.json")
    ap.add_argument("--headroom", type=int, default=1, help="binades above the last call's maxima (default 1)")
    ap.add_argument("--quick", action="store_true", help="one shape")
    ap.add_argument("--piece-tiles", default="", help="also time the one-pass kernel at these piece widths, tiles "
                    "of 128 columns (e.g. 1,4,8; the kernel's: ONEPASS_PIECE_TILES)")
    ap.add_argument("--profile-one", metavar="M,C", help="for Nsight Compute (`gpu_run.sh ncuonepass`): pack one "
                    "X [M, C] by the two passes, then by the one-pass kernel, once each, and nothing else")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_onepass: needs a CUDA device", file=sys.stderr)
        return 2
    if args.profile_one:
        return _profile_one(args.profile_one, args.headroom)
    try:
        piece_tiles = [int(v) for v in args.piece_tiles.split(",") if v.strip()]
        if any(p < 1 for p in piece_tiles):
            raise ValueError
    except ValueError:
        print(f"bench_onepass: --piece-tiles: expected positive integers separated by commas, got {args.piece_tiles!r}",
              file=sys.stderr)
        return 2
    copy_gbs = copy_bandwidth()
    rows = []
    widths = WIDTHS[:1] if args.quick else WIDTHS
    print(f"copy {copy_gbs:.0f} GB/s; headroom {args.headroom}")
    print(f"{'tensor':24} {'M':>6} {'C':>6} {'two-pass':>9} {'one-pass':>9} {'first':>8} {'x':>6} {'%copy':>6} bits")
    for m in (MS[:1] if args.quick else MS):
        for name, c, colsum in widths:
            r = bench_width(m, c, colsum, args.headroom, copy_gbs, piece_tiles)
            r["tensor"] = name
            rows.append(r)
            ok = all(r["bits_equal_own_maxima"].values()) and r["rows_equal_at_headroom"]
            print(f"{name:24} {m:6d} {c:6d} {r['two_pass_ms']:9.3f} {r['one_pass_ms']:9.3f} {r['first_call_ms']:8.3f} "
                  f"{r['speedup']:6.3f} {r['one_pass_pct_copy']:6.1f} {'same' if ok else 'DIFFER'} "
                  f"fixed {max(r['fixed_columns_steady'])}", flush=True)
            times = {path: {k: round(v, 1) for k, v in t.items()} for path, t in r["kernel_us"].items()}
            print("    kernels µs:", times, "helped", r["helped_walks"],
                  "by piece tiles", r.get("one_pass_ms_by_piece_tiles", {}), flush=True)
    two = sum(r["two_pass_ms"] for r in rows)
    one = sum(r["one_pass_ms"] for r in rows)
    print(f"sum: two-pass {two:.2f} ms, one-pass {one:.2f} ms ({two / one:.3f}x)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_onepass.json"), "w") as f:
            json.dump({"provenance": provenance(), "copy_GBps": copy_gbs, "headroom": args.headroom,
                       "rows": rows, "sum_two_pass_ms": two, "sum_one_pass_ms": one}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
