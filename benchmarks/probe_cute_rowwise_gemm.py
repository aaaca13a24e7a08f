"""Does a row-scaled FP8 GEMM with the tensor-wise kernels' tiles beat cuBLAS's row-scaled one?

MXFP6's forward GEMMs run cuBLAS's only row-scaled algorithm (128x128 tiles, no clusters, the bias in
its epilogue): 40 ms of the proxy's MBS-64 step against ~30 for torchao's tensor-wise ones, the GEMM
gap of issue 48 (benchmarks/RESULTS.md, NOTES.md "The fprop GEMMs unit-scaled"). Deferring the scales
to the next op does not pay (the partitioner then writes the scaled output whole), so the scales have
to be applied where the accumulator is. `mxflux.kernels.cute_rowwise_gemm` is such a GEMM in CuTe DSL (CUTLASS's
persistent warp-specialized Hopper FP8 GEMM with the row granularity's scales and the bias in its
epilogue). This probe, per tile configuration and per Flux GEMM (fprop with its bias and dgrad, bf16
out; wgrad, fp32 out), checks its output against cuBLAS's row-scaled one
(every element written, each within the fp32 summation bound: `probe_scaled_mm_autotune._within_contract`;
the share of bit-equal elements says whether the sums are fp32's: the `fast` configurations do not promote
their partial sums, the `-fp32` ones do)
and times it beside cuBLAS row-scaled (what MXFP6 runs) and cuBLAS tensor-wise (unit scales: the
tiles torchao's GEMMs get), with and without fast accumulation (torchao's forward GEMMs have it).

    PYTHONPATH=src python3 benchmarks/probe_cute_rowwise_gemm.py --json $OUT/cute_rowwise_gemm.json [--m 4096,32768]
        [--operands packed] [--clock]
    python3 benchmarks/probe_cute_rowwise_gemm.py --compile-only   # no GPU: builds each configuration for sm_90a

The operands are random E4M3 bytes with random power-of-two scales by default; `--operands packed` makes them as
the step does (Gaussian activations and weights through the MX packer for the row-scaled GEMMs, the same tensors
cast as torchao's recipe casts them for the tensor-wise ones). The two need not time alike: in the MBS-64 step
both GEMMs ran faster than alone on random operands, cuBLAS's by more (benchmarks/NOTES.md, "The epilogue trials, and
torchao's fast accumulation weighed"), which would fit a card held at its power limit by random bits. `--clock`
records the SM clock and board power nvidia-smi reports while each GEMM runs back to back.

The `-bs64` and `-bscol` configurations are the kernel with block scales at the promotion (a one-pass fold's GEMM,
`block_scaled`): checked against the row-scaled kernel's bits and a float64 product, timed beside cuBLAS's 1x128 GEMM.

Needs nvidia-cutlass-dsl (`pip install nvidia-cutlass-dsl`, with the `cu13` extra for CUDA 13).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# tile (M, N), cluster (M, N), the most tile-column clusters to a band of the tile order (1: no bands, each
# tile column walked down M in turn) and how K is summed (`gemm_cute.ACCUMULATION`: fast, or fp32 with each
# k-tile's partial sums promoted) of each configuration tried (the kernel takes tile M 64 or 128, tile N 64,
# 128, 160, 192 or 256, at most 4 CTAs to a cluster; the probe runs it on whole tile clusters only)
CONFIGS = {"128x256-2x1": ((128, 256), (2, 1), 1, "fast"), "128x256-2x1-s4": ((128, 256), (2, 1), 4, "fast"),
           "128x256-2x1-s8": ((128, 256), (2, 1), 8, "fast"), "128x256-1x2-s4": ((128, 256), (1, 2), 4, "fast"),
           "128x256-1x1": ((128, 256), (1, 1), 1, "fast"), "128x128-2x1": ((128, 128), (2, 1), 1, "fast"),
           "128x128-1x2": ((128, 128), (1, 2), 1, "fast"),
           "128x192-2x1-s8-fp32": ((128, 192), (2, 1), 8, "fp32"),
           # cuBLAS's tile for the promoted K = 3072 dgrad GEMMs with a wide N (2026-12-07 ncu: 128x160, 2x1)
           "128x160-2x1-s8-fp32": ((128, 160), (2, 1), 8, "fp32"),
           "128x192-2x1-s4-fp32": ((128, 192), (2, 1), 4, "fp32"),
           "128x192-2x1-s8-fp32k2": ((128, 192), (2, 1), 8, "fp32k2"),
           # promoted in 2, 3 or 4 parts of N, a part's adds under the later parts' WGMMAs (`promotion_parts`)
           "128x192-2x1-s8-fp32h": ((128, 192), (2, 1), 8, "fp32h"),
           "128x192-2x1-s8-fp32p3": ((128, 192), (2, 1), 8, "fp32p3"),
           "128x192-2x1-s8-fp32p4": ((128, 192), (2, 1), 8, "fp32p4"),
           "128x192-2x1-s8": ((128, 192), (2, 1), 8, "fast"),
           # block scales per k-tile at the promotion (`gemm_cute.BLOCK_SCALES`: a one-pass fold's GEMM): B's per 64
           # output columns, or per column (as wgrad's Xᵀ would need); checked against the row-scaled kernel's bits
           # with k-tile-constant scales and against float64 with random ones (`block_scaled`)
           "128x192-2x1-s8-fp32-bs64": ((128, 192), (2, 1), 8, "fp32-bs64"),
           "128x192-2x1-s8-fp32-bscol": ((128, 192), (2, 1), 8, "fp32-bscol"),
           # the promoted kernel with A multicast across a 1x2 cluster instead of B. (Promoted 128x128 tiles, one
           # consumer warp group, need 2 x 128 accumulator registers a thread: ptxas spills 348 bytes; not tried.)
           "128x192-1x2-s8-fp32": ((128, 192), (1, 2), 8, "fp32")}
SM90_SMS = 132  # an H100 SXM's SMs: the persistent grid's size where no device is there to ask


def whole_clusters(m: int, n: int, config: str) -> bool:
    """Whether `config`'s tile clusters cover C [m, n] whole: what the step asks of a GEMM before it gives it
    to the kernel (`gemm_cute`); the kernel's epilogue reads the scales at every coordinate of its tiles."""
    (tile_m, tile_n), (cluster_m, cluster_n) = CONFIGS[config][:2]
    return m % (tile_m * cluster_m) == 0 and n % (tile_n * cluster_n) == 0


def _problems(tokens: list[int]):
    """(linear, kind, M, N, K, has_bias, fp32 output) of each Flux linear's three GEMMs at each token count:
    bench_kernels' problems, the GEMMs an MX linear runs."""
    import torch
    from bench_kernels import GEMM_KINDS, LINEARS, gemm_problem  # LINEARS: (name, K, N)

    out = []
    for m_tokens in tokens:
        for name, k, n in LINEARS:
            for kind in GEMM_KINDS:
                rows_a, rows_b, contraction, bias, out_dtype = gemm_problem(kind, m_tokens, k, n)
                out.append((name, kind, rows_a, rows_b, contraction, bias, out_dtype == torch.float32))
    return out


def configs_and_tokens(ap, args, known) -> tuple[list[str], list[int]]:
    """The probe's `--configs` (each one of `known`) and `--m` (positive token counts), comma-separated; a bad
    value is the parser's one-line error (exit 2)."""
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in known]
    if bad:
        ap.error(f"unknown configuration: {', '.join(bad)}")
    try:
        tokens = [int(t) for t in args.m.split(",") if t]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        ap.error(f"--m: expected positive whole numbers of tokens, comma-separated; got {args.m!r}")
    return configs, tokens


def packed_operands(m: int, k: int, n: int, gen):
    """A [M, K] and B [N, K] as the step makes them: a Gaussian activation and a weight of std 0.02, bf16, each
    packed by the MX packer into its row operand (E4M3, a power-of-two scale per row); and the same two tensors
    cast as torchao's tensor-wise recipe casts them (`tensorwise_cast`). ((a, b, a_scale [M, 1], b_scale [1, N]),
    (a, b, a_scale, b_scale) tensor-wise, bias [N] bf16)."""
    import torch

    from mxflux.kernels import mx_operands_cuda

    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16()
    px, pw = mx_operands_cuda(x, col=False), mx_operands_cuda(w, col=False)
    (xt, sx), (wt, sw) = tensorwise_cast(x), tensorwise_cast(w)
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    return ((px.row_data, pw.row_data, px.row_scale, pw.row_scale.reshape(1, -1)), (xt, wt, sx, sw), bias)


def tensorwise_cast(t):
    """`t` in E4M3 as torchao's tensor-wise recipe casts it (its amax mapped to E4M3's largest value, 448) and the
    0-d fp32 scale `torch._scaled_mm` multiplies back."""
    import torch

    scale = torch.finfo(torch.float8_e4m3fn).max / t.float().abs().amax().clamp_min(1e-12)
    return (t.float() * scale).to(torch.float8_e4m3fn), scale.reciprocal()


def clock_summary(text: str, skip: float = 1 / 3) -> dict:
    """The median SM clock (MHz) and board power (W) of nvidia-smi's `clocks.sm,power.draw` samples (csv,
    noheader, nounits: one "MHz, W" line each), the first `skip` of them dropped (the load and the clock
    still settling when sampling starts)."""
    samples = []
    for line in text.splitlines():
        try:
            clock, power = (float(v) for v in line.split(","))
        except ValueError:  # "[N/A]" or a partial line at the end
            continue
        samples.append((clock, power))
    kept = samples[int(len(samples) * skip):]
    if not kept:
        return {"sm_clock_mhz": None, "power_w": None, "samples": 0}
    return {"sm_clock_mhz": statistics.median(c for c, _ in kept), "power_w": statistics.median(p for _, p in kept),
            "samples": len(kept)}


def clock_while(fn, seconds: float = 0.5) -> dict:
    """`clock_summary` of nvidia-smi sampling every 20 ms while `fn` runs back to back for `seconds`."""
    import torch

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid).removeprefix("GPU-")
    smi = subprocess.Popen(["nvidia-smi", f"--id=GPU-{uuid}", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(8):
                fn()
            torch.cuda.synchronize()
    finally:
        smi.terminate()
        out = smi.communicate(timeout=10)[0]
    return clock_summary(out)


def _block_columns(config: str) -> int | None:
    """The output columns one B scale covers in a block-scaled configuration; None for a row-scaled one."""
    from mxflux.kernels.gemm_cute import BLOCK_SCALES

    return BLOCK_SCALES.get(CONFIGS[config][3])


def block_scaled(config: str, a, b, bias, out_dtype, gen, checked_rows: int = 4096) -> tuple[dict, object]:
    """A block-scaled configuration on A [M, K] and B [N, K]: (its checks, a call to time). Two checks: with each
    row's and group's scale the same in every k-tile, the output must equal the row-scaled kernel's (fp32, same
    tile) bit for bit (a power of two commutes with fp32 rounding: applied at each promotion or once in the
    epilogue, the same bits); with random power-of-two scales per k-tile, the first `checked_rows` rows must lie
    within the fp32 summation bound of the float64 product. cuBLAS's 1x128 block-scaled GEMM (what `mx_gemm:
    blockwise` runs, B's scales per column) is timed on the same bytes and scales where the column groups are 1."""
    import torch

    from mxflux.kernels.gemm_cute import prepared_gemm

    tile, cluster, most, accumulation = CONFIGS[config]
    (m, k), n, group = a.shape, b.shape[0], _block_columns(config)
    k_tiles = k // 128

    def powers(*shape):
        return torch.exp2(torch.randint(-6, 6, shape, device=a.device, generator=gen).float())

    sa, sb = powers(m, 1), powers(n // group, 1)
    out = torch.full((m, n), float("nan"), device=a.device, dtype=out_dtype)
    prepared_gemm(a, sa.expand(m, k_tiles), b, sb.expand(n // group, k_tiles), bias, out, (tile, cluster), most,
                  accumulation)()
    rowwise = torch.full_like(out, float("nan"))
    prepared_gemm(a, sa, b, sb.repeat_interleave(group, 0), bias, rowwise, (tile, cluster), most, "fp32")()
    same = torch.isnan(out) == torch.isnan(rowwise)
    bit_equal = bool(same.all() and (out[~torch.isnan(out)] == rowwise[~torch.isnan(out)]).all())

    sa, sb = powers(m, k_tiles), powers(n // group, k_tiles)
    out.fill_(float("nan"))
    call = prepared_gemm(a, sa, b, sb, bias, out, (tile, cluster), most, accumulation)
    call()
    rows = min(m, checked_rows)
    a64 = a[:rows].double() * sa[:rows].repeat_interleave(128, 1).double()
    b64 = b.double() * sb.repeat_interleave(group, 0).repeat_interleave(128, 1).double()
    want = a64 @ b64.t() + (bias.double() if bias is not None else 0)
    bound = 2 * k * 2.0**-24 * (a64.abs() @ b64.abs().t()) + torch.finfo(out_dtype).eps * want.abs()
    diff = (out[:rows].double() - want).abs()
    checks = dict(bit_equal_to_row_scaled=bit_equal, within_bound=bool((diff <= bound).all()),
                  worst_over_bound=float((diff / bound.clamp_min(1e-300)).max()))
    if group == 1:
        from mxflux.kernels.gemm import scaled_gemm_cuda
        from mxflux.mx.granularity import FoldGranularity

        checks["cublas_blockwise"] = lambda: scaled_gemm_cuda(a, sa, b, sb, FoldGranularity.BLOCKWISE, bias,
                                                              out_dtype)
    return checks, call


def _kernel(config: str, n: int):
    """The configuration's kernel for N output columns (the band no wider than divides them)."""
    from mxflux.kernels.gemm_cute import kernel_for

    tile, cluster, most, accumulation = CONFIGS[config]
    return kernel_for(n, (tile, cluster), most, accumulation)


def compile_only(configs: list[str]) -> list[dict]:
    """Build each configuration for sm_90a from fake tensors (no GPU): bf16 out with and without the bias
    (fprop, dgrad), fp32 out without (wgrad)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m, n, k = 32768, 3072, 12288
    rows = []
    for config in configs:
        group = _block_columns(config)
        for has_bias, fp32_out in ((True, False), (False, False), (False, True)):
            fake = dict(
                a=make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, k, 1), stride_order=(1, 0, 2), assumed_align=16),
                b=make_fake_compact_tensor(cutlass.Float8E4M3FN, (n, k, 1), stride_order=(1, 0, 2), assumed_align=16),
                c=make_fake_compact_tensor(cutlass.Float32 if fp32_out else cutlass.BFloat16, (m, n, 1),
                                           stride_order=(1, 0, 2), assumed_align=16),
                sa=(make_fake_compact_tensor(cutlass.Float32, (m, k // 128), stride_order=(1, 0), assumed_align=16)
                    if group else make_fake_compact_tensor(cutlass.Float32, (m,), assumed_align=16)),
                sb=(make_fake_compact_tensor(cutlass.Float32, (n // group, k // 128), stride_order=(1, 0),
                                             assumed_align=16)
                    if group else make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)),
                bias=make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16))
            cluster = CONFIGS[config][1]
            t = time.perf_counter()
            cute.compile(_kernel(config, n), *fake.values(), has_bias, SM90_SMS // (cluster[0] * cluster[1]),
                         make_fake_stream())
            rows.append(dict(config=config, bias=has_bias, fp32_out=fp32_out, compiled=True,
                             compile_s=round(time.perf_counter() - t, 2)))
            print(f"{config:12s} bias={has_bias!s:5s} fp32 out={fp32_out!s:5s} compiled in {rows[-1]['compile_s']} s",
                  flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--m", default="32768", help="tokens (the GEMMs' M), comma-separated, e.g. 4096,16384,32768")
    ap.add_argument("--compile-only", action="store_true", help="build for sm_90a from fake tensors; no GPU needed")
    ap.add_argument("--operands", choices=("random", "packed"), default="random",
                    help="random E4M3 bytes and scales (default), or Gaussian tensors packed as the step packs them")
    ap.add_argument("--clock", action="store_true", help="record the SM clock and power while each GEMM runs")
    ap.add_argument("--json")
    args = ap.parse_args()
    configs, tokens = configs_and_tokens(ap, args, CONFIGS)
    if args.compile_only:  # the DSL reads its target when it is imported
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    try:
        import cutlass  # noqa: F401
    except ImportError:
        print("probe_cute_rowwise_gemm: needs nvidia-cutlass-dsl (CuTe DSL; pip install nvidia-cutlass-dsl)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, run from anywhere
    if args.compile_only:
        rows = compile_only(configs)
    else:
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
            print("probe_cute_rowwise_gemm: needs a CUDA device of sm_90 (--compile-only builds without one)",
                  file=sys.stderr)
            return 2
        import triton.testing

        from probe_scaled_mm_autotune import _operands, _within_contract

        from mxflux.kernels.gemm_cute import prepared_gemm

        def bench(fn) -> float:
            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

        gen = torch.Generator(device="cuda").manual_seed(0)
        rows = []
        for name, kind, m, n, k, has_bias, fp32_out in _problems(tokens):
            if args.operands == "packed":
                (a, b, sa, sb), (ta, tb, tsa, tsb), bias = packed_operands(m, k, n, gen)
            else:  # the tensor-wise GEMMs on the same bytes, unit scales
                a, b, sa, sb, bias = _operands(m, k, n, gen)
                ta, tb, tsa, tsb = a, b, torch.ones((), device="cuda"), torch.ones((), device="cuda")
            bias = bias if has_bias else None
            out_dtype = torch.float32 if fp32_out else torch.bfloat16
            rowwise = lambda: torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype)  # noqa: E731
            tensorwise = lambda: torch._scaled_mm(ta, tb.t(), tsa, tsb, bias=bias, out_dtype=out_dtype)  # noqa: E731
            # torchao's FP8 recipe runs its forward GEMMs so (fast accumulation, outside our contract): the
            # kernel the step's FP8 fprop gets, beside which the promoted kernel's fprop is measured
            tensorwise_fast = lambda: torch._scaled_mm(ta, tb.t(), tsa, tsb, bias=bias,  # noqa: E731
                                                       out_dtype=out_dtype, use_fast_accum=True)
            want = rowwise()
            row = dict(linear=name, kind=kind, m=m, n=n, k=k, bias=has_bias, cublas_rowwise_ms=bench(rowwise),
                       cublas_tensorwise_ms=bench(tensorwise), cublas_tensorwise_fast_ms=bench(tensorwise_fast))
            if args.clock:
                row["clock"] = {"cublas_rowwise": clock_while(rowwise), "cublas_tensorwise": clock_while(tensorwise),
                                "cublas_tensorwise_fast": clock_while(tensorwise_fast)}
            for config in configs:
                tile, cluster, most, accumulation = CONFIGS[config]
                if not whole_clusters(m, n, config):
                    row[config] = dict(skipped="M or N not in whole tile clusters (the step gives it to cuBLAS)")
                    continue
                if _block_columns(config):
                    try:
                        checks, call = block_scaled(config, a, b, bias, out_dtype, gen)
                    except Exception as e:  # a configuration the DSL or the device refuses: say so, go on
                        row[config] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                        continue
                    cublas_blockwise = checks.pop("cublas_blockwise", None)
                    ms = bench(call)
                    # (within_contract and bit_equal: the row-scaled configurations' keys, for the sums below)
                    row[config] = dict(ms=ms, **checks, within_contract=checks["within_bound"],
                                       bit_equal=float(checks["bit_equal_to_row_scaled"]),
                                       vs_cublas_rowwise=row["cublas_rowwise_ms"] / ms,
                                       vs_cublas_tensorwise=row["cublas_tensorwise_ms"] / ms)
                    if cublas_blockwise is not None:
                        row[config]["cublas_blockwise_ms"] = bench(cublas_blockwise)
                    continue
                out = torch.full_like(want, float("nan"))  # every element must be written
                try:
                    call = prepared_gemm(a, sa, b, sb, bias, out, (tile, cluster), most,  # sb [1, N]: read flat
                                         accumulation)
                    call()
                    torch.cuda.synchronize()
                except Exception as e:  # a configuration the DSL or the device refuses: say so, go on
                    row[config] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                ok, equal, worst = _within_contract(out, want, a, b, sa, sb)
                ms = bench(call)
                row[config] = dict(ms=ms, within_contract=ok, bit_equal=equal, worst_over_bound=worst,
                                   vs_cublas_rowwise=row["cublas_rowwise_ms"] / ms,
                                   vs_cublas_tensorwise=row["cublas_tensorwise_ms"] / ms)
                if args.clock:
                    row[config]["clock"] = clock_while(call)
            rows.append(row)
            best = max((c for c in configs if "ms" in row.get(c, {})), key=lambda c: row[c]["vs_cublas_rowwise"],
                       default=None)
            print(f"{name:8s} {kind:6s} M={m} N={n} K={k}: cuBLAS row {row['cublas_rowwise_ms']:.3f} ms, "
                  f"tensor-wise {row['cublas_tensorwise_ms']:.3f} ms; " +
                  (f"best {best} {row[best]['ms']:.3f} ms ({row[best]['vs_cublas_rowwise']:.2f}x row, "
                   f"within the fp32 bound {row[best]['within_contract']})" if best else "no configuration ran") +
                  (f"; SM MHz row {row['clock']['cublas_rowwise']['sm_clock_mhz']}, tensor-wise "
                   f"{row['clock']['cublas_tensorwise']['sm_clock_mhz']}, fast "
                   f"{row['clock']['cublas_tensorwise_fast']['sm_clock_mhz']}" +
                   (f", best {row[best]['clock']['sm_clock_mhz']}" if best else "") if args.clock else ""), flush=True)
    if not args.compile_only:  # per kind, the sums over the Flux linears: what a step would see
        for m_tokens, kind in ((t, k) for t in tokens for k in ("fprop", "dgrad", "wgrad")):
            these = [r for r in rows if r["kind"] == kind and r["m" if kind != "wgrad" else "k"] == m_tokens]
            line = (f"{kind} at {m_tokens} tokens: cuBLAS row-scaled {sum(r['cublas_rowwise_ms'] for r in these):.2f} "
                    f"ms, tensor-wise {sum(r['cublas_tensorwise_ms'] for r in these):.2f}, tensor-wise fast "
                    f"{sum(r['cublas_tensorwise_fast_ms'] for r in these):.2f}")
            for config in configs:
                if all("ms" in r.get(config, {}) for r in these):
                    ok = all(r[config]["within_contract"] for r in these)
                    equal = min(r[config]["bit_equal"] for r in these)  # fp32 accumulation: cuBLAS's bits
                    line += (f"; {config} {sum(r[config]['ms'] for r in these):.2f} (fp32 bound "
                             f"{'kept' if ok else 'BROKEN'}, " +
                             (f"the row-scaled kernel's bits with k-tile-constant scales: {equal == 1.0}"
                              if _block_columns(config) else f"bit-equal to cuBLAS's >= {equal:.4f}") + ")")
                    if all("cublas_blockwise_ms" in r[config] for r in these):
                        line += f"; cuBLAS 1x128 {sum(r[config]['cublas_blockwise_ms'] for r in these):.2f}"
            print(line, flush=True)
    if args.json:
        write_json(args.json, args.operands, {c: CONFIGS[c] for c in configs}, rows)
    return 0


def write_json(path: str, operands: str, configs: dict, rows: list[dict]) -> None:
    """A probe's result file: its provenance (commit, card, versions, command), the operands' kind, the
    configurations tried and the rows."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from mxflux.bench.provenance import provenance

    with open(path, "w") as f:
        json.dump({"provenance": provenance(), "operands": operands, "configs": configs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
