"""Would a ping-pong schedule close the MX GEMM's gap in the step? quack's Hopper FP8 GEMM timed beside ours.

In the MBS-64 step MXFP6's GEMMs run 1.036x the time of torchao's at the same accumulation, the loss gathering
where K is short and the output wide: a cost per output tile, which our CuTe kernel's cooperative schedule (both
consumer warp groups on one tile, its epilogue under no MMA) pays in full, and two cheaper epilogues did not remove
(benchmarks/NOTES.md, "The epilogue trials, and torchao's fast accumulation weighed"). quack-kernels (Tri Dao's
CuTe-DSL kernels, `pip install quack-kernels`) has a Hopper FP8 GEMM with each k-tile's sums promoted to fp32
(our contract's accumulation) in both schedules, ping-pong among them: each consumer warp group on its own 64-row
tile, one group's epilogue under the other's MMAs. This probe times it per Flux GEMM (fprop with its bias, dgrad,
bf16 out; wgrad, fp32 out) beside our kernel (`gemm_cute`, the default configuration) and cuBLAS tensor-wise with
and without fast accumulation, on the same E4M3 operands, and checks quack's output against cuBLAS's unit-scaled
tensor-wise output (the share of bit-equal elements: 1.0 where both promote every 128 products).

quack's default epilogue adds vectors, it does not multiply by them: timed, its epilogue adds the bias (or the
column scales) along N and the row scales along M, as many vector loads as ours, which multiplies by the two scales
and adds the bias; its bits are checked on a call adding the bias alone. The `-scaled` configurations are the
drop-in candidates: the same schedules with our contract's epilogue written for quack's epilogue front end
(`mxflux.kernels.gemm_quack`, which MXFLUX_CUTE_KERNEL=quack-pingpong puts in the step), timed and checked bit
for bit against cuBLAS's row-scaled GEMM, whose bits our CuTe kernel gives.

    PYTHONPATH=src python3 benchmarks/probe_quack_gemm.py --json $OUT/quack_gemm.json [--m 16384,32768]
        [--operands random] [--configs pingpong-64x192-2x1-scaled,cooperative-128x192-2x1-scaled]
    python3 benchmarks/probe_quack_gemm.py --compile-only   # no GPU: builds each configuration for sm_90a

Needs quack-kernels 0.6.5 (with nvidia-cutlass-dsl >= 4.7, apache-tvm-ffi, einops and torch-c-dlpack-ext);
benchmarks/cutedsl_carry.sh brings them to the device.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))  # mxflux, run from anywhere
from mxflux.kernels.gemm_quack import CONFIGS as QUACK_CONFIGS  # noqa: E402 (no quack import at module level)
from mxflux.kernels.gemm_quack import prepared_gemm  # noqa: E402

# (tile M, tile N), cluster (M, N), ping-pong or cooperative, of each configuration tried. Promoted sums need
# twice the accumulator registers: a consumer warp group holds 64x192 of them in 168 registers, so ping-pong's
# tile (one warp group's) is 64 rows, cooperative's (two warp groups') 128. (Ping-pong 64x256 spills 1056 bytes a
# thread, built for sm_90a: not tried.)
CONFIGS = {"pingpong-64x192-2x1": ((64, 192), (2, 1), True), "pingpong-64x128-2x1": ((64, 128), (2, 1), True),
           "cooperative-128x192-2x1": ((128, 192), (2, 1), False)}
# The same schedules with our GEMM contract's epilogue (`mxflux.kernels.gemm_quack`, MXFLUX_CUTE_KERNEL's): the
# drop-in candidates, timed and checked bit for bit against cuBLAS's row-scaled GEMM, which our CuTe kernel equals.
SCALED = {"pingpong-64x192-2x1-scaled": "quack-pingpong", "cooperative-128x192-2x1-scaled": "quack-cooperative"}
ALL = {**CONFIGS, **{name: QUACK_CONFIGS[kernel] for name, kernel in SCALED.items()}}


def scaled_call(name: str, a, b, out, a_scale, b_scale, bias=None, launch: bool = True):
    """A call with no arguments running the library's quack GEMM in `SCALED` configuration `name`: out [M, N] =
    (a ⊙ a_scale [M, 1]) · (b ⊙ b_scale [1, N])ᵀ (+ bias [N]); `launch` False only builds it (compile-only)."""
    return prepared_gemm(SCALED[name], a, a_scale, b, b_scale, bias, out, launch=launch)


@contextlib.contextmanager
def _as_if_on_an_h100():
    """quack's host code asks the device for its compute capability and its most active clusters while it builds a
    kernel; without one (compile-only), answer as an H100 SXM would (sm_90, 132 SMs)."""
    patched = []
    for module in [m for name, m in sys.modules.items() if name.startswith("quack")]:
        for attr, value in (("get_device_capacity", lambda *a, **k: (9, 0)),
                            ("get_max_active_clusters", lambda cluster_size, *a, **k: 132 // cluster_size)):
            if hasattr(module, attr):
                patched.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


def quack_call(name: str, a, b, out, rowvec=None, colvec=None):
    """A call with no arguments running quack's GEMM in configuration `name` (a static persistent schedule, tile
    columns in bands of up to 8, as ours): out [M, N] = a [M, K] · b [N, K]ᵀ (+ rowvec [1, N]) (+ colvec [1, M]),
    fp32 vectors added in its epilogue before the one rounding."""
    from quack.gemm import gemm

    (tile_m, tile_n), (cluster_m, cluster_n), pingpong = CONFIGS[name]
    return lambda: gemm(a, b, out, None, None, tile_m, tile_n, cluster_m, cluster_n, pingpong=pingpong,
                        persistent=True, is_dynamic_persistent=False, max_swizzle_size=8, rowvec_bias=rowvec,
                        colvec_bias=colvec)


def compile_only(configs: list[str]) -> list[dict]:
    """Build each configuration for sm_90a from quack's fake tensors (no GPU) as the GPU run times it: E4M3
    operands K-major, a vector added along N and one along M, bf16 out (fprop, dgrad) and fp32 out (wgrad)."""
    import cutlass
    from quack.gemm import _compile_gemm
    from quack.rounding import RoundingMode

    rows = []
    for name in configs:
        if name in SCALED:
            rows += _compile_scaled(name)
            continue
        tile, cluster, pingpong = CONFIGS[name]
        for d_dtype in (cutlass.BFloat16, cutlass.Float32):
            # (a, b, d, c dtypes; a, b, d, c majors; tile, cluster; pingpong, persistent, dynamic; rowvec, colvec
            # dtypes, colvec ndim; alpha, beta modes; add to output; concat layout; varlen m, k; gather A; TMA
            # gather; batch permutation; device capacity; rounding; seed mode; warps)
            rows.append(_built(name, d_dtype is cutlass.Float32, lambda d_dtype=d_dtype: _compile_gemm(
                cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, d_dtype, None, "k", "k", "n", None, tile, (*cluster, 1),
                pingpong, True, False, cutlass.Float32, cutlass.Float32, 2, 0, 0, False, (), False, False, False,
                False, False, (9, 0), RoundingMode.RN, 0, None, batched=False)))
    return rows


def _built(name: str, fp32_out: bool, build) -> dict:
    """Run `build` (one kernel's compile) and say how it went: a row of `compile_only`'s, printed."""
    t = time.perf_counter()
    try:
        build()
        row = dict(config=name, fp32_out=fp32_out, compiled=True)
    except Exception as e:  # a configuration quack refuses: say so, go on
        row = dict(config=name, fp32_out=fp32_out, compiled=False,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    row["compile_s"] = round(time.perf_counter() - t, 2)
    print(f"{name:31s} fp32 out={row['fp32_out']!s:5s} " +
          (f"compiled in {row['compile_s']} s" if row["compiled"] else f"refused: {row['error']}"), flush=True)
    return row


def _compile_scaled(name: str) -> list[dict]:
    """`compile_only` for a `SCALED` configuration: built through quack's epilogue front end from CPU tensors of the
    dtypes and layouts the GPU run passes (bf16 out with the bias, fp32 out without)."""
    import torch

    m, n, k = 1024, 768, 512
    a, b = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.zeros(n, k, dtype=torch.float8_e4m3fn)

    def build(out_dtype, bias):
        with _as_if_on_an_h100():
            scaled_call(name, a, b, torch.empty(m, n, dtype=out_dtype), torch.ones(m, 1), torch.ones(1, n), bias,
                        launch=False)()

    return [_built(name, out_dtype == torch.float32, lambda out_dtype=out_dtype, bias=bias: build(out_dtype, bias))
            for out_dtype, bias in ((torch.bfloat16, torch.zeros(n)), (torch.float32, None))]


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--configs", default=",".join(ALL), help=f"comma-separated, of {', '.join(ALL)}")
ap.add_argument("--m", default="32768", help="tokens (the GEMMs' M), comma-separated, e.g. 16384,32768")
ap.add_argument("--operands", choices=("random", "packed"), default="packed",
                help="Gaussian tensors packed as the step packs them (default), or random E4M3 bytes")
ap.add_argument("--compile-only", action="store_true", help="build for sm_90a from fake tensors; no GPU needed")
ap.add_argument("--json")


def main() -> int:
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, run from anywhere
    from probe_cute_rowwise_gemm import configs_and_tokens, write_json

    configs, tokens = configs_and_tokens(ap, args, ALL)
    # quack's disk cache would pickle the epilogue functions of this script, run as __main__: compile in process
    os.environ.setdefault("QUACK_CACHE_ENABLED", "0")
    if args.compile_only:  # read when the DSL and quack are imported
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError as e:
        print(f"probe_quack_gemm: needs quack-kernels (pip install quack-kernels; {e})", file=sys.stderr)
        return 2
    if args.compile_only:
        rows = compile_only(configs)
    else:
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            print("probe_quack_gemm: needs a CUDA device of sm_90 (--compile-only builds without one)",
                  file=sys.stderr)
            return 2
        rows = measure(configs, tokens, args.operands)
    if args.json:
        write_json(args.json, args.operands, {c: ALL[c] for c in configs}, rows)
    return 0


def measure(configs: list[str], tokens: list[int], operands: str) -> list[dict]:
    """Per Flux GEMM: cuBLAS tensor-wise (unit scales) with and without fast accumulation, our CuTe GEMM (row
    scales, the default configuration) and quack's per configuration, ms (median), and quack's share of outputs
    bit-equal to cuBLAS's: the plain configurations (timed with two vectors added) against its unit-scaled
    tensor-wise output with the bias, the scaled ones (our epilogue) against its row-scaled output."""
    import torch
    import triton.testing
    from probe_cute_rowwise_gemm import _problems, packed_operands
    from probe_scaled_mm_autotune import _operands
    from mxflux.kernels.gemm_cute import available, prepared_gemm

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones((), device="cuda")
    rows = []
    for name, kind, m, n, k, has_bias, fp32_out in _problems(tokens):
        if operands == "packed":
            (a, b, sa, sb), _, bias = packed_operands(m, k, n, gen)
        else:
            a, b, sa, sb, bias = _operands(m, k, n, gen)
        bias = bias if has_bias else None
        out_dtype = torch.float32 if fp32_out else torch.bfloat16
        tensorwise = lambda: torch._scaled_mm(a, b.t(), one, one, bias=bias, out_dtype=out_dtype)  # noqa: E731
        tensorwise_fast = lambda: torch._scaled_mm(a, b.t(), one, one, bias=bias, out_dtype=out_dtype,  # noqa: E731
                                                   use_fast_accum=True)
        want = tensorwise()
        # the contract's reference for the scaled configurations: cuBLAS's row-scaled GEMM (ours gives its bits)
        want_scaled = torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype)
        row = dict(linear=name, kind=kind, m=m, n=n, k=k, bias=has_bias, cublas_tensorwise_ms=bench(tensorwise),
                   cublas_tensorwise_fast_ms=bench(tensorwise_fast))
        if available():
            ours = prepared_gemm(a, sa, b, sb, bias, torch.empty_like(want))
            row["ours_ms"] = bench(ours)
        # the vectors quack's timed epilogue adds: the bias (or the column scales) along N, the row scales along M
        along_n = (bias.float() if bias is not None else sb.float()).reshape(1, -1)
        along_m = sa.float().reshape(1, -1)
        for config in configs:
            out = torch.full_like(want, float("nan"))  # every element must be written
            if config in SCALED:
                checked = timed = scaled_call(config, a, b, out, sa, sb, bias)
                reference = want_scaled
            else:
                checked = quack_call(config, a, b, out, bias.float().reshape(1, -1) if bias is not None else None)
                timed = quack_call(config, a, b, torch.empty_like(want), along_n, along_m)
                reference = want
            try:  # (the timed call too: its two vectors make a kernel of its own)
                checked()
                torch.cuda.synchronize()
                row[config] = dict(bit_equal=float((out == reference).float().mean()),
                                   written=bool(not out.isnan().any()), ms=bench(timed))
            except Exception as e:  # a configuration quack or the device refuses: say so, go on
                row[config] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        rows.append(row)
        summary = "; ".join(f"{c} {row[c]['ms']:.3f} ms ({row[c]['bit_equal']:.4f} bit-equal)" if "ms" in row[c]
                            else f"{c} {row[c]['error']}" for c in configs)
        print(f"{name:8s} {kind:6s} M={m} N={n} K={k}: cuBLAS tensor-wise {row['cublas_tensorwise_ms']:.3f} ms, fast "
              f"{row['cublas_tensorwise_fast_ms']:.3f}" + (f", ours {row['ours_ms']:.3f}" if "ours_ms" in row else "")
              + f"; {summary}", flush=True)
    for m_tokens, kind in ((t, k) for t in tokens for k in ("fprop", "dgrad", "wgrad")):
        these = [r for r in rows if r["kind"] == kind and r["m" if kind != "wgrad" else "k"] == m_tokens]
        line = (f"{kind} at {m_tokens} tokens, ms summed: cuBLAS tensor-wise "
                f"{sum(r['cublas_tensorwise_ms'] for r in these):.2f}, fast "
                f"{sum(r['cublas_tensorwise_fast_ms'] for r in these):.2f}")
        if all("ours_ms" in r for r in these):
            line += f", ours {sum(r['ours_ms'] for r in these):.2f}"
        for config in configs:
            if all("ms" in r.get(config, {}) for r in these):
                line += (f", {config} {sum(r[config]['ms'] for r in these):.2f} (bit-equal >= "
                         f"{min(r[config]['bit_equal'] for r in these):.4f})")
        print(line, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
