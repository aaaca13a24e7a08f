"""Host time per MX op call: where a host-bound step (Flux-12B at small micro-batches) goes.

    PYTHONPATH=src python3 benchmarks/bench_host.py [--calls 2000] [--rows 256] [--json out.json]

Every op is called in a loop on a small operand (256 x 3072 by default, so the device work per
call is a few microseconds and the host is the limit), and the wall time per call is reported:

- `mx_operands` op (packer + dispatch), `mx_operands_cuda` called directly (launches after a
  plan's first go straight to the compiled kernels), the same on Triton's normal launch path
  (MXFLUX_COMPILED_LAUNCH=0), and `mx_operands_cuda` with its Triton launches stubbed out: op
  dispatch, our Python, and the launches, each by difference;
- `scaled_gemm` op against `torch._scaled_mm` called directly, and where CuTe DSL is installed the op on the
  CuTe-DSL GEMM, that GEMM called directly and its compiled call alone;
- one packer call compiled alone, through the opaque op and launched from inductor's code
  (`mxflux::mx_operands_inline`, inductor's static launch of user kernels on:
  `mxflux.ops.static_kernel_launch()`), with the driver launches per call;
- a calibration: one tiny elementwise op (the host's cost of any launch).

On a machine without CUDA it measures what it can: the op dispatch around a stubbed packer, and
with Triton under its interpreter (TRITON_INTERPRET=1) `mx_operands_cuda`'s own Python with the
launches stubbed, with its launch plans cached (as in training) and rebuilt on every call.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mxflux.bench.provenance import provenance


def per_call_us(fn, calls: int, sync) -> float:
    """Median over 5 rounds of the wall time per call (the device synchronised per round)."""
    for _ in range(min(50, calls)):
        fn()
    sync()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        sync()
        rounds.append((time.perf_counter() - t) / (calls // 5) * 1e6)
    return sorted(rounds)[2]


class _NoLaunch:
    """Stands in for the packer's Triton JITFunction: `kernel[grid](...)` launches nothing and
    returns a compiled kernel whose launcher does nothing, so that calls after a plan's first take
    the compiled-launch path, as on the GPU."""

    def __init__(self, real):
        self.arg_names = list(real.arg_names)
        self.warmup = real.warmup  # plans compile (never launch) each pass first to read its layout

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoCompiled(self.arg_names, args, kwargs)


class _NoCompiled:
    def __init__(self, names, args, kwargs):
        from types import SimpleNamespace

        values = list(args) + [kwargs[n] for n in names[len(args):]]
        self.src = SimpleNamespace(
            fn=SimpleNamespace(arg_names=names), constants={(i,): values[i] for i in range(len(args), len(names))},
            signature={n: "*i8" if isinstance(v, torch.Tensor) else "constexpr" if i >= len(args) else "i32"
                       for i, (n, v) in enumerate(zip(names, values))})
        self.function, self.packed_metadata = 1, (8, 1, 0)
        self.run = lambda *a: None


def _compiled_pack(custom_ops, x, outside, inline: bool, calls: int, sync, code_dir=None) -> dict[str, float]:
    """One packer call (row-wise, both orientations) compiled alone, through the opaque op or
    launched from inductor's code (`INLINE_PACK`; inductor's static launch of user kernels on, as
    the trainer sets it): wall per call and the driver launches per call (torch.profiler); with
    `code_dir`, inductor's generated code is written there."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    default, custom_ops.INLINE_PACK = custom_ops.INLINE_PACK, inline
    custom_ops.static_kernel_launch()
    try:
        def pack(t, c):
            return custom_ops.mx_operands(t, None, c, True, True, "rowwise", True, "none", False)

        fn = torch.compile(pack)
        _, code = run_and_get_code(fn, x, outside)
        label = f"compiled packer call, {'inline' if inline else 'opaque op'}"
        if code_dir:
            with open(os.path.join(code_dir, f"packer_{'inline' if inline else 'opaque'}.py"), "w") as f:
                f.write("\n\n".join(code))
        result = {label: per_call_us(lambda: fn(x, outside), calls, sync)}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                fn(x, outside)
            sync()
        launches = sum(e.count for e in prof.key_averages() if e.key in ("cuLaunchKernel", "cudaLaunchKernel",
                                                                         "cuLaunchKernelEx", "cudaLaunchKernelExC"))
        result[f"{label}: launches per call"] = launches / 20
        return result
    finally:
        custom_ops.INLINE_PACK = default


def measure(device: str, rows: int, cols: int, calls: int, code_dir=None) -> dict[str, float]:
    from mxflux.ops import custom_ops
    from mxflux.ops.custom_ops import mx_operands, scaled_gemm

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn(rows, cols, device=device).bfloat16()
    outside = torch.zeros(1, dtype=torch.int64, device=device)
    op_args = (x, None, outside, True, True, "rowwise", True, "none", False)
    out = {"elementwise op (calibration)": per_call_us(lambda: x.add_(0), calls, sync)}
    if cuda:
        from mxflux.kernels import mx_operands_cuda
        from mxflux.kernels import operands_cuda as operands_module

        out["mx_operands op"] = per_call_us(lambda: mx_operands(*op_args), calls, sync)
        out["mx_operands_cuda direct"] = per_call_us(lambda: mx_operands_cuda(x), calls, sync)
        os.environ["MXFLUX_COMPILED_LAUNCH"] = "0"
        operands_module.clear_launch_plans()
        try:
            out["mx_operands_cuda direct, Triton launch path"] = per_call_us(lambda: mx_operands_cuda(x), calls, sync)
        finally:
            del os.environ["MXFLUX_COMPILED_LAUNCH"]
            operands_module.clear_launch_plans()
        out.update(_stubbed(operands_module, x, op_args, calls, sync))
        for inline in (False, True):
            out.update(_compiled_pack(custom_ops, x, outside, inline, calls, sync, code_dir))
        p = mx_operands_cuda(x, col=False)
        w = mx_operands_cuda(torch.randn(cols, cols, device=device).bfloat16(), col=False)
        out["scaled_gemm op"] = per_call_us(
            lambda: scaled_gemm(p.row_data, p.row_scale, w.row_data, w.row_scale, "rowwise", None, torch.bfloat16),
            calls, sync)
        out["torch._scaled_mm direct"] = per_call_us(
            lambda: torch._scaled_mm(p.row_data, w.row_data.t(), p.row_scale, w.row_scale.t(),
                                     out_dtype=torch.bfloat16, use_fast_accum=False), calls, sync)
        out.update(_cute_gemm(p, w, calls, sync))
    else:  # the op dispatch around a packer that returns at once
        packed = custom_ops.mx_operands_cpu(x, row=True, col=True, hadamard=True, prologue="none", aux=None,
                                            colsum=False)
        real = custom_ops.mx_operands_cpu
        custom_ops.mx_operands_cpu = lambda *a, **k: packed
        try:
            out["mx_operands op, packer stubbed"] = per_call_us(lambda: mx_operands(*op_args), calls, sync)
        finally:
            custom_ops.mx_operands_cpu = real
        from mxflux.kernels import cuda_kernel_available

        if cuda_kernel_available():  # Triton's interpreter: our Python around stubbed launches
            from mxflux.kernels import operands_cuda as operands_module

            out.update(_stubbed(operands_module, x, op_args, calls, sync, op=False))
    return out


def _cute_gemm(p, w, calls, sync) -> dict[str, float]:
    """The CuTe-DSL GEMM's host time per call, peeled: through the `scaled_gemm` op (taking every GEMM), called
    directly (`cute_scaled_gemm`: the output allocated, the call prepared and made), and in each calling
    convention (`gemm_cute.prepared_gemm`: the DSL's own, which wraps the six tensors first, and TVM-FFI's,
    where apache-tvm-ffi is installed) the preparing alone and the call alone on a prepared call; with a check
    that both conventions write the same bits. Empty where CuTe DSL or a Hopper GPU is missing."""
    from mxflux.kernels import gemm_cute
    from mxflux.ops.custom_ops import scaled_gemm

    if not gemm_cute.available() or p.row_data.shape[0] % 256 or w.row_data.shape[0] % 192:
        return {}
    chosen = gemm_cute.CUTE_GEMM
    gemm_cute.CUTE_GEMM = gemm_cute.cute_gemm_choice("all")
    try:
        args = (p.row_data, p.row_scale, w.row_data, w.row_scale)
        rows = {"scaled_gemm op, CuTe GEMM": per_call_us(
                    lambda: scaled_gemm(*args, "rowwise", None, torch.bfloat16), calls, sync),
                "cute_scaled_gemm direct": per_call_us(
                    lambda: gemm_cute.cute_scaled_gemm(*args, None, torch.bfloat16), calls, sync)}
        outs = {}
        for name, tvm_ffi in (("DSL", False), ("TVM-FFI", True)):
            if tvm_ffi and not gemm_cute.tvm_ffi_present():
                continue
            out = outs[name] = torch.full((p.row_data.shape[0], w.row_data.shape[0]), float("nan"),
                                          dtype=torch.bfloat16, device="cuda")
            call = gemm_cute.prepared_gemm(*args, None, out, tvm_ffi=tvm_ffi)
            call()
            rows[f"CuTe GEMM ({name} convention), call prepared, no call"] = per_call_us(
                lambda: gemm_cute.prepared_gemm(*args, None, out, tvm_ffi=tvm_ffi), calls, sync)
            rows[f"CuTe GEMM ({name} convention), prepared call alone"] = per_call_us(call, calls, sync)
        if len(outs) == 2:
            sync()
            rows["CuTe GEMM, TVM-FFI output equal to the DSL's (1 = yes)"] = float(torch.equal(*outs.values()))
    finally:
        gemm_cute.CUTE_GEMM = chosen
    return rows


def _stubbed(operands_module, x, op_args, calls, sync, op=True) -> dict[str, float]:
    """`mx_operands_cuda` (and the op) with the Triton launches stubbed out. Plans built while the
    stub is in place never get compiled launchers, and are dropped afterwards."""
    from mxflux.kernels import mx_operands_cuda
    from mxflux.ops.custom_ops import mx_operands

    out = {}
    from mxflux.kernels import triton_common

    real = (operands_module._pack_kernel, operands_module.compiled_launch, operands_module._compiled_launch_device)
    if torch.cuda.is_available():
        env = dict(get_stream=triton_common.triton.runtime.driver.active.get_current_stream,
                   hooks=triton_common.triton.knobs.runtime, current_device=torch.cuda.current_device)
    else:  # the interpreter: pretend to be device 0
        env = dict(get_stream=lambda dev: 0, hooks=type("Hooks", (), {"launch_enter_hook": None,
                                                                      "launch_exit_hook": None}),
                   current_device=lambda: 0)
        operands_module._compiled_launch_device = lambda plan: 0
    operands_module._pack_kernel = _NoLaunch(real[0])
    operands_module.compiled_launch = lambda *a: triton_common.compiled_launch(*a, _env=env)
    operands_module.clear_launch_plans()
    try:
        out["mx_operands_cuda, launches stubbed"] = per_call_us(lambda: mx_operands_cuda(x), calls, sync)

        def uncached():
            operands_module.clear_launch_plans()
            mx_operands_cuda(x)

        out["mx_operands_cuda, launches stubbed, no plan cache"] = per_call_us(uncached, calls, sync)
        if op:
            out["mx_operands op, launches stubbed"] = per_call_us(lambda: mx_operands(*op_args), calls, sync)
    finally:
        operands_module._pack_kernel, operands_module.compiled_launch, operands_module._compiled_launch_device = real
        operands_module.clear_launch_plans()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the results as JSON")
    ap.add_argument("--code-dir", help="write inductor's code of the compiled packer calls there (CUDA)")
    args = ap.parse_args(argv)
    res = measure(args.device, args.rows, args.cols, args.calls, args.code_dir)
    print(f"host time per call, {args.device}, operand {args.rows}x{args.cols}:")
    for name, us in res.items():
        print(f"  {name:50s} {us:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "device": args.device, "rows": args.rows, "cols": args.cols, "us_per_call": res}, f, indent=1)


if __name__ == "__main__":
    main()
