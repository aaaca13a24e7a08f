"""Can inductor's Triton templates beat cuBLAS at the row-wise scaled FP8 GEMM of the Flux shapes?

MXFP6's GEMMs are cuBLAS's row-wise scaled FP8 GEMM (`torch._scaled_mm` with [M, 1] and [1, N]
fp32 scales), which runs one 128x128 tile kernel at every Flux shape where the tensor-wise GEMM of
torchao's FP8 picks 128x160 to 192x192 tiles: 9 ms of the proxy step at micro-batch 64
(benchmarks/RESULTS.md). Inductor has Triton templates for exactly this scaling (persistent, TMA,
row-wise scales applied in the epilogue) that `mode="max-autotune"` benchmarks against cuBLAS. This
probe times, per shape, the eager cuBLAS call against the compiled, autotuned one on the same
operands, and checks the compiled result against cuBLAS's within the fp32 summation-order bound
K·2^-24·Σ|a·b| plus one output ulp (the GEMM contract, docs/design.md), so the question "is there
a faster kernel that keeps the contract" is answered before any change to the MX layers (which
call `_scaled_mm` inside an opaque custom op today, where inductor cannot autotune it).

    PYTHONPATH=src python3 benchmarks/probe_scaled_mm_autotune.py --json $OUT/scaled_mm_autotune.json
    PYTHONPATH=src python3 benchmarks/probe_scaled_mm_autotune.py --shapes qkv,fc2 --m 16384 32768 --wgrad

Inductor prints its autotuning table (every candidate kernel and its time) to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench_kernels import LINEARS as _LINEARS  # Flux-12B's MX linears: (name, K, N)

LINEARS = {name: (k, n) for name, k, n in _LINEARS}


def _operands(m: int, k: int, n: int, gen: torch.Generator):
    """FP8 operands with power-of-two row scales, as the MX fold produces them."""
    a = (4 * torch.randn(m, k, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
    b = (4 * torch.randn(n, k, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-6, 6, (m, 1), device="cuda", generator=gen).float())
    sb = torch.exp2(torch.randint(-6, 6, (1, n), device="cuda", generator=gen).float())
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    return a, b, sa, sb, bias


def fprop(a, b, sa, sb, bias):
    return torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=False)


def wgrad(a, b, sa, sb, bias):
    del bias  # the wgrad GEMM writes fp32 dW with no bias
    return torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32, use_fast_accum=False)


def _within_contract(got: torch.Tensor, want: torch.Tensor, a, b, sa, sb) -> tuple[bool, float, float]:
    """(every output within 2x the fp32 summation bound of cuBLAS's + one ulp, fraction bit-equal,
    largest |difference| / bound)."""
    k = a.shape[1]
    mag = (a.float().abs() @ b.float().abs().t()) * sa * sb  # Σ|a·b| per output, scaled
    ulp = torch.finfo(got.dtype).eps * want.float().abs()
    bound = 2 * k * 2.0**-24 * mag + ulp
    diff = (got.float() - want.float()).abs()
    same = torch.isnan(got) == torch.isnan(want)
    return (bool(same.all() and (diff[~torch.isnan(want)] <= bound[~torch.isnan(want)]).all()),
            float((got == want).float().mean()), float((diff / bound.clamp_min(1e-30)).nan_to_num().max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,fc2,linear1", help=f"comma-separated, of {','.join(LINEARS)}")
    ap.add_argument("--m", type=int, nargs="+", default=[32768], help="token counts")
    ap.add_argument("--wgrad", action="store_true", help="also the fp32-output GEMM without bias (wgrad)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    names = args.shapes.split(",")
    unknown = [s for s in names if s not in LINEARS]
    if unknown:
        sys.exit(f"--shapes: unknown {unknown}; expected names of {list(LINEARS)}")
    if not torch.cuda.is_available():
        sys.exit("probe_scaled_mm_autotune: needs a CUDA device")

    import triton.testing
    from torch import _dynamo
    from torch._inductor import config as inductor_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    fns = [("fprop", fprop)] + ([("wgrad", wgrad)] if args.wgrad else [])
    with inductor_config.patch({"max_autotune_gemm_backends": "ATEN,TRITON",
                                "triton.enable_persistent_tma_matmul": True}):
        for name in names:
            k, n = LINEARS[name]
            for m in args.m:
                ops = _operands(m, k, n, gen)
                for kind, fn in fns:
                    _dynamo.reset()  # one compile per shape, no cache limit reached
                    compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
                    t0 = time.time()
                    got = compiled(*ops)
                    compile_s = time.time() - t0
                    want = fn(*ops)
                    ok, equal, worst = _within_contract(got, want, *ops[:4])
                    eager_ms = triton.testing.do_bench(lambda: fn(*ops), warmup=25, rep=100, return_mode="median")
                    comp_ms = triton.testing.do_bench(lambda: compiled(*ops), warmup=25, rep=100,
                                                      return_mode="median")
                    tflop = 2 * m * n * k / 1e12
                    rows.append(dict(shape=name, kind=kind, M=m, K=k, N=n, cublas_ms=eager_ms,
                                     inductor_ms=comp_ms, cublas_tflops=tflop / (eager_ms * 1e-3),
                                     inductor_tflops=tflop / (comp_ms * 1e-3), within_contract=ok,
                                     bit_equal_frac=equal, worst_over_bound=worst, compile_s=compile_s))
                    r = rows[-1]
                    print(f"{name:8s} {kind} M={m} K={k} N={n}: cuBLAS {eager_ms:.3f} ms "
                          f"({r['cublas_tflops']:.0f} TFLOP/s), inductor {comp_ms:.3f} ms "
                          f"({r['inductor_tflops']:.0f}), "
                          f"x{eager_ms / comp_ms:.2f}; within contract {ok} (bit-equal {equal:.3f}, "
                          f"worst {worst:.2f} of bound); compile {compile_s:.0f} s", flush=True)
                del ops
                torch.cuda.empty_cache()
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(), device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
