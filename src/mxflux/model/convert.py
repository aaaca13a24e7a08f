"""diffusers `FluxTransformer2DModel` state dicts -> BFL names and layouts (what `Flux` loads), and
a BFL linear's diffusers counterparts (what LoRA adapters are saved under).

Differences handled:
- diffusers keeps q, k, v (and, in single blocks, the MLP input) as separate linears; BFL
  concatenates them along the output dim: img_attn.qkv = [to_q; to_k; to_v],
  txt_attn.qkv = [add_q_proj; add_k_proj; add_v_proj], linear1 = [to_q; to_k; to_v; proj_mlp].
- diffusers' RMSNorms are torch.nn.RMSNorm (`.weight`); BFL's parameter is `.scale`.
- norm_out.linear chunks its output as (scale, shift); BFL's final adaLN_modulation as (shift,
  scale): the two halves swap.
- Everything else is a rename (table below). Unknown keys raise instead of being dropped.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

__all__ = ["bfl_linear_to_diffusers", "diffusers_to_bfl"]

# diffusers name -> BFL name; "{}" is the block index.
_RENAMES = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
    "transformer_blocks.{}.norm1.linear": "double_blocks.{}.img_mod.lin",
    "transformer_blocks.{}.norm1_context.linear": "double_blocks.{}.txt_mod.lin",
    "transformer_blocks.{}.attn.to_out.0": "double_blocks.{}.img_attn.proj",
    "transformer_blocks.{}.attn.to_add_out": "double_blocks.{}.txt_attn.proj",
    "transformer_blocks.{}.attn.norm_q": "double_blocks.{}.img_attn.norm.query_norm",
    "transformer_blocks.{}.attn.norm_k": "double_blocks.{}.img_attn.norm.key_norm",
    "transformer_blocks.{}.attn.norm_added_q": "double_blocks.{}.txt_attn.norm.query_norm",
    "transformer_blocks.{}.attn.norm_added_k": "double_blocks.{}.txt_attn.norm.key_norm",
    "transformer_blocks.{}.ff.net.0.proj": "double_blocks.{}.img_mlp.0",
    "transformer_blocks.{}.ff.net.2": "double_blocks.{}.img_mlp.2",
    "transformer_blocks.{}.ff_context.net.0.proj": "double_blocks.{}.txt_mlp.0",
    "transformer_blocks.{}.ff_context.net.2": "double_blocks.{}.txt_mlp.2",
    "single_transformer_blocks.{}.norm.linear": "single_blocks.{}.modulation.lin",
    "single_transformer_blocks.{}.attn.norm_q": "single_blocks.{}.norm.query_norm",
    "single_transformer_blocks.{}.attn.norm_k": "single_blocks.{}.norm.key_norm",
    "single_transformer_blocks.{}.proj_out": "single_blocks.{}.linear2",
}

# BFL fused linear -> the diffusers linears concatenated into it, in order.
_CONCATS = {
    "double_blocks.{}.img_attn.qkv": ["transformer_blocks.{}.attn.to_q", "transformer_blocks.{}.attn.to_k",
                                      "transformer_blocks.{}.attn.to_v"],
    "double_blocks.{}.txt_attn.qkv": ["transformer_blocks.{}.attn.add_q_proj",
                                      "transformer_blocks.{}.attn.add_k_proj",
                                      "transformer_blocks.{}.attn.add_v_proj"],
    "single_blocks.{}.linear1": ["single_transformer_blocks.{}.attn.to_q",
                                 "single_transformer_blocks.{}.attn.to_k",
                                 "single_transformer_blocks.{}.attn.to_v",
                                 "single_transformer_blocks.{}.proj_mlp"],
}
_CONCAT_PART = {part: (fused, i) for fused, parts in _CONCATS.items() for i, part in enumerate(parts)}

_SWAPPED_HALVES = "norm_out.linear"  # (scale, shift) in diffusers -> final_layer.adaLN_modulation.1


def _split_key(key: str) -> tuple[str, str, str | None]:
    """'transformer_blocks.3.attn.to_q.weight' -> ('transformer_blocks.{}.attn.to_q', 'weight', '3')."""
    module, _, leaf = key.rpartition(".")
    match = re.match(r"^(\w+_blocks)\.(\d+)\.(.+)$", module)
    if match:
        return f"{match[1]}.{{}}.{match[3]}", leaf, match[2]
    return module, leaf, None


def diffusers_to_bfl(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Convert a diffusers FluxTransformer2DModel state dict to one `Flux.load_state_dict` accepts.

    Tensors are shared where a rename suffices and concatenated (new tensors) where BFL fuses.
    Raises ValueError naming any key it does not know or any fused linear with missing parts.
    """
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[int, Tensor]] = {}
    unknown = []
    for key, value in state_dict.items():
        module, leaf, index = _split_key(key)
        if module == _SWAPPED_HALVES:
            scale, shift = value.chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale], dim=0)
        elif module in _RENAMES:
            target = _RENAMES[module]
            if target.endswith(("query_norm", "key_norm")) and leaf == "weight":
                leaf = "scale"  # BFL's RMSNorm parameter
            out[f"{target.format(index)}.{leaf}"] = value
        elif module in _CONCAT_PART:
            fused, position = _CONCAT_PART[module]
            parts.setdefault(f"{fused.format(index)}.{leaf}", {})[position] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"diffusers_to_bfl: {len(unknown)} key(s) with no BFL counterpart "
                         f"(not a FluxTransformer2DModel state dict?): {unknown[:8]}")

    for key, pieces in parts.items():
        fused, leaf, index = _split_key(key)
        sources = [f"{name.format(index)}.{leaf}" for name in _CONCATS[fused]]
        missing = [src for i, src in enumerate(sources) if i not in pieces]
        if missing:
            raise ValueError(f"diffusers_to_bfl: {key} concatenates {sources}; missing {missing}")
        out[key] = torch.cat([pieces[i] for i in range(len(sources))], dim=0)
    return out


def bfl_linear_to_diffusers(name: str, out_features: int, split: dict[str, tuple[int, ...]]
                            ) -> list[tuple[str, tuple[slice, ...]]]:
    """The diffusers linear(s) holding BFL linear `name`'s output rows: [(diffusers name, the BFL
    output rows it holds, in its order, as slices to concatenate)]. One entry for a rename; one per
    part for a fused linear, whose part sizes `split` gives by kind ("qkv": q, k, v; "linear1": q, k,
    v, MLP in); the final layer's modulation with its two halves swapped. Raises ValueError for a
    name with no diffusers counterpart."""
    match = re.match(r"^(\w+_blocks)\.(\d+)\.(.+)$", name)
    module, index = (f"{match[1]}.{{}}.{match[3]}", match[2]) if match else (name, None)
    if module == "final_layer.adaLN_modulation.1":  # (shift, scale) here, (scale, shift) in diffusers
        half = out_features // 2
        return [(_SWAPPED_HALVES, (slice(half, out_features), slice(0, half)))]
    if module in _CONCATS:
        sizes = split["linear1" if module.startswith("single") else "qkv"]
        if sum(sizes) != out_features:
            raise ValueError(f"{name}: {out_features} output rows, but its parts are {sizes}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [(part.format(index), (slice(start, start + size),))
                for part, start, size in zip(_CONCATS[module], starts, sizes)]
    renamed = {bfl: diffusers for diffusers, bfl in _RENAMES.items()}
    if module not in renamed or renamed[module].endswith(("norm_q", "norm_k", "norm_added_q", "norm_added_k")):
        raise ValueError(f"{name}: not a linear of Flux with a diffusers counterpart")
    return [(renamed[module].format(index), (slice(0, out_features),))]
