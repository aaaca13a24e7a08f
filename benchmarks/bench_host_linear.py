"""Host time of one linear's forward + backward, compiled, next to nn.Linear's and torchao FP8's.

    PYTHONPATH=src python3 benchmarks/bench_host_linear.py [--tokens 256] [--features 3072] [--json out.json]

Each layer (in_features = out_features = --features) runs forward and backward in a loop on
--tokens rows, so small that the device finishes each kernel long before the host has issued the
next: the wall time per iteration is then the host's cost of issuing the layer's work. Every
layer is compiled with torch.compile as a block of the model is (fp32 master weights, bf16
autocast), and timed two ways:

- `default`: inductor's generated code issues every kernel from Python on each call (what an
  FSDP2/DDP run or any run without CUDA graphs pays);
- `reduce-overhead`: the compiled forward and backward replayed as CUDA graphs (cudagraph trees),
  one launch each.

Layers: nn.Linear (bf16), torchao's Float8Linear (tensorwise, the FP8 users train with),
MXFP6Linear with its GEMMs traced into the graph as `aten._scaled_mm` and its packers as inductor's
own launches of the packer kernel (`mxflux::mx_operands_inline`, opt-in: `INLINE_PACK`), MXFP6Linear
with the packers through the opaque `mxflux::mx_operands` op (the default), the same with its
weight's operands kept by an `MXWeightState` (the trainer's path: its AdamW step writes them, so no
forward packs a weight; here they are computed once, the weight never changing), and with the GEMMs
through the opaque `mxflux::scaled_gemm` op as well (`INLINE_GEMM` off too). Inductor's
static launch of user kernels is on, as the trainer sets it (`mxflux.ops.static_kernel_launch()`).
The table prints microseconds per iteration and the ratio to nn.Linear's in the same mode. A GPU benchmark (the CPU has no FP8 GEMM path to
compare).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mxflux.bench.provenance import provenance


def per_iteration_us(step, iters: int, graphs: bool) -> float:
    """Median over 5 rounds of the wall time per iteration (synchronised per round)."""
    def run(n):
        for _ in range(n):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            step()

    run(20)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        run(iters)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / iters * 1e6)
    return sorted(rounds)[2]


def build(kind: str, features: int) -> torch.nn.Module:
    lin = torch.nn.Linear(features, features, device="cuda")
    if kind == "bf16":
        return lin
    if kind == "fp8-tensorwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        wrapper = torch.nn.Sequential(lin)
        convert_to_float8_training(wrapper, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        return wrapper
    from mxflux.nn import MXFP6Linear
    from mxflux.nn.weight_state import MXWeightState

    layer = MXFP6Linear.from_linear(lin)
    if kind == "mxfp6-kept":  # the operands are attached to the layer, which the state writes them into
        MXWeightState.of_model(layer, keep_operands=True)
    return layer


def measure(tokens: int, features: int, iters: int) -> dict:
    from mxflux.ops import custom_ops

    defaults = custom_ops.INLINE_PACK, custom_ops.INLINE_GEMM
    custom_ops.static_kernel_launch()
    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
    out = {}
    for label, kind, inline_pack, inline_gemm in (
            ("nn.Linear bf16", "bf16", True, True), ("torchao fp8 tensorwise", "fp8-tensorwise", True, True),
            ("MXFP6Linear, packers inline", "mxfp6", True, True),
            ("MXFP6Linear, opaque packer op (default)", "mxfp6", False, True),
            ("MXFP6Linear, packer op, weight's operands kept", "mxfp6-kept", False, True),
            ("MXFP6Linear, opaque packer and GEMM ops", "mxfp6", False, False)):
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            custom_ops.INLINE_PACK, custom_ops.INLINE_GEMM = inline_pack, inline_gemm
            layer = build(kind, features)
            compiled = torch.compile(layer, mode=mode)
            # gradients allocated outside the graphs: each backward adds into them, as in training
            # with accumulation (a replay's own output kept as .grad would be overwritten)
            for t in (x, *layer.parameters()):
                t.grad = torch.zeros_like(t)

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = compiled(x)
                y.backward(g)

            out[f"{label} | {mode}"] = per_iteration_us(step, iters, mode == "reduce-overhead")
            print(f"  {label:40s} {mode:16s} {out[f'{label} | {mode}']:9.1f} us", flush=True)
    custom_ops.INLINE_PACK, custom_ops.INLINE_GEMM = defaults
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--features", type=int, default=3072)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", help="write the results as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_linear.py: needs a CUDA device (FP8 GEMMs)")
    print(f"host time per linear forward + backward, {args.tokens} x {args.features}, "
          f"{torch.cuda.get_device_name()}:", flush=True)
    res = measure(args.tokens, args.features, args.iters)
    print(f"{'layer':42s} {'default µs':>11s} {'vs bf16':>8s} {'graphs µs':>10s} {'vs bf16':>8s}")
    base = {m: res[f"nn.Linear bf16 | {m}"] for m in ("default", "reduce-overhead")}
    for label in dict.fromkeys(k.split(" | ")[0] for k in res):
        d, r = res[f"{label} | default"], res[f"{label} | reduce-overhead"]
        print(f"{label:42s} {d:11.1f} {d / base['default']:7.2f}x {r:10.1f} {r / base['reduce-overhead']:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "device": torch.cuda.get_device_name(), "tokens": args.tokens, "features": args.features,
                       "us_per_fwd_bwd": res}, f, indent=1)


if __name__ == "__main__":
    main()
