"""LoRA adapter files: what a run's adapters are saved as, and how any Flux LoRA file is read back.

The layout is diffusers' own (peft's key names under the `transformer.` prefix, what
`FluxPipeline.save_lora_weights` writes), which `FluxPipeline.load_lora_weights` loads as it is and
ComfyUI's LoRA loader maps onto BFL's modules: for each linear

    transformer.<diffusers module>.lora_A.weight   [rank, in]    (down)
    transformer.<diffusers module>.lora_B.weight   [out, rank]   (up, times alpha / rank)

An adapter on one of BFL's fused linears (a block's qkv, a single block's linear1) is written as
one adapter per diffusers part: the same A for each, B split by output rows, which is the same
update. alpha / rank is folded into B, so every loader applies the file at scale 1 whatever it
assumes about alpha; the rank and alpha trained with are in the metadata, with the base model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from .configs import FluxConfig
from .convert import bfl_linear_to_diffusers
from .weights import model_shapes

__all__ = ["LoRAFileError", "load_lora_deltas", "read_lora_metadata", "save_lora_file"]

PREFIX = "transformer."
_KEY = re.compile(r"^transformer\.(.+)\.lora_([AB])\.weight$")


class LoRAFileError(ValueError):
    """A LoRA file that cannot be read or does not fit the model."""


def _splits(config: FluxConfig) -> dict[str, tuple[int, ...]]:
    h = config.hidden_size
    return {"qkv": (h, h, h), "linear1": (h, h, h, int(h * config.mlp_ratio))}


def save_lora_file(path: str | Path, adapters: Mapping[str, tuple[Tensor, Tensor, float]], config: FluxConfig,
                   metadata: Mapping[str, str], dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write adapters {BFL linear name: (down [rank, in], up [out, rank], scale)} as a diffusers-layout
    safetensors file (atomically: a temporary file renamed into place), in `dtype`, with `metadata`
    (strings) added to the rank, alpha and layout keys."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    for name, (down, up, scale) in adapters.items():
        up_scaled = up.detach().float() * scale
        for target, rows in bfl_linear_to_diffusers(name, up.shape[0], _splits(config)):
            tensors[f"{PREFIX}{target}.lora_A.weight"] = down.detach().to(dtype).cpu().clone()  # one per part
            tensors[f"{PREFIX}{target}.lora_B.weight"] = torch.cat([up_scaled[r] for r in rows]).to(dtype).cpu()
    meta = {"format": "pt", "lora_layout": "diffusers (peft keys, transformer. prefix); alpha/rank folded into lora_B",
            **{k: str(v) for k, v in metadata.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def _diffusers_linears(config: FluxConfig) -> dict[str, tuple[str, tuple[int, int], tuple[slice, ...]]]:
    """diffusers linear name -> (the BFL linear holding it, that linear's weight shape, its rows there):
    `bfl_linear_to_diffusers` inverted over every linear of the model."""
    out = {}
    for name, shape in model_shapes(config).items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        bfl = name[:-len(".weight")]
        for target, rows in bfl_linear_to_diffusers(bfl, shape[0], _splits(config)):
            out[target] = (bfl, shape, rows)
    return out


def load_lora_deltas(path: str | Path, config: FluxConfig, scale: float = 1.0) -> Iterator[tuple[str, Tensor]]:
    """(BFL linear name, fp32 weight update [out, in]) for each linear a diffusers-layout LoRA file
    adapts (ours, `save_lora_file`, or any other with peft's key names; alphas assumed folded, as
    diffusers does when it saves), times `scale`; one linear at a time, so merging them costs one
    weight's update of memory. LoRAFileError names the file and the key that does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise LoRAFileError(f"{path}: not a readable safetensors file ({e})") from None
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if not match:
            raise LoRAFileError(f"{path}: key {key!r} is not a diffusers-layout LoRA key "
                                f"(transformer.<module>.lora_A.weight / lora_B.weight)")
        pairs.setdefault(match[1], {})[match[2]] = value
    linears = _diffusers_linears(config)
    grouped: dict[str, list[tuple[str, dict[str, Tensor]]]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAFileError(f"{path}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        if module not in linears:
            raise LoRAFileError(f"{path}: {module} is not a linear of FLUX.1's transformer")
        grouped.setdefault(linears[module][0], []).append((module, ab))
    for bfl, parts in grouped.items():
        delta = None
        for module, ab in parts:  # each part's update into its rows of the BFL linear (a part without one: none)
            _, shape, rows = linears[module]
            update = ab["B"].float() @ ab["A"].float()
            if update.shape != (sum(r.stop - r.start for r in rows), shape[1]):
                raise LoRAFileError(f"{path}: {module}'s update is {tuple(update.shape)}, which does not fit "
                                    f"{bfl} {shape} of this model")
            delta = torch.zeros(shape) if delta is None else delta
            start = 0
            for r in rows:
                delta[r] = update[start:start + r.stop - r.start]
                start += r.stop - r.start
        yield bfl, delta * scale


def read_lora_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a safetensors file (rank, alpha, base model, ... for ours)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})
