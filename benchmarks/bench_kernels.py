"""Kernel benchmark for the Hopper fast path: MX packers (GB/s vs copy) and MX GEMMs (TFLOP/s).

One run measures, at the Flux-12B linear shapes (K -> N) with M = 16384 and 32768:

- copy bandwidth (device-to-device, bytes read + written): the ceiling for the packers;
- mx_operands_cuda achieved GB/s for X [M, K] and dY [M, N] (both orientations; dY with its column
  sums), per granularity, counting bytes = bf16 read + 1 B per element per orientation + scales;
- GEMM TFLOP/s of each linear's fprop, dgrad and wgrad per mode (rowwise / blockwise / exact) on packed
  operands, next to bf16, cuBLAS FP8 tensor-wise (what torchao's recipe runs; with and without fast
  accumulation) and row-scaled on plain casts, and the CuTe-DSL row-scaled GEMM (fast and fp32
  accumulation) where nvidia-cutlass-dsl is installed.

Times are medians of triton.testing.do_bench after warm-up; packer inputs rotate over several
buffers larger than L2 together. Prints a short table and writes JSON to $OUT (or --out).

    PYTHONPATH=src python3 benchmarks/bench_kernels.py            # full run (H200: ~1-2 min)
    PYTHONPATH=src python3 benchmarks/bench_kernels.py --quick    # one shape, for a smoke test
    PYTHONPATH=src python3 benchmarks/bench_kernels.py --precompile  # fill Triton's cache in parallel
    PYTHONPATH=src python3 benchmarks/bench_kernels.py --compact  # saved-operand compact / expand only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mxflux.bench.provenance import provenance
from mxflux.mx import FoldGranularity, padded_rows

LINEARS = [  # (name, K, N) of Flux-12B's MX linears
    ("qkv", 3072, 9216),
    ("proj", 3072, 3072),
    ("fc1", 3072, 12288),
    ("fc2", 12288, 3072),
    ("linear1", 3072, 21504),
    ("linear2", 15360, 3072),
]
MS = (16384, 32768)
GRANS = tuple(FoldGranularity)


def _bench(fn, rep_ms=60):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")  # ms


def _warm_up(seconds=2.0):
    """Run bf16 GEMMs for a while so the first timed kernels don't see idle clocks (a cold run
    measured its first packer shape ~1.5x slower than the same shape after warm-up)."""
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth():
    n = 1 << 30  # 1 GiB of bytes
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a), rep_ms=200)
    return 2 * n / (ms * 1e-3) / 1e9  # GB/s, read + write


def pack_bytes(r, c, gran: FoldGranularity, colsum):
    rp = padded_rows(r, gran)
    g_row = gran.groups(c)
    g_col = gran.groups(rp)
    return 2 * r * c + r * c + c * rp + 4 * (r * g_row + c * g_col) + (4 * c if colsum else 0)


def bench_pack(m, k, gran, colsum, copy_gbs, prologue="none"):
    from mxflux.kernels import mx_operands_cuda

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbuf = max(2, -(-3 * l2 // (m * k * 2)))
    xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(nbuf)]
    i = [0]

    def fn():
        i[0] = (i[0] + 1) % nbuf
        return mx_operands_cuda(xs[i[0]], granularity=gran, colsum=colsum, prologue=prologue)

    ms = _bench(fn)
    gbs = pack_bytes(m, k, gran, colsum) / (ms * 1e-3) / 1e9
    return {"ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs}


# Each Flux linear's three GEMMs as (A rows, B rows, contraction) of out = A Bᵀ, with out dtype and bias:
# fprop Y = X Wᵀ (+ bias), dgrad dX = dY (Wᵀ)ᵀ, wgrad dW = dYᵀ (Xᵀ)ᵀ in fp32 (what the MX linears run).
GEMM_KINDS = ("fprop", "dgrad", "wgrad")


def gemm_problem(kind: str, m: int, k: int, n: int) -> tuple[int, int, int, bool, torch.dtype]:
    """(A rows, B rows, contraction, bias, out dtype) of a linear K -> N's `kind` GEMM at M tokens."""
    return {"fprop": (m, n, k, True, torch.bfloat16), "dgrad": (m, k, n, False, torch.bfloat16),
            "wgrad": (n, k, m, False, torch.float32)}[kind]


def bench_gemms(kind, m, k, n):
    """TFLOP/s of one GEMM of the linear K -> N at M tokens: bf16 (torch), cuBLAS FP8 tensor-wise (unit
    scalar scales: the tiles torchao's recipe gets), cuBLAS FP8 row-scaled on plain casts, our MX GEMM per
    fold granularity on packed operands (`exact` for fprop only), and the CuTe-DSL row-scaled GEMM
    (`kernels.gemm_cute`) where CuTe DSL is installed."""
    from mxflux.kernels import gemm_cute, mx_operands_cuda, scaled_gemm_cuda

    rows_a, rows_b, kk, with_bias, out_dtype = gemm_problem(kind, m, k, n)
    flop = 2 * rows_a * rows_b * kk
    a = torch.randn(rows_a, kk, device="cuda").bfloat16()
    b = (0.02 * torch.randn(rows_b, kk, device="cuda")).bfloat16()
    bias = torch.zeros(rows_b, device="cuda", dtype=torch.bfloat16) if with_bias else None
    tflops = lambda fn: flop / (_bench(fn) * 1e-3) / 1e12  # noqa: E731
    out = {"kind": kind}
    out["bf16_mm"] = tflops(lambda: torch.nn.functional.linear(a, b, bias))  # bf16 out, as bf16 training
    af, bf = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    out["fp8_tensorwise"] = tflops(lambda: torch._scaled_mm(af, bf.t(), one, one, bias=bias, out_dtype=out_dtype))
    # with fast accumulation (torchao's forward GEMMs; what the CuTe kernel's `fast` accumulation compares with)
    out["fp8_tensorwise_fast"] = tflops(lambda: torch._scaled_mm(af, bf.t(), one, one, bias=bias, out_dtype=out_dtype,
                                                                 use_fast_accum=True))
    one_a, one_b = torch.ones(rows_a, 1, device="cuda"), torch.ones(1, rows_b, device="cuda")
    out["fp8_rowwise_cast"] = tflops(lambda: torch._scaled_mm(af, bf.t(), one_a, one_b, bias=bias, out_dtype=out_dtype,
                                                              use_fast_accum=False))
    for gran in FoldGranularity:
        mode = gran.value
        if gran == FoldGranularity.EXACT and kind != "fprop":
            continue
        pa = mx_operands_cuda(a, col=False, granularity=gran)
        pb = mx_operands_cuda(b, col=False, granularity=gran)
        try:
            out[mode] = tflops(lambda: scaled_gemm_cuda(pa.row_data, pa.row_scale, pb.row_data, pb.row_scale, gran,
                                                        bias, out_dtype))
        except Exception as e:  # record, keep measuring the rest
            out[mode] = f"error: {type(e).__name__}: {str(e)[:120]}"
        if gran == FoldGranularity.ROWWISE and gemm_cute.available():
            for accumulation, column in (("fast", "cute"), ("fp32", "cute_fp32")):
                try:
                    out[column] = tflops(lambda: gemm_cute.cute_scaled_gemm(
                        pa.row_data, pa.row_scale, pb.row_data, pb.row_scale, bias, out_dtype, accumulation))
                except Exception as e:  # record, keep measuring the rest
                    out[column] = f"error: {type(e).__name__}: {str(e)[:120]}"
    return out


def bench_compact(c, rp, copy_gbs):
    """compact / expand of one col operand [c, rp] (the packer's rowwise output of a normal input)
    against a device copy of the same bytes: compact moves 1 + 25/32 B per element, expand the
    same, the copy 2 x 1 B (its own GB/s, and the kernels' as % of the 1 GiB copy's)."""
    from mxflux.kernels import compact_operand_cuda, expand_operand_cuda, mx_operands_cuda

    bufs = 4  # rotate over inputs larger than L2 together
    data = [mx_operands_cuda(torch.randn(rp, c, device="cuda").bfloat16(), row=False).col_data for _ in range(bufs)]
    comp = [compact_operand_cuda(d) for d in data]
    dst = torch.empty_like(data[0])
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % bufs
        return i[0]

    n = c * rp
    moved = n + n * 25 // 32
    out = {"C": c, "Rp": rp}
    for name, fn, nbytes in (
        ("copy", lambda: dst.copy_(data[nxt()]), 2 * n),
        ("compact", lambda: compact_operand_cuda(data[nxt()]), moved),
        ("expand", lambda: expand_operand_cuda(*comp[nxt()]), moved),
    ):
        ms = _bench(fn)
        gbs = nbytes / (ms * 1e-3) / 1e9
        out[name] = {"us": ms * 1e3, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs}
    return out


def run_compact(res, copy, quick):
    """`--compact`: the saved operands of the Flux-12B linears at micro-batch 16 and 64 (512 tokens
    a sample): Xᵀ [K, M] and Wᵀ [K, N]."""
    res["compact"] = []
    shapes = sorted({(k, m) for _, k, _ in LINEARS for m in (8192, 32768)} | {(k, n) for _, k, n in LINEARS})
    if quick:
        shapes = [(3072, 8192), (3072, 32768)]
    print(f"{'operand [C x Rp]':22s} {'copy us':>8s} {'compact us':>10s} {'GB/s':>6s} {'%copy':>6s} "
          f"{'expand us':>9s} {'GB/s':>6s} {'%copy':>6s}", flush=True)
    for c, rp in shapes:
        r = bench_compact(c, rp, copy)
        res["compact"].append(r)
        print(f"[{c} x {rp}]".ljust(22) + f" {r['copy']['us']:8.1f} {r['compact']['us']:10.1f} "
              f"{r['compact']['GBps']:6.0f} {r['compact']['pct_copy']:6.1f} {r['expand']['us']:9.1f} "
              f"{r['expand']['GBps']:6.0f} {r['expand']['pct_copy']:6.1f}", flush=True)
        torch.cuda.empty_cache()


def probe_shapes():
    """Which M/N/K cuBLAS accepts per mode (tiny operands; records errors rather than raising)."""
    from mxflux.kernels import scaled_gemm_cuda
    from mxflux.kernels.gemm import _capabilities

    res = {"capabilities": _capabilities(torch.cuda.current_device())}
    for m, n, k in [(1000, 256, 256), (1001, 256, 256), (256, 264, 256), (256, 256, 288), (256, 250, 256),
                    (256, 256, 160), (8, 256, 256), (1, 256, 384)]:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        for gran in FoldGranularity:
            key = f"{gran.value} M={m} N={n} K={k}"
            if k % gran.row_multiple:
                res[key] = "n/a (K % group)"
                continue
            sa = torch.ones(m, gran.groups(k), device="cuda")
            sb = torch.ones(n, gran.groups(k), device="cuda")
            try:
                scaled_gemm_cuda(a, sa, b, sb, gran)
                torch.cuda.synchronize()
                res[key] = "ok"
            except Exception as e:
                res[key] = f"{type(e).__name__}: {str(e)[:160]}"
    return res


def _precompile_one(kw):
    import torch  # noqa: F811 - spawned worker

    from mxflux.kernels import mx_operands_cuda

    os.environ["MXFLUX_PACK_IO"] = kw.pop("_io", "auto")
    r, c = kw.pop("_shape", (256, 256))
    x = torch.randn(r, c, device="cuda").bfloat16()
    if kw.get("prologue") == "gelu_tanh_grad":
        kw["aux"] = torch.randn(r, c, device="cuda").bfloat16()
    t = time.time()
    mx_operands_cuda(x, **kw)
    torch.cuda.synchronize()
    return time.time() - t


def precompile(workers=16):
    """Compile the packer variants the tests and this benchmark use, in parallel processes."""
    import concurrent.futures as cf
    import multiprocessing as mp

    combos = []
    for g in GRANS:
        for colsum in (False, True):
            combos.append(dict(granularity=g, colsum=colsum))
            combos.append(dict(granularity=g, colsum=colsum, hadamard=False))
        combos.append(dict(granularity=g, col=False))
        for pro in ("gelu_tanh", "gelu_tanh_grad"):
            combos.append(dict(granularity=g, colsum=True, prologue=pro))
    for g in (FoldGranularity.ROWWISE, FoldGranularity.EXACT):
        for row, col, cs in [(True, False, False), (False, True, False), (False, False, True),
                             (True, False, True), (False, True, True)]:
            combos.append(dict(granularity=g, row=row, col=col, colsum=cs))
        combos.append(dict(granularity=g, _hw=False))
    combos.append(dict(granularity=FoldGranularity.ROWWISE, prologue="gelu_tanh_grad", colsum=True, _shape=(1001, 640)))
    for g in GRANS:  # both tile-reading variants (MXFLUX_PACK_IO), for the tests and A/B runs
        for colsum in (False, True):
            combos.append(dict(granularity=g, colsum=colsum, _io="blocks"))
        combos.append(dict(granularity=g, colsum=True, prologue="gelu_tanh_grad", _io="coalesced"))
        combos.append(dict(granularity=g, colsum=True, prologue="gelu_tanh_grad", _io="blocks"))
    seen, uniq = set(), []
    for c in combos:
        key = json.dumps(c, sort_keys=True, default=lambda v: getattr(v, "value", str(v)))
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    t = time.time()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        times = list(ex.map(_precompile_one, uniq))
    print(f"precompiled {len(uniq)} packer variants in {time.time() - t:.1f}s "
          f"(slowest {max(times):.1f}s)", flush=True)


def run_ab(out: str | None) -> None:
    """Every packer variant side by side at two shapes: tile reads (per-thread blocks or coalesced
    rows, MXFLUX_PACK_IO) x block stores (lane pairs, or each thread its own block: the variant a
    plan falls back to where the compiled layout cannot pair lanes)."""
    from mxflux.kernels import operands_cuda

    props = torch.cuda.get_device_properties(0)
    _warm_up()
    copy = copy_bandwidth()
    res = {"device": props.name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "copy_GBps": copy,
           "ab": []}
    print(f"A/B packer variants (copy {copy:.0f} GB/s): us and % of copy", flush=True)
    pairs_hold = operands_cuda._paired_stores_hold
    try:
        for m, k in ((16384, 3072), (16384, 15360)):
            for g in GRANS:
                line = []
                for stores in ("pairs", "own"):
                    operands_cuda._paired_stores_hold = pairs_hold if stores == "pairs" else (lambda plan, a: False)
                    for io in ("blocks", "coalesced"):
                        os.environ["MXFLUX_PACK_IO"] = io
                        operands_cuda.clear_launch_plans()
                        r = bench_pack(m, k, g, False, copy)
                        res["ab"].append({"M": m, "K": k, "gran": g.value, "stores": stores, "io": io, **r})
                        line.append(f"{stores}/{io} {r['ms'] * 1e3:6.1f} {r['pct_copy']:4.1f}%")
                print(f"  X[{m}x{k}] {g.value:>9s}: " + " | ".join(line), flush=True)
    finally:
        operands_cuda._paired_stores_hold = pairs_hold
        operands_cuda.clear_launch_plans()
        os.environ["MXFLUX_PACK_IO"] = "auto"
    _write(res, out, "bench_kernels_ab.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shape and M only")
    ap.add_argument("--precompile", action="store_true", help="only fill Triton's cache, in parallel")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_kernels.json")
    ap.add_argument("--profile-one", metavar="GRAN", help="run mx_operands_cuda on X [16384, 3072] a few times "
                    "(for `ncu -k regex:_pack_kernel`), granularity GRAN (rowwise, blockwise or exact)")
    ap.add_argument("--ab", action="store_true", help="time every packer variant (tile reads x block stores) at two "
                    "shapes")
    ap.add_argument("--compact", action="store_true", help="only the saved-operand compact / expand kernels "
                    "against a device copy (bench_kernels_compact.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA device")
    if args.precompile:
        precompile()
        return
    if args.ab:
        run_ab(args.out)
        return
    if args.profile_one:
        from mxflux.kernels import mx_operands_cuda

        g = FoldGranularity.from_mx_gemm(args.profile_one)
        x = torch.randn(16384, 3072, device="cuda").bfloat16()
        for _ in range(4):
            mx_operands_cuda(x, granularity=g)
        torch.cuda.synchronize()
        return
    props = torch.cuda.get_device_properties(0)
    import triton

    res = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    _warm_up()
    res["copy_GBps"] = copy = copy_bandwidth()
    print(f"{props.name}  torch {torch.__version__}  triton {triton.__version__}  copy {copy:.0f} GB/s", flush=True)
    if args.compact:
        run_compact(res, copy, args.quick)
        _write(res, args.out, "bench_kernels_compact.json")
        return
    res["shape_probe"] = probe_shapes()
    linears = LINEARS[:1] if args.quick else LINEARS
    ms_list = MS[:1] if args.quick else MS
    res["pack"], res["gemm"] = [], []
    print(f"{'shape':22s} {'tensor':9s} {'gran':>9s} {'ms':>7s} {'GB/s':>6s} {'%copy':>6s}", flush=True)
    for name, k, n in linears:
        for m in ms_list:
            for tensor, cols, colsum in (("X", k, False), ("dY", n, True)):
                for g in GRANS:
                    r = bench_pack(m, cols, g, colsum, copy)
                    res["pack"].append({"linear": name, "M": m, "K": k, "N": n, "tensor": tensor,
                                        "cols": cols, "gran": g.value, **r})
                    print(f"{name:8s} M={m:5d} {tensor}[{m}x{cols}]".ljust(32)[:32]
                          + f" {g.value:>9s} {r['ms']:7.3f} {r['GBps']:6.0f} {r['pct_copy']:6.1f}", flush=True)
            torch.cuda.empty_cache()
    # fused-MLP prologues on fc1's output (forward: GELU; backward: x GELU'(pre-activation))
    res["prologue"] = []
    for pro in ("gelu_tanh",):
        for g in GRANS:
            r = bench_pack(MS[0], 12288, g, False, copy, prologue=pro)
            res["prologue"].append({"prologue": pro, "M": MS[0], "cols": 12288, "gran": g.value, **r})
            print(f"prologue {pro} [{MS[0]}x12288] {g.value}: {r['ms']:.3f} ms {r['GBps']:.0f} GB/s {r['pct_copy']:.1f}%",
                  flush=True)
    cols = ("bf16_mm", "fp8_tensorwise", "fp8_tensorwise_fast", "fp8_rowwise_cast", "rowwise", "cute", "cute_fp32",
            "blockwise", "exact")
    print(f"\n{'GEMM (TFLOP/s)':32s}" + "".join(f"{c:>9s}" for c in ("bf16", "fp8 tw", "tw fast", "fp8 row", "rowwise",
                                                                          "cute", "cute f32", "block", "exact")))
    for name, k, n in linears:
        for m in ms_list:
            for kind in GEMM_KINDS:
                r = bench_gemms(kind, m, k, n)
                res["gemm"].append({"linear": name, "M": m, "K": k, "N": n, **r})
                fmt = lambda v: f"{v:9.0f}" if isinstance(v, float) else ("      err" if v else "        -")  # noqa: E731
                print(f"{name:8s} {kind:5s} M={m:5d} {k}->{n}".ljust(32) + "".join(fmt(r.get(c)) for c in cols),
                      flush=True)
                torch.cuda.empty_cache()
    # summary: packer % of copy per granularity, over all shapes
    for g in GRANS:
        vals = [p["pct_copy"] for p in res["pack"] if p["gran"] == g.value]
        print(f"pack gran={g.value}: {min(vals):.1f}-{max(vals):.1f}% of copy (median {sorted(vals)[len(vals) // 2]:.1f}%)")
    _write(res, args.out, "bench_kernels.json")


def _write(res: dict, out: str | None, name: str) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            json.dump({"provenance": provenance(), **res}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
