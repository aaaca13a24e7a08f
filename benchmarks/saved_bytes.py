"""What one compiled Flux block keeps for backward, per precision, counted on the CPU.

    PYTHONPATH=src python3 benchmarks/saved_bytes.py [--json out.json] [--width 128] [--tokens 608]

Builds `flux-tiny` blocks (width 128, the flux-12b block's proportions: MLP ratio 4, heads of
64; 2 samples of 608 tokens, about as many tokens per feature as the flux-12b-width proxy at
micro-batch 64, so weights and activations weigh as they do there), applies each precision as a
recipe would, compiles the block with torch.compile (inductor, as training does), runs forward
under bf16 autocast and counts what autograd keeps for backward
(`mxflux.bench.memory.record_saved_tensors`: each storage once, parameters excluded): the
activation memory of a block, in bytes, on the same partitioner the GPU uses. Not a GPU peak (no
allocator, no workspaces); what it shows is which tensors each precision keeps and their sizes,
for bf16, torchao FP8 tensorwise, MXFP6, MXFP6 with `repack_weights`, and MXFP6 with
`model.activation_checkpointing: mx_packers` (`-sac`: the block wrapped by
`mxflux.train.parallelize.checkpoint_block`, as training wraps it), which recomputes the packer
calls on activations in backward instead of keeping their E4M3 Xᵀ (and, in a single block,
rebuilds linear2's input); `-sac-packers-only` recomputes the packer calls alone, without
rebuilding any input (`mxflux.train.parallelize.mx_packer_rebuilt_ops` says why that is not
enough for a single block), measured here to show why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from mxflux.bench.memory import SavedTensors, record_saved_tensors
from mxflux.model import Flux, flux_config, image_ids, text_ids
from mxflux.nn import apply_precision
from mxflux.train.config import load_recipe
from mxflux.train.parallelize import checkpoint_block

# name: (recipe, changes to its precision block, activation checkpointing of the block)
PRECISIONS = {
    "bf16": ("tiny-bf16", {}, None),
    "fp8-tensorwise": ("flux12b-fp8-mlperf", {}, None),
    "mxfp6": ("tiny-mxfp6", {}, None),
    "mxfp6-repack": ("tiny-mxfp6", {"repack_weights": True}, None),
    "mxfp6-sac": ("tiny-mxfp6", {}, "mx_packers"),
    "mxfp6-repack-sac": ("tiny-mxfp6", {"repack_weights": True}, "mx_packers"),
    "mxfp6-repack-sac-packers-only": ("tiny-mxfp6", {"repack_weights": True}, "packers-only"),
    # the Xᵀ of proj, fc2 and linear2 packed again in backward from their rebuilt inputs (mx_inputs)
    "mxfp6-inputs": ("tiny-mxfp6", {}, "mx_inputs"),
    # the same with the MLP unfused (as `mxflux bench step`'s mxfp6 settings run it)
    "mxfp6-unfused": ("tiny-mxfp6", {"fused_mlp": "off"}, None),
    "mxfp6-unfused-inputs": ("tiny-mxfp6", {"fused_mlp": "off"}, "mx_inputs"),
    # the col operands kept in six bits (precision.saved_operands: e2m3), with and without mx_packers
    "mxfp6-6bit-repack": ("tiny-mxfp6", {"repack_weights": True, "saved_operands": "e2m3"}, None),
    "mxfp6-6bit-repack-sac": ("tiny-mxfp6", {"repack_weights": True, "saved_operands": "e2m3"}, "mx_packers"),
    # only GEMM and attention outputs kept (activation_checkpointing: elementwise), in each precision
    "bf16-elementwise": ("tiny-bf16", {}, "elementwise"),
    "fp8-tensorwise-elementwise": ("flux12b-fp8-mlperf", {}, "elementwise"),
    "mxfp6-repack-elementwise": ("tiny-mxfp6", {"repack_weights": True}, "elementwise"),
}


def _checkpointed(block, checkpointing: str | None):
    """The block as training wraps it for `model.activation_checkpointing` (or, "packers-only",
    with a policy that recomputes the activation packer calls and rebuilds no input)."""
    if checkpointing is None:
        return block
    if checkpointing == "packers-only":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        from mxflux.nn.recompute import mark_recomputed, mx_packer_checkpoint_context

        mark_recomputed(block, selective=True)
        return checkpoint_wrapper(block, context_fn=mx_packer_checkpoint_context())
    return checkpoint_block(block, checkpointing)


def saved_by_block(precision: str, kind: str, tokens: int, width: int) -> SavedTensors:
    recipe, update, checkpointing = PRECISIONS[precision]
    torch.manual_seed(0)
    cfg = flux_config("flux-tiny", depth=1, depth_single_blocks=1, hidden_size=width, num_heads=width // 64)
    model = Flux(cfg)
    apply_precision(model, load_recipe(recipe).precision.model_copy(update=update))
    b, d, n_txt = 2, cfg.hidden_size, 32
    side = int(round((tokens - n_txt) ** 0.5))
    n_img = side * side
    pe = model.pe_embedder(torch.cat([text_ids(b, n_txt), image_ids(b, side, side)], 1))
    vec = torch.randn(b, d, requires_grad=True)
    if kind == "single":
        block = model.single_blocks[0]
        x = torch.randn(b, n_txt + n_img, d, requires_grad=True)
        inputs = (x, vec, pe)
    else:
        block = model.double_blocks[0]
        inputs = (torch.randn(b, n_img, d, requires_grad=True), torch.randn(b, n_txt, d, requires_grad=True), vec, pe)

    block = _checkpointed(block, checkpointing)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(*inputs)

    # a fresh compile per block: `step` is one code object, which past dynamo's cache limit would run eagerly
    torch._dynamo.reset()
    compiled = torch.compile(step)
    compiled()  # compile
    with record_saved_tensors(block) as saved:
        compiled()
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=608, help="image + text tokens per sample (32 text, the rest a "
                    "square image)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {', '.join(PRECISIONS)}")
    ap.add_argument("--blocks", default="double,single", help="comma-separated: double, single")
    args = ap.parse_args()
    precisions = [p for p in args.precisions.split(",") if p]
    blocks = [b for b in args.blocks.split(",") if b]
    bad = [p for p in precisions if p not in PRECISIONS] + [b for b in blocks if b not in ("double", "single")]
    if bad:
        ap.error(f"unknown precision or block: {', '.join(bad)}")
    # What the GPU keeps: its packers run the row granularity in two passes, so under a selective
    # policy the MX linears pack their inputs apart (keeping their e_ref words); the CPU packers would not.
    from mxflux.nn import functional

    functional._two_pass_packer = lambda x: True
    res = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "width": args.width,
           "tokens": args.tokens, "blocks": []}
    for kind in blocks:
        for precision in precisions:
            by_dtype = dict(saved_by_block(precision, kind, args.tokens, args.width).by_dtype)
            total = sum(by_dtype.values())
            res["blocks"].append({"block": kind, "precision": precision, "bytes": total, "by_dtype": by_dtype})
            print(f"{kind:6s} {precision:15s} {total / 1e6:7.3f} MB  " +
                  "  ".join(f"{k} {v / 1e6:.3f}" for k, v in sorted(by_dtype.items())), flush=True)
    if args.json:
        from mxflux.bench.provenance import provenance
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), **res}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
