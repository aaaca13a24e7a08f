"""A LoRA training step at FLUX.1-dev's shapes: mxflux's frozen-MXFP6 base against a bf16 base, ours and
diffusers' FluxTransformer2DModel with peft adapters, each in its own process of one call.

    PYTHONPATH=src python benchmarks/bench_lora.py [--model flux-12b-dev] [--image 1024] [--txt 512]
        [--impls mxfp6,bf16,peft] [--steps 5] [--warmup 3] [--rank 16] [--out DIR]

One step: micro-batch 1, a 1024x1024 image (4096 latent tokens) and 512 text tokens, activation
checkpointing on every block (ours as the LoRA recipe sets it: `model.activation_checkpointing` and
`blocks_keeping_gemm_outputs`, which fit its 24 GiB; peft's: diffusers' gradient checkpointing, every
block recomputed whole), forward and backward under bf16 autocast and AdamW over the adapters
(rank 16, alpha 16; fp32 masters). Random weights of the real shapes (the speed and memory of a step do
not depend on the values; correctness comes from tests/test_lora.py). Settings:

- `mxfp6`: the LoRA recipes' model: the MX linears frozen as their 1-byte operands
  (`mxflux.nn.frozen`), the rest bf16, adapters on the MX linears, blocks compiled;
- `bf16`: the same model and adapters with the base frozen in bf16 (no precision), blocks compiled;
- `mxfp6-full`, `mxfp6-attention-keep0-26`, ... (`bf16-...` too): the same with other checkpointing
  (a suffix -full or -attention, the mode; -keepD-S, the first D double and S single blocks keeping
  their GEMM outputs), to measure what the recipe's costs and buys;
- `peft`: diffusers' FluxTransformer2DModel in bf16 with peft's LoRA on the same linears (diffusers'
  Flux LoRA example's target modules), its gradient checkpointing, blocks compiled the same way.

Writes bench_lora_<date>.json (per setting: ms per step, mean and min over the timed steps, peak
allocated GiB over the timed steps and over the warm-up (compiling, autotuning) apart, peak reserved;
one profiled step's device time by category; one more step's memory at its peak by what holds it
(`mxflux.bench.memory`); ratios to `peft` and `bf16` by the median step and by the mean; provenance) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

from own_processes import add_arguments, answered_as_worker, run_settings

# diffusers' Flux LoRA example's target modules, in the blocks only (a bare "proj_out" would also take the
# final layer): the same linears as mxflux's default (qkv, proj, MLPs, linear1 = q, k, v, proj_mlp; linear2)
PEFT_TARGETS = (r"^(transformer_blocks|single_transformer_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|"
                r"add_k_proj|add_v_proj|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)|proj_mlp|proj_out)$")


def _inputs(config, args, device, dtype):
    import torch

    from mxflux.model import image_ids, text_ids

    side = args.image // 16  # VAE /8, then 2x2 patches
    g = torch.Generator(device=device).manual_seed(0)
    return dict(img=torch.randn(1, side * side, config.in_channels, device=device, dtype=dtype, generator=g),
                img_ids=image_ids(1, side, side, device=device),
                txt=torch.randn(1, args.txt, config.context_in_dim, device=device, dtype=dtype, generator=g),
                txt_ids=text_ids(1, args.txt, device=device),
                y=torch.randn(1, config.vec_in_dim, device=device, dtype=dtype, generator=g),
                timesteps=torch.rand(1, device=device, generator=g),
                guidance=torch.full((1,), 3.5, device=device) if config.guidance_embed else None)


def _setting(name: str) -> tuple[str, str | None, tuple[int, int] | None]:
    """A setting's base ("mxfp6", "bf16", "peft"), its activation checkpointing mode and how many
    double and single blocks keep their GEMM outputs: "mxfp6-attention-keep0-26" is mxfp6 under
    `activation_checkpointing: attention` with the first 26 single blocks keeping them. Without a
    suffix (None, None), the LoRA recipe's; with one, what it leaves out is "full" and 0, 0."""
    m = re.fullmatch(r"(mxfp6|bf16)(?:-(full|attention))?(?:-keep(\d+)-(\d+))?|peft", name)
    if m is None:
        raise SystemExit(f"--impls: unknown setting {name!r} (mxfp6, bf16, peft; a suffix -full or -attention "
                         "and/or -keepD-S after mxfp6 or bf16)")
    if name == "peft":
        return "peft", None, None
    if name in ("mxfp6", "bf16"):
        return name, None, None
    return m[1], m[2] or "full", (int(m[3]), int(m[4])) if m[3] else (0, 0)


def _ours(args, precision: str, mode: str | None, keep: tuple[int, int] | None):
    """Our Flux built on meta and materialised one block at a time with random weights, frozen as it goes
    (the LoRA recipes' streamed build, with random values instead of a file), adapters, checkpointing."""
    import torch

    from mxflux.model import Flux, flux_config
    from mxflux.nn import apply_precision
    from mxflux.nn.frozen import freeze_base
    from mxflux.nn.lora import apply_lora, lora_targets
    from mxflux.nn.precision.default_layers import DEFAULT_PRECISION_INCLUDE
    from mxflux.train.config import load_recipe
    from mxflux.train.parallelize import checkpoint_block

    config = flux_config(args.model)
    with torch.device("meta"):
        model = Flux(config)
    apply_precision(model, precision)
    torch.manual_seed(0)
    for unit in [*model.double_blocks, *model.single_blocks,
                 *[m for m in model.children() if m not in (model.double_blocks, model.single_blocks)]]:
        unit.to_empty(device=args.device)
        with torch.no_grad():
            for p in unit.parameters():
                p.normal_(0.0, 0.02)
        freeze_base(unit)
    freeze_base(model)
    apply_lora(model, lora_targets(model, DEFAULT_PRECISION_INCLUDE), args.rank, float(args.rank))
    recipe = load_recipe("flux12b-mxfp6-lora-dev").model  # its checkpointing unless the setting names one
    mode = mode or recipe.activation_checkpointing
    keep = keep if keep is not None else (recipe.blocks_keeping_gemm_outputs.double,
                                          recipe.blocks_keeping_gemm_outputs.single)
    for kept, blocks in zip(keep, (model.double_blocks, model.single_blocks)):
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_block(block, mode, keep_gemm_outputs=i < kept)
            if args.compile:
                blocks[i].compile()
    inputs = _inputs(config, args, args.device, torch.bfloat16)

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16):
            out = model(**inputs)
        out.float().square().mean().backward()

    return model, step


def _peft(args):
    import torch
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from mxflux.model import flux_config

    config = flux_config(args.model)
    torch.set_default_dtype(torch.bfloat16)  # the base built in bf16 directly (24 GB, never 48 in fp32)
    with torch.device(args.device):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=config.in_channels, out_channels=config.out_channels, num_layers=config.depth,
            num_single_layers=config.depth_single_blocks, attention_head_dim=config.head_dim,
            num_attention_heads=config.num_heads, joint_attention_dim=config.context_in_dim,
            pooled_projection_dim=config.vec_in_dim, guidance_embeds=config.guidance_embed,
            axes_dims_rope=config.axes_dim)
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                 target_modules=PEFT_TARGETS))
    for p in model.parameters():  # diffusers' example: trainable parameters in fp32 (cast_training_params)
        if p.requires_grad:
            p.data = p.data.float()
    model.enable_gradient_checkpointing()
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for block in blocks if args.compile else ():
            block.compile()
    x = _inputs(config, args, args.device, torch.bfloat16)

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16):
            out = model(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"],
                        timestep=x["timesteps"], img_ids=x["img_ids"][0], txt_ids=x["txt_ids"][0],
                        guidance=x["guidance"], return_dict=False)[0]
        out.float().square().mean().backward()

    return model, step


def _profiled_step(step, optimizer) -> dict:
    """One more step under the profiler: its device time split into GEMM, MX quantization, attention,
    optimizer and other (`mxflux.bench.device_time`), with the top kernels."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from mxflux.bench.device_time import activities_from_chrome_trace, device_breakdown

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return device_breakdown(activities_from_chrome_trace(f.name), 1, wall_s=wall, top=16)


def worker(args) -> dict:
    import torch

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    base, mode, keep = _setting(args.worker)
    model, step = _peft(args) if base == "peft" else _ours(args, base, mode, keep)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    cuda = args.device.startswith("cuda")
    base_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, warm_peak = [], None
    t_compile = time.perf_counter()
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if i == 0:
            t_compile = time.perf_counter() - t_compile
        if i == args.warmup - 1 and cuda:  # the first steps compile and autotune: their transients apart
            warm_peak = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
    timed = times[args.warmup:]
    breakdown = _profiled_step(step, optimizer) if args.profile and cuda else None
    memory = None
    if args.memory:  # one more step: what it saves for backward, and on CUDA what is alive at its peak
        from mxflux.bench.memory import memory_breakdown, print_memory_report

        memory = memory_breakdown(lambda: (step(), optimizer.step(), optimizer.zero_grad(set_to_none=True)),
                                  model=model, optimizer=optimizer, device=torch.device(args.device), top=25)
        print_memory_report(memory, title=f"{args.worker}: ")
    return {"device_time": breakdown, "memory": memory, "setting": args.worker, "ms_mean": sum(timed) / len(timed), "ms_min": min(timed), "ms_all": timed,
            "first_step_s": t_compile, "model_gib": base_gib,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,  # timed steps
            "peak_allocated_warmup_gib": warm_peak if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            "trained_parameters": sum(p.numel() for p in trained)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux-12b-dev")
    ap.add_argument("--image", type=int, default=1024, help="image side in pixels (tokens: (side/16)^2)")
    ap.add_argument("--txt", type=int, default=512, help="T5 tokens")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--impls", default="mxfp6,bf16,peft")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="one more step under the profiler: where the device time goes (CUDA only)")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                    help="one more step: what it saves for backward, and under the allocator's trace (CUDA) what holds "
                         "memory at its peak")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    add_arguments(ap, timeout=280)
    args = ap.parse_args(argv)
    if answered_as_worker(args, worker):
        return
    passthrough = argv if argv is not None else sys.argv[1:]
    impls = args.impls.split(",")
    for impl in impls:
        _setting(impl)  # a misspelt setting before any is started
    rows = run_settings(__file__, impls, passthrough, args.timeout)
    by = {r["setting"]: r for r in rows if "ms_mean" in r}
    for r in rows:
        for base in ("peft", "bf16"):
            if "ms_mean" in r and base in by and r["setting"] != base:
                # by the median step: peft's timed steps carry outliers (one of 900-1050 ms among ~540)
                r[f"speedup_vs_{base}"] = statistics.median(by[base]["ms_all"]) / statistics.median(r["ms_all"])
                r[f"speedup_vs_{base}_by_mean"] = by[base]["ms_mean"] / r["ms_mean"]
    from mxflux.bench.provenance import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    result = {"provenance": provenance(), "date": date, "args": {k: v for k, v in vars(args).items() if k != "worker"},
              "run_mode": {"compile": "per block, default mode", "cuda_graphs": "none",
                           "optimizer": "torch AdamW (fused) over the adapters",
                           "activation_checkpointing": "every block"},
              "rows": rows}
    (out / f"bench_lora_{date}.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        print(r["setting"], {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                             if k not in ("ms_all", "error", "setting", "device_time", "memory")} if "ms_mean" in r else r.get("error", "")[-600:])


if __name__ == "__main__":
    main()
