"""A training step in a loop of one's own (not the trainer's): the model as `apply_precision` leaves it,
blocks compiled, torch's AdamW, against the same loop with `mxflux.optim.AdamW`, beside bf16 and
torchao FP8 tensor-wise in the same loop; each setting in its own process of one call.

    PYTHONPATH=src python benchmarks/bench_user_loop.py [--mbs 64] [--settings ...] [--steps 6] [--out DIR]

The loop: bf16 autocast, forward, the mean-squared flow loss on random on-device inputs of the
proxy's shapes (the 2+4-block flux-12b-width proxy of `mxflux bench step --proxy`, 256² images, 256
text tokens), backward, clipping to total norm 1, the optimizer step, zero_grad. Settings:

- `bf16`, `fp8-tensorwise`, `mxfp6`: the precision (`mxflux.bench.compare.SETTINGS`), torch's fused
  AdamW after `torch.nn.utils.clip_grad_norm_` (what a loop written against torch has);
- `mxfp6-mxflux-adamw`: MXFP6 with `mxflux.optim.AdamW(model, max_grad_norm=1.0)`: the trainer's
  step, which writes the MX weights' e_ref and operands and clips in its pass, and its
  `release_weight_rows()` between forward and backward.

Writes bench_user_loop_mbs<N>_<date>.json (per setting: ms per step over the timed steps, median,
mean, min and all; peak allocated GiB; ratios to bf16 and fp8-tensorwise by the median;
provenance) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from own_processes import add_arguments, answered_as_worker, run_settings

SETTINGS = ("bf16", "fp8-tensorwise", "mxfp6", "mxfp6-mxflux-adamw")


def _model_and_inputs(args, precision: str):
    import torch

    from mxflux.bench.compare import PROXY_OVERRIDES, PROXY_RECIPE, SETTINGS as PRECISIONS
    from mxflux.model import image_ids, text_ids
    from mxflux.train.build import build_model
    from mxflux.train.config import load_recipe
    from mxflux.train.guidance import guidance_input

    recipe = args.recipe or PROXY_RECIPE
    overrides = [*(PROXY_OVERRIDES if args.recipe is None else ()), *PRECISIONS[precision],
                 f"model.compile={'true' if args.compile else 'false'}", *args.set]
    cfg = load_recipe(recipe, overrides)
    device = torch.device(args.device)
    model, _ = build_model(cfg, device)  # fp32 masters, the precision applied: what apply_precision leaves
    if args.compile:
        for block in [*model.double_blocks, *model.single_blocks]:
            block.compile()
    mc, b = cfg.model.flux_config(), args.mbs
    side = args.image // 16
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(img=torch.randn(b, side * side, mc.in_channels, generator=g, device=device, dtype=torch.bfloat16),
                  img_ids=image_ids(b, side, side, device=device),
                  txt=torch.randn(b, args.txt, mc.context_in_dim, generator=g, device=device, dtype=torch.bfloat16),
                  txt_ids=text_ids(b, args.txt, device=device),
                  y=torch.randn(b, mc.vec_in_dim, generator=g, device=device, dtype=torch.bfloat16),
                  timesteps=torch.rand((b,), generator=g, device=device),
                  guidance=guidance_input(cfg.train.distilled_guidance, b, device))
    target = torch.randn(b, side * side, mc.in_channels, generator=g, device=device)
    return model, inputs, target


def worker(args) -> dict:
    import torch

    from mxflux.optim import AdamW

    precision = "mxfp6" if args.worker == "mxfp6-mxflux-adamw" else args.worker
    model, inputs, target = _model_and_inputs(args, precision)
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if args.worker == "mxfp6-mxflux-adamw":
        optimizer = AdamW(model, max_grad_norm=1.0, **hp)
        clip = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=args.device.startswith("cuda"), **hp)
        clip = 1.0
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16):
            pred = model(**inputs)
        loss = (pred.float() - target).square().mean()
        if clip is None:
            optimizer.release_weight_rows()  # as mxflux.optim's docstring loop: the row operands until the step
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    timed = times[args.warmup:]
    return {"setting": args.worker, "ms_median": statistics.median(timed), "ms_mean": statistics.mean(timed),
            "ms_min": min(timed), "ms_all": timed,
            "optimizer": type(optimizer).__module__ + "." + type(optimizer).__qualname__,
            "optimizer_step": getattr(optimizer, "last_step", "torch"),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbs", type=int, default=64, help="micro-batch (one per step)")
    ap.add_argument("--image", type=int, default=256, help="image side in pixels (tokens: (side/16)^2)")
    ap.add_argument("--txt", type=int, default=256, help="text tokens")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--recipe", default=None, help="a recipe instead of the proxy (tests: tiny-mxfp6)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more recipe overrides")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    add_arguments(ap, timeout=150)
    args = ap.parse_args(argv)
    if answered_as_worker(args, worker):
        return
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {', '.join(map(repr, unknown))} (expected some of {', '.join(SETTINGS)})")
    passthrough = argv if argv is not None else sys.argv[1:]
    rows = run_settings(__file__, settings, passthrough, args.timeout)
    by = {r["setting"]: r for r in rows if "ms_median" in r}
    for r in rows:
        for base in ("bf16", "fp8-tensorwise"):
            if "ms_median" in r and base in by and r["setting"] != base:
                r[f"speedup_vs_{base}"] = by[base]["ms_median"] / r["ms_median"]
    from mxflux.bench.provenance import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = out / f"bench_user_loop_mbs{args.mbs}_{date}.json"
    path.write_text(json.dumps({"provenance": provenance(), "date": date,
                                "args": {k: v for k, v in vars(args).items() if k != "worker"},
                                "run_mode": {"compile": "per block, default mode" if args.compile else "eager",
                                             "cuda_graphs": "none", "loop": "the benchmark's own (not the trainer)"},
                                "rows": rows}, indent=1))
    for r in rows:
        print(r["setting"], {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                             if k not in ("ms_all", "setting")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
