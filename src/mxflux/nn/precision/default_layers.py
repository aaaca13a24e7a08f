"""Which linears of a Flux model a recipe's precision converts unless it chooses others.

The layer choice is the precision block's (`precision.include`), so it lives here beside it; the
model does not import it (it knows nothing about precision), and the patterns are only names.
"""

from __future__ import annotations

__all__ = ["DEFAULT_PRECISION_INCLUDE"]

DEFAULT_PRECISION_INCLUDE: tuple[str, ...] = (
    "double_blocks.*.img_attn.qkv",
    "double_blocks.*.img_attn.proj",
    "double_blocks.*.txt_attn.qkv",
    "double_blocks.*.txt_attn.proj",
    "double_blocks.*.img_mlp.0",
    "double_blocks.*.img_mlp.2",
    "double_blocks.*.txt_mlp.0",
    "double_blocks.*.txt_mlp.2",
    "single_blocks.*.linear1",
    "single_blocks.*.linear2",
)
"""The default `precision.include`: fnmatch patterns over `named_modules()` names.

Attention qkv/proj and MLP fc1/fc2: 8 linears per double block, 2 per single block. Counted as 4
linears per single block (qkv, MLP in, attention proj, MLP out) flux-12b has 304; BFL fuses them
into linear1 (qkv + MLP in) and linear2 (proj + MLP out), so the same weights and GEMM FLOPs are
19·8 + 38·2 = 228 modules here. Together they carry 97.1% of
flux-12b's forward matmul FLOPs at 256 image + 256 text tokens (`forward_flops`); attention
(SDPA) is 2.7%, everything left in bf16 (img_in, txt_in, time_in, vector_in, guidance_in,
modulation, final layer) 0.2%.
"""
