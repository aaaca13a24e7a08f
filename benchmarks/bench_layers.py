"""Layer-level benchmarks on the GPU: MXFP6Linear / FusedMXFP6MLP / torchao FP8 against bf16 and a peer.

Every ratio is measured side by side in one run (these machines are noisy; absolute times only
mean something on the GPU). Times are forward+backward medians from triton.testing.do_bench.

    PYTHONPATH=src python benchmarks/bench_layers.py [--m 16384 32768] [--quick] [--json OUT.json]
    PYTHONPATH=src python benchmarks/bench_layers.py --profile proj 16384 --profile proj 32768

Also measures, on a real Flux training step (one double + one single block at width 3072,
zero-init broken), the fraction of MX blocks outside the FP8 fold window for every operand of
every MX GEMM, row-wise and per 128 — the evidence behind the default `mx_gemm`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from mxflux.bench.provenance import provenance
from mxflux.mx import MX_BLOCK, FoldGranularity, fold_to_e4m3, quantize
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear
from mxflux.nn.precision.fp8 import float8_linear_config

# Flux-12B linear shapes: name → (K, N).
FLUX_LINEARS = {
    "qkv": (3072, 9216),
    "proj": (3072, 3072),
    "mlp.fc1": (3072, 12288),
    "mlp.fc2": (12288, 3072),
    "single.linear1": (3072, 21504),
    "single.linear2": (15360, 3072),
}



def fp8_linear(base: nn.Linear) -> nn.Module:
    """The FP8 baseline: torchao's Float8Linear with mxflux's `fp8: hybrid` tensor-wise config,
    compiled, as it is trained (its amax and casts are torch ops that only inductor makes fast)."""
    from torchao.float8.float8_linear import Float8Linear

    lin = nn.Linear(base.in_features, base.out_features, device=base.weight.device, dtype=base.weight.dtype)
    lin.load_state_dict(base.state_dict())
    return torch.compile(Float8Linear.from_float(lin, config=float8_linear_config("tensorwise")))

def bench(fn, warmup=10, rep=50) -> float:
    """Median milliseconds of fn() (CUDA events through triton's do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fwd_bwd(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        module(x).backward(dy)

    return step


def linear_rows(ms, quick: bool, with_peer: bool = True):
    rows = []
    shapes = dict(list(FLUX_LINEARS.items())[:2]) if quick else FLUX_LINEARS
    for m in ms:
        for name, (k, n) in shapes.items():
            base = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            flops = 3 * 2 * m * k * n  # fprop + dgrad + wgrad
            t = {"bf16": bench(fwd_bwd(base, x, dy))}
            for mode in ("rowwise", "blockwise", "exact"):
                t[f"mxfp6-{mode}"] = bench(fwd_bwd(MXFP6Linear.from_linear(base, mx_gemm=mode), x, dy))
            t["fp8"] = bench(fwd_bwd(fp8_linear(base), x, dy))
            peer_name, peer = peer_linear(base) if with_peer else (None, None)
            if peer is not None:
                t["peer"] = bench(fwd_bwd(peer, x, dy))
            row = {"layer": name, "M": m, "K": k, "N": n, "peer": peer_name, **{f"ms_{k_}": v for k_, v in t.items()},
                   "tflops_bf16": flops / t["bf16"] / 1e9, "tflops_mxfp6": flops / t["mxfp6-rowwise"] / 1e9}
            row["speedup_mxfp6_vs_bf16"] = t["bf16"] / t["mxfp6-rowwise"]
            row["speedup_mxfp6_vs_fp8"] = t["fp8"] / t["mxfp6-rowwise"]
            if "peer" in t:
                row["speedup_mxfp6_vs_peer"] = t["peer"] / t["mxfp6-rowwise"]
            rows.append(row)
            print(f"{name:15s} M={m:6d} bf16 {t['bf16']:7.3f} ms | mxfp6 row {t['mxfp6-rowwise']:7.3f} "
                  f"blk {t['mxfp6-blockwise']:7.3f} exact {t['mxfp6-exact']:7.3f}"
                  + f" | fp8 {t['fp8']:7.3f}" + (f" | peer {t['peer']:7.3f}" if "peer" in t else "")
                  + f" | mxfp6/bf16 {row['speedup_mxfp6_vs_bf16']:.2f}x"
                  f" mxfp6/fp8 {row['speedup_mxfp6_vs_fp8']:.2f}x", flush=True)
            del base, x, dy
            torch.cuda.empty_cache()
    return rows


class _TorchaoMXFP8Linear(nn.Module):
    """torchao 0.18's MX training matmul (`moe_training.mxfp8_linear`), emulated on Hopper:
    MXFP8 (E4M3 elements, block 32) quantize-dequantize in PyTorch ops, then bf16 GEMMs. torchao
    0.18 has no MXFP6 training path any more; this is its closest MX training linear."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        self.weight = nn.Parameter(base.weight.detach().clone())
        self.bias = nn.Parameter(base.bias.detach().clone()) if base.bias is not None else None
        self._mm = lambda x, w: _to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED,
                                                        ScaleCalculationMode.RCEIL)

    def forward(self, x):
        y = self._mm(x, self.weight)
        return y if self.bias is None else y + self.bias


def peer_linear(base: nn.Linear):
    """A peer's MX training linear on this card (emulated on Hopper), if torchao provides one:
    the old `MXLinear` (MXFP6 E2M3), else torchao 0.18's MXFP8 training matmul."""
    try:
        from torchao.prototype.mx_formats.config import MXLinearConfig
        from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3
        from torchao.prototype.mx_formats.mx_linear import MXLinear

        lin = nn.Linear(base.in_features, base.out_features, device="cuda", dtype=torch.bfloat16)
        lin.load_state_dict(base.state_dict())
        return "torchao MXLinear (MXFP6 E2M3, emulated)", MXLinear.from_float(
            lin, MXLinearConfig(elem_dtype=DTYPE_FP6_E2M3, block_size=32))
    except Exception as e:  # noqa: BLE001 - any import problem means "try the next peer"
        first = f"{type(e).__name__}: {e}"
    try:
        peer = _TorchaoMXFP8Linear(base)
        x = torch.randn(64, base.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        peer(x).sum().backward()  # fails here, not in the timing, if this card cannot run it
        return "torchao 0.18 MXFP8 training matmul (emulated)", peer
    except Exception as e:  # noqa: BLE001
        print(f"peer: torchao MX training unavailable ({first}; {type(e).__name__}: {e})", file=sys.stderr)
        return None, None


def mlp_rows(ms):
    rows = []
    dim, hidden = 3072, 12288
    for m in ms:
        bf16 = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        bf16 = bf16.cuda().bfloat16()
        fused = FusedMXFP6MLP.from_linears(bf16[0], bf16[2], activation="gelu_tanh", mode="on")
        unfused = FusedMXFP6MLP.from_linears(bf16[0], bf16[2], activation="gelu_tanh", mode="off")
        x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16)
        t = {"bf16": bench(fwd_bwd(bf16, x, dy)), "fused": bench(fwd_bwd(fused, x, dy)),
             "unfused": bench(fwd_bwd(unfused, x, dy))}
        row = {"M": m, **{f"ms_{k}": v for k, v in t.items()},
               "speedup_fused_vs_bf16": t["bf16"] / t["fused"], "speedup_fused_vs_unfused": t["unfused"] / t["fused"]}
        rows.append(row)
        print(f"MLP 3072-12288-3072 M={m}: bf16 {t['bf16']:.3f} ms, fused {t['fused']:.3f}, unfused "
              f"{t['unfused']:.3f} | fused/bf16 {row['speedup_fused_vs_bf16']:.2f}x, "
              f"fused/unfused {row['speedup_fused_vs_unfused']:.2f}x", flush=True)
    return rows


def fold_window_study(batch: int = 4):
    """Blocks outside the fold window on real Flux activations and gradients (one training step)."""
    from mxflux.model import Flux, flux_config, image_ids, text_ids

    torch.manual_seed(0)
    model = Flux(flux_config("flux-535m")).cuda()
    for name, p in model.named_parameters():  # break the zero init so every gradient is real
        if p.abs().sum() == 0:
            nn.init.normal_(p, std=0.02)
    model = model.bfloat16()
    captured: dict[str, list[torch.Tensor]] = {}

    def grab(name):
        def fwd_hook(mod, inp, out):
            captured.setdefault(f"{name}:X", []).append(inp[0].detach().reshape(-1, inp[0].shape[-1]))

        def bwd_hook(mod, gin, gout):
            captured.setdefault(f"{name}:dY", []).append(gout[0].detach().reshape(-1, gout[0].shape[-1]))
        return fwd_hook, bwd_hook

    from mxflux.nn.precision.default_layers import DEFAULT_PRECISION_INCLUDE
    import fnmatch

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in DEFAULT_PRECISION_INCLUDE):
            f, b = grab(name)
            mod.register_forward_hook(f)
            mod.register_full_backward_hook(b)
    img = torch.randn(batch, 256, 64, device="cuda", dtype=torch.bfloat16)
    txt = torch.randn(batch, 256, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(batch, 768, device="cuda", dtype=torch.bfloat16)
    t = torch.rand(batch, device="cuda")
    out = model(img=img, img_ids=image_ids(batch, 16, 16, device="cuda"), txt=txt,
                txt_ids=text_ids(batch, 256, device="cuda"), timesteps=t, y=y)
    (out.float() - torch.randn_like(out.float())).square().mean().backward()

    totals = {"row": [0, 0], 128: [0, 0]}
    per_tensor = []
    for key, ts in captured.items():
        v = ts[0]
        for axis_name, mat in (("along features", v), ("along tokens", v.t().contiguous())):
            if mat.shape[1] % 128:
                continue
            mx = quantize(mat)
            nblocks = mx.codes.numel() // MX_BLOCK
            rec = {"tensor": key, "orientation": axis_name, "blocks": nblocks}
            for g, gran in (("row", FoldGranularity.ROWWISE), (128, FoldGranularity.BLOCKWISE)):
                n = int(fold_to_e4m3(mx, gran)[2])
                totals[g][0] += n
                totals[g][1] += nblocks
                rec[f"outside_{g}"] = n
            per_tensor.append(rec)
    summary = {f"outside_frac_{g}": totals[g][0] / max(totals[g][1], 1) for g in totals}
    summary["blocks"] = totals["row"][1]
    print(f"fold window on a flux-535m training step: row-wise {summary['outside_frac_row']:.3e}, "
          f"1x128 {summary['outside_frac_128']:.3e} of {summary['blocks']} blocks", flush=True)
    return {"summary": summary, "tensors": per_tensor}


def profile_layer(name: str, m: int, variants=("bf16", "mxfp6"), steps: int = 5) -> None:
    """Per-kernel device time of one linear's forward+backward (where a slow shape spends it)."""
    from torch.profiler import ProfilerActivity, profile

    k, n = FLUX_LINEARS[name]
    base = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    mods = {"bf16": base, "mxfp6": MXFP6Linear.from_linear(base), "fp8": fp8_linear(base)}
    for v in variants:
        step = fwd_bwd(mods[v], x, dy)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                kernels.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        total = sum(sum(t) for t in kernels.values()) / steps
        print(f"{name} M={m} {v}: {total / 1e3:.3f} ms of kernels per fwd+bwd", flush=True)
        for kname, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(f"    {sum(ts) / steps / 1e3:7.3f} ms  x{len(ts) // steps}  {kname[:110]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--quick", action="store_true", help="two linear shapes only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", nargs="*", default=[], choices=["linear", "mlp", "fold"])
    ap.add_argument("--no-peer", action="store_true", help="leave out the emulated peer MX linear (slow)")
    ap.add_argument("--profile", nargs=2, metavar=("LAYER", "M"), action="append",
                    help=f"only print the kernels of one linear's fwd+bwd (LAYER in {list(FLUX_LINEARS)})")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_layers: needs a CUDA device")
    if args.profile:
        for layer, m in args.profile:
            profile_layer(layer, int(m))
        return
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "fold" not in args.skip:
        result["fold_window"] = fold_window_study()
    if "linear" not in args.skip:
        result["linear"] = linear_rows(args.m, args.quick, with_peer=not args.no_peer)
    if "mlp" not in args.skip:
        result["mlp"] = mlp_rows(args.m)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_layers.json") if "OUT" in os.environ else None)
    if path:
        with open(path, "w") as f:
            json.dump({"provenance": provenance(), **result}, f, indent=1)


if __name__ == "__main__":
    main()
