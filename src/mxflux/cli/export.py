"""`mxflux export`: a run's trained Flux weights as one BFL-layout safetensors file.

The file is what `model.init_from`, `mxflux sample --weights` and ComfyUI's model loaders read (BFL's
tensor names, as in flux1-dev.safetensors): a run's model becomes the base of a LoRA run, or leaves
mxflux. The weights drawn with by default are the run's EMA where it keeps one (`--no-ema`: the
weights themselves); stored in bf16 unless `--dtype float32`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from .common import json_text, trainer_from_checkpoint


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's trained weights as a BFL-layout .safetensors file",
                       description="Write a run's trained Flux weights as one safetensors file with BFL's tensor "
                                   "names (what model.init_from, `mxflux sample --weights` and ComfyUI read).")
    p.add_argument("checkpoint", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--out", required=True, help="the .safetensors file to write (never an existing one)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="stored dtype (default: bfloat16, as FLUX.1's released weights)")
    p.add_argument("--no-ema", action="store_true", help="the weights themselves, not the run's moving average")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.set_defaults(handler=_export, parser=p)


def _export(args) -> int:
    import torch
    from safetensors.torch import save_file

    out = Path(args.out)
    if out.suffix != ".safetensors":
        args.parser.error(f"--out {args.out}: expected a .safetensors file")
    if out.exists():
        args.parser.error(f"--out {args.out}: exists; export writes a new file, it never replaces one")
    trainer = trainer_from_checkpoint(args)
    if trainer.cfg.lora is not None:
        args.parser.error(f"{args.checkpoint}: a LoRA run; its result is its adapters file, lora.safetensors "
                          f"(sample with --weights BASE --lora FILE)")
    dtype = getattr(torch, args.dtype)
    with contextlib.nullcontext() if args.no_ema else trainer.sampling_weights():
        # copies (clone): a view of a parameter would read the weights swapped back after the block
        tensors = {name: p.detach().to(dtype).cpu().clone() for name, p in trainer.model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "written_by": "mxflux export",
                                           "model": trainer.cfg.model.name, "recipe": trainer.cfg.name,
                                           "step": str(trainer.step), "run_id": trainer.run_id})
    tmp.replace(out)
    print(json_text({"weights": str(out), "model": trainer.cfg.model.name, "step": trainer.step,
                     "tensors": len(tensors)}))
    return 0
