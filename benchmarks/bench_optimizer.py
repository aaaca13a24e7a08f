"""The optimizer step alone: torch's fused AdamW (with clip_grad_norm_'s pass, or with the clip
factor as its grad_scale) against our Triton AdamW with the factor (`mxflux.train.adamw_cuda`), at
several launch shapes, over the parameters of a Flux model of the flux-12b width.

The step is what `mxflux.train.clipping.clip_and_step` runs after backward, minus the gradient
norm (the same in every variant). Each variant runs `--steps` optimizer steps on fp32 parameters,
gradients and moments of the model's shapes (random values; the model itself is built on the meta
device), timed with CUDA events; bandwidth counts 28 bytes per element (parameter, gradient and
both moments read, parameter and moments written), the floor of every variant, against a plain
device copy measured in the same run.

The step that also computes the MX weights' e_ref (`nn.MXWeightState`, at several tiles) is
timed against what it replaces: the plain step plus the packer's pass 1 over each fp32 MX weight
(of the MXFP6 recipe), which the next forward runs without it. So is the step that also writes the
weights' operands (`--operands` tiles; MXFP6Linear layers over the same parameters keep them),
against the step with the e_ref plus the packer's pass 2 over each MX weight, which the next forward
runs without it (the bandwidth column still counts 28 bytes per element: the operands add 2 per MX
weight element).

    PYTHONPATH=src python3 benchmarks/bench_optimizer.py --blocks 2,4 --json $OUT/bench_optimizer.json
    PYTHONPATH=src python3 benchmarks/bench_optimizer.py --blocks 6,12 --launch 2048x8 4096x8 1024x4
    PYTHONPATH=src python3 benchmarks/bench_optimizer.py --blocks 6,12 --launch 1024x4 --erefs 64x2x4x4 \
        --operands 64x2x4x4 128x2x8x4 64x4x8x4 32x2x2x2
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mxflux.bench.provenance import provenance
from mxflux.kernels.operands_cuda import mx_operands_cuda, weight_exponents_cuda
from mxflux.kernels.weight_erefs import buffer_words
from mxflux.model import Flux, flux_config
from mxflux.kernels.adamw_cuda import OperandTile
from mxflux.nn import MXFP6Linear, MXWeightState, apply_precision, rowwise_mx_linears
from mxflux.train import adamw_cuda
from mxflux.train.config import load_recipe
from mxflux.train.optimizer import ClippingAdamW

HP = dict(lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _shapes(double: int, single: int) -> list[torch.Size]:
    return [s for s, _ in _model_shapes(double, single)]


def _model_shapes(double: int, single: int) -> list[tuple[torch.Size, bool | None]]:
    """Each parameter's shape, and for the MX weights of the MXFP6 recipe their Hadamard flag
    (None for the other parameters)."""
    with torch.device("meta"):
        model = Flux(flux_config("flux-12b", depth=double, depth_single_blocks=single))
    apply_precision(model, load_recipe("flux12b-mxfp6-dev").precision)
    mx = {id(m.weight): m.cfg.hadamard for m in rowwise_mx_linears(model)}
    return [(p.shape, mx.get(id(p))) for p in model.parameters()]


def _optimizer(shapes, device, kernel: str):
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ClippingAdamW(params, kernel=kernel, fused=True, **HP)
    return params, opt


def _time(fn, steps: int) -> float:
    fn()  # creates the state, compiles
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def _copy_gbps(dev, steps: int) -> float:
    """A plain device copy of 1 GiB, bytes read plus written per second."""
    src = torch.empty(1 << 28, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _time(lambda: dst.copy_(src), steps) / 1e6


def _torch_variants(shapes, dev, factor, steps: int) -> list[tuple[str, float]]:
    """torch's fused AdamW: alone, after clip_grad_norm_'s multiply, and with the factor as its grad_scale."""
    params, opt = _optimizer(shapes, dev, "torch")
    grads = [p.grad for p in params]

    def clip_pass():
        torch._foreach_mul_(grads, factor)
        opt.step()

    return [("torch fused", _time(opt.step, steps)), ("torch fused + clip pass", _time(clip_pass, steps)),
            ("torch fused, factor as grad_scale", _time(lambda: opt.step(grad_factor=factor), steps))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="2,4", help="double,single blocks of the flux-12b-width model")
    ap.add_argument("--launch", nargs="+", default=["2048x8", "4096x8", "1024x4", "4096x16"],
                    help="Triton kernel shapes to time, BLOCKxNUM_WARPS")
    ap.add_argument("--erefs", nargs="+", default=["128x2x8x4", "64x2x4x4", "64x2x4x2", "128x2x8x2"],
                    help="tiles of the step that also computes the MX weights' e_ref, BRxNBxNUM_WARPSxSLICES")
    ap.add_argument("--operands", nargs="+", default=["64x2x4x4"],
                    help="tiles of the step that also writes the MX weights' operands, BRxNBxNUM_WARPSxSLICES")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not adamw_cuda.HAS_TRITON:
        sys.exit("bench_optimizer: needs a CUDA device and Triton")
    double, single = (int(x) for x in args.blocks.split(","))
    model_shapes = _model_shapes(double, single)
    shapes = [s for s, _ in model_shapes]
    n = sum(s.numel() for s in shapes)
    big = sum(s.numel() for s in shapes if s.numel() >= adamw_cuda.LARGE)
    dev = torch.device("cuda")
    copy_gbps = _copy_gbps(dev, args.steps)
    factor = torch.tensor(0.5, device=dev)
    rows = []

    def record(name: str, ms: float) -> None:
        gbps = 28 * n / ms / 1e6
        rows.append(dict(variant=name, ms=ms, GBps=gbps, pct_copy=100 * gbps / copy_gbps))
        print(f"{name:34s} {ms:8.3f} ms  {gbps:6.0f} GB/s  {100 * gbps / copy_gbps:5.1f} % of copy", flush=True)

    for name, ms in _torch_variants(shapes, dev, factor, args.steps):
        record(name, ms)
    torch.cuda.empty_cache()
    params, opt = _optimizer(shapes, dev, "triton")
    default = (adamw_cuda.BLOCK, adamw_cuda.NUM_WARPS)
    try:
        for launch in args.launch:
            adamw_cuda.BLOCK, adamw_cuda.NUM_WARPS = (int(x) for x in launch.split("x"))
            record(f"triton {launch}, factor", _time(lambda: opt.step(grad_factor=factor), args.steps))
    finally:
        adamw_cuda.BLOCK, adamw_cuda.NUM_WARPS = default
    # What the e_ref in the step replaces: the packer's pass 1 over each fp32 MX weight at the next forward
    mx = [(p, h) for p, (_, h) in zip(params, model_shapes) if h is not None]
    bufs = [torch.empty(buffer_words(*p.shape), dtype=torch.int32, device=dev) for p, _ in mx]

    def step_then_pass1():
        opt.step(grad_factor=factor)
        for (p, h), b in zip(mx, bufs):
            weight_exponents_cuda(p.detach(), h, b)

    record("triton + packer pass 1 on MX weights", _time(step_then_pass1, args.steps))
    record("  (packer pass 1 on MX weights alone)",
           _time(lambda: [weight_exponents_cuda(p.detach(), h, b) for (p, h), b in zip(mx, bufs)], args.steps))
    def at_tiles(what: str, tiles: list[str]) -> None:
        """The step at each OperandTile BRxNBxNUM_WARPSxSLICES (the shipped one restored after)."""
        W = OperandTile
        tile0 = (W.BR, W.NB, W.NUM_WARPS, W.SLICES)
        try:
            for tile in tiles:
                W.BR, W.NB, W.NUM_WARPS, W.SLICES = (int(x) for x in tile.split("x"))
                record(f"triton, {what} in the step {tile}", _time(lambda: opt.step(grad_factor=factor), args.steps))
        finally:
            W.BR, W.NB, W.NUM_WARPS, W.SLICES = tile0

    layers = []
    for p, h in mx:
        with torch.device(dev):
            m = MXFP6Linear(p.shape[1], p.shape[0], bias=False, hadamard=h)
        m.weight = p  # the layer over the optimizer's parameter
        layers.append(m)
    opt.weight_state = MXWeightState(layers, min_elements=adamw_cuda.LARGE)
    at_tiles("e_ref", args.erefs)
    # What the kept operands replace: the packer's pass 2 over each fp32 MX weight at the next forward
    erefs = opt.weight_state.of

    def pass2():
        for p, h in mx:
            mx_operands_cuda(p.detach(), hadamard=h, erefs=erefs[p][1])

    record("triton, e_ref in the step + packer pass 2 on MX weights",
           _time(lambda: (opt.step(grad_factor=factor), pass2()), args.steps))
    record("  (packer pass 2 on MX weights alone)", _time(pass2, args.steps))
    opt.weight_state = MXWeightState(layers, layers, min_elements=adamw_cuda.LARGE)
    assert len(opt.weight_state.kept) == len(mx)
    at_tiles("operands", args.operands)
    print(f"fix-up passes run: {int(opt.weight_state.fixups)}", flush=True)
    print(f"MX weights: {len(mx)}, {sum(p.numel() for p, _ in mx) / 1e9:.3f} B elements", flush=True)
    print(f"{len(shapes)} parameters, {n / 1e9:.3f} B elements ({big / n:.1%} through the Triton kernel); "
          f"copy {copy_gbps:.0f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(provenance=provenance(), device=torch.cuda.get_device_name(), torch=torch.__version__, blocks=[double, single],
                           parameters=len(shapes), elements=n, copy_GBps=copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
