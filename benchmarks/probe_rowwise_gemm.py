"""Is there a faster cuBLASLt algorithm for the row-wise scaled FP8 GEMM than the one torch runs?

`torch._scaled_mm` runs cuBLASLt's first heuristic choice for MXFP6's row-wise scaled GEMM (a
128x128-tile kernel at every Flux shape), while torchao's tensor-wise GEMM gets larger tiles: 9 ms
of the proxy step at micro-batch 64 (benchmarks/RESULTS.md). This probe asks cuBLASLt for all its
candidates per Flux GEMM (forward with bias and bf16 output, dgrad with bf16 output, wgrad with
fp32 output), times each (`cublaslt.py` here), checks the faster ones against torch's
result within the GEMM contract (fp32 summation-order bound, benchmarks/probe_scaled_mm_autotune.py),
and prints beside them what torch's other FP8 GEMMs take on the same operands: row-wise with fast
accumulation, tensor-wise without and with it (torchao's forward uses fast accumulation).

Two more row-wise kernels ship inside torch. `torch._scaled_grouped_mm` with fp32 row scales runs
CUTLASS's sm_90 grouped GEMM (warp-specialised; without fast accumulation 128x256x64 and
128x128x128 tiles or 64x128x128 ping-pong), which a single group makes an ordinary GEMM; it
takes no bias and writes only bf16, so it could serve the dgrad GEMM (bf16 out, no bias) as it
is: for the bf16-output GEMMs it is timed against torch's row-wise GEMM of the same operands
without bias, and checked against it within the contract. And torch's CUTLASS row-wise kernel
(`at::cuda::detail::f8f8bf16_rowwise`: 128x128 or 64x128 tiles with 2x1 / 1x2 clusters, bias,
bf16 out), which `_scaled_mm` does not take on sm_90 with a recent cuBLASLt, is built as a small
op library (`cutlass_rowwise.py`) and timed on every bf16-output GEMM with its bias, against
torch's row-wise result.

    PYTHONPATH=src python3 benchmarks/probe_rowwise_gemm.py --json $OUT/rowwise_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import cublaslt
import cutlass_rowwise
from bench_kernels import LINEARS as _LINEARS
from probe_scaled_mm_autotune import _within_contract

LINEARS = {name: (k, n) for name, k, n in _LINEARS}


def _problems(name: str, m: int):
    """(kind, GEMM M, N, K, out dtype, bias) of one linear's three GEMMs at m tokens."""
    k, n = LINEARS[name]
    return [("fprop", m, n, k, torch.bfloat16, True), ("dgrad", m, k, n, torch.bfloat16, False),
            ("wgrad", n, k, m, torch.float32, False)]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _kernel_name(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return ";".join(names)[:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(LINEARS))
    ap.add_argument("--m", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--count", type=int, default=24, help="candidates asked of cuBLASLt")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not cublaslt.available():
        sys.exit("probe_rowwise_gemm: needs a CUDA device of sm_90 or later and cuBLASLt")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        for m_tok in args.m:
            for kind, m, n, k, out_dtype, has_bias in _problems(name, m_tok):
                a = (4 * torch.randn(m, k, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
                b = (4 * torch.randn(n, k, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
                sa = torch.exp2(torch.randint(-6, 6, (m, 1), device="cuda", generator=gen).float())
                sb = torch.exp2(torch.randint(-6, 6, (1, n), device="cuda", generator=gen).float())
                sbc = sb.reshape(n).contiguous()
                bias = torch.randn(n, device="cuda", generator=gen).to(out_dtype) if has_bias else None
                one = torch.ones((), device="cuda")

                def torch_rowwise(fast=False):
                    return torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)

                def torch_tensorwise(fast=False):
                    return torch._scaled_mm(a, b.t(), one, one, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)

                def grouped_rowwise():  # CUTLASS's grouped GEMM, one group: [1, m, k] x [1, k, n]
                    return torch._scaled_grouped_mm(a[None], b[None].transpose(-2, -1), sa.reshape(1, m),
                                                    sbc.reshape(1, n), out_dtype=torch.bfloat16,
                                                    use_fast_accum=False)[0]

                want = torch_rowwise()
                grouped, cutlass = {}, {}
                if out_dtype == torch.bfloat16:  # the two CUTLASS kernels write bf16 only
                    want_nobias = want if bias is None else torch._scaled_mm(a, b.t(), sa, sb, out_dtype=out_dtype)
                    try:
                        got = grouped_rowwise()
                        torch.cuda.synchronize()
                        ok, equal, worst = _within_contract(got, want_nobias, a, b, sa, sb)
                        grouped = dict(cutlass_grouped_ms=_bench(grouped_rowwise), cutlass_grouped_within_contract=ok,
                                       cutlass_grouped_bit_equal=equal, cutlass_grouped_worst_over_bound=worst,
                                       torch_rowwise_nobias_ms=_bench(
                                           lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=out_dtype)))
                        if m_tok == args.m[0]:
                            grouped["kernel_cutlass_grouped"] = _kernel_name(grouped_rowwise)
                    except RuntimeError as e:  # an older torch without the rowwise grouped path
                        grouped = dict(cutlass_grouped_error=str(e).splitlines()[0])
                    why_not = cutlass_rowwise.load()
                    if why_not:
                        cutlass = dict(cutlass_rowwise_error=why_not)
                    else:
                        poisoned = torch.full_like(want, float("nan"))  # every element must be written

                        def cutlass_rowwise_mm():
                            return cutlass_rowwise.rowwise_scaled_mm(a, b, sa, sb, bias, poisoned)

                        cutlass_rowwise_mm()
                        torch.cuda.synchronize()
                        ok, equal, worst = _within_contract(poisoned, want, a, b, sa, sb)
                        cutlass = dict(cutlass_rowwise_ms=_bench(cutlass_rowwise_mm), cutlass_rowwise_within_contract=ok,
                                       cutlass_rowwise_bit_equal=equal, cutlass_rowwise_worst_over_bound=worst)
                        if m_tok == args.m[0]:
                            cutlass["kernel_cutlass_rowwise"] = _kernel_name(cutlass_rowwise_mm)
                row = dict(shape=name, kind=kind, tokens=m_tok, M=m, N=n, K=k, out=str(out_dtype), bias=has_bias,
                           torch_rowwise_ms=_bench(torch_rowwise),
                           torch_rowwise_fast_ms=_bench(lambda: torch_rowwise(True)),
                           torch_tensorwise_ms=_bench(torch_tensorwise),
                           torch_tensorwise_fast_ms=_bench(lambda: torch_tensorwise(True)))
                algos = cublaslt.rowwise_algos(a, b, sa, sbc, bias, out_dtype, count=args.count)
                cands = []
                if m_tok == args.m[0] and name == args.shapes.split(",")[0]:
                    print("lt candidates:", [x.describe() for x in algos], flush=True)
                for i, algo in enumerate(algos):
                    out = torch.full_like(want, float("nan"))
                    try:
                        cublaslt.rowwise_scaled_mm(a, b, sa, sbc, bias, out_dtype, algo, out=out)
                        torch.cuda.synchronize()
                    except RuntimeError as e:
                        cands.append(dict(i=i, config=algo.describe(), error=str(e)))
                        continue
                    ms = _bench(lambda: cublaslt.rowwise_scaled_mm(a, b, sa, sbc, bias, out_dtype, algo, out=out))
                    c = dict(i=i, config=algo.describe(), workspace=algo.workspace, waves=algo.waves, ms=ms,
                             bit_equal=float((out == want).float().mean()))
                    if i == 0 or ms < 0.97 * row["torch_rowwise_ms"]:
                        ok, _, worst = _within_contract(out, want, a, b, sa, sb)
                        c.update(within_contract=ok, worst_over_bound=worst)
                    cands.append(c)
                timed = [c for c in cands if "ms" in c and c.get("within_contract", True)]
                best = min(timed, key=lambda c: c["ms"]) if timed else None
                row.update(candidates=cands, best=best, **grouped, **cutlass)
                if best is not None and m_tok == args.m[0] and name == args.shapes.split(",")[0]:
                    algo = algos[best["i"]]
                    row["kernel_torch"] = _kernel_name(torch_rowwise)
                    row["kernel_best"] = _kernel_name(
                        lambda: cublaslt.rowwise_scaled_mm(a, b, sa, sbc, bias, out_dtype, algo))
                    row["kernel_tensorwise"] = _kernel_name(torch_tensorwise)
                rows.append(row)
                first = cands[0] if cands else {}
                print(f"{name:8s} {kind} M={m} N={n} K={k}: torch rowwise {row['torch_rowwise_ms']:.3f} ms "
                      f"(fast {row['torch_rowwise_fast_ms']:.3f}), tensorwise {row['torch_tensorwise_ms']:.3f} "
                      f"(fast {row['torch_tensorwise_fast_ms']:.3f}); Lt #0 {first.get('ms', float('nan')):.3f} "
                      f"bit-equal {first.get('bit_equal', float('nan')):.3f}; {len(algos)} candidates, best "
                      + (f"#{best['i']} {best['ms']:.3f} ms x{row['torch_rowwise_ms'] / best['ms']:.3f} "
                         f"[{best['config']}] contract {best.get('within_contract')}" if best else "none")
                      + (f"; CUTLASS grouped {grouped['cutlass_grouped_ms']:.3f} ms against row-wise without bias "
                         f"{grouped['torch_rowwise_nobias_ms']:.3f}, contract {grouped['cutlass_grouped_within_contract']}"
                         if "cutlass_grouped_ms" in grouped else
                         f"; CUTLASS grouped: {grouped['cutlass_grouped_error']}" if grouped else "")
                      + (f"; CUTLASS row-wise {cutlass['cutlass_rowwise_ms']:.3f} ms, contract "
                         f"{cutlass['cutlass_rowwise_within_contract']}" if "cutlass_rowwise_ms" in cutlass else
                         f"; CUTLASS row-wise: {cutlass['cutlass_rowwise_error']}" if cutlass else ""),
                      flush=True)
                torch.cuda.empty_cache()
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(), device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
