"""Released Flux checkpoints (BFL single files, diffusers folders) as BFL-named tensors for `Flux`.

Layouts, detected from the path and the tensor names (never configured):
- a BFL single file (`flux1-schnell.safetensors`, `flux1-dev.safetensors`): BFL names already;
  ComfyUI-style files whose names all carry `model.diffusion_model.` load with the prefix removed;
- a diffusers `transformer/` folder: one `*.safetensors` file, or the shards its
  `*.safetensors.index.json` lists; names and layouts converted by `diffusers_to_bfl`;
- a diffusers pipeline folder (`model_index.json`, `transformer/`, `vae/`, ...): its `transformer/`.

Nothing is read twice and nothing whole is copied: safetensors files are memory-mapped (a tensor's
bytes are read from disk when touched), shapes come from the files' headers alone (so a checkpoint
is checked against a model config without reading a tensor), and diffusers checkpoints are
converted one transformer block at a time (only the fused qkv / linear1 of that block are new
tensors). `init_from_checkpoint` copies into a model's parameters by name; under FSDP2 each rank
reads and copies just the rows of its own shards.

Strictness: a checkpoint must be exactly the state dict of some `FluxConfig`. Missing, unexpected
or mis-shaped tensors are an error that names them and the config fields the checkpoint has
(`infer_flux_config`) next to the ones the model was given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from .configs import FLUX_CONFIGS, FluxConfig
from .convert import diffusers_to_bfl
from .flux import Flux

__all__ = ["FluxCheckpoint", "FluxWeightsError", "block_of", "check_flux_weights", "flux_from_checkpoint", "model_shapes",
           "infer_flux_config", "init_from_checkpoint", "load_flux_weights"]

_BFL_PREFIX = "model.diffusion_model."  # ComfyUI's single files wrap BFL names in this
_DIFFUSERS_MARKERS = ("x_embedder.", "transformer_blocks.", "single_transformer_blocks.", "time_text_embed.")
# FluxConfig fields a state dict determines; axes_dim and theta (RoPE) have no tensors.
_SHAPE_FIELDS = ("in_channels", "out_channels", "vec_in_dim", "context_in_dim", "hidden_size", "mlp_ratio",
                 "num_heads", "depth", "depth_single_blocks", "qkv_bias", "guidance_embed")
_LISTED = 8  # names shown per kind of mismatch


class FluxWeightsError(ValueError):
    """A checkpoint that cannot be read, or does not fit the model; the message says which tensors."""


# --------------------------------------------------------------------------- finding the files

def _read_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header (8-byte length, then JSON), reading no tensor."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= file.stat().st_size - 8:
            raise FluxWeightsError(f"{file}: not a safetensors file (header length {size})")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise FluxWeightsError(f"{file}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return {name: tuple(entry["shape"]) for name, entry in header.items()}


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the transformer at `path` (a file, a transformer/ or pipeline folder)."""
    if not path.exists():
        raise FluxWeightsError(f"{path}: no such file or directory (expected a BFL .safetensors file, "
                               f"a diffusers transformer/ folder or a diffusers pipeline folder)")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FluxWeightsError(f"{path}: expected a .safetensors file (BFL single file) or a diffusers "
                                   f"folder, got a {path.suffix or 'suffix-less'} file")
        return [path]
    if (path / "transformer").is_dir():  # a pipeline: the transformer is one of its components
        path = path / "transformer"
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise FluxWeightsError(f"{path}: several shard indexes {[p.name for p in indexes]}; keep one")
    if indexes:
        weight_map = json.loads(indexes[0].read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FluxWeightsError(f"{indexes[0]}: no 'weight_map' of tensor name -> shard file")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FluxWeightsError(f"{indexes[0]} lists shards that are not in {path}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        found = f"several ({[f.name for f in files]}) and no *.safetensors.index.json" if files else "none"
        raise FluxWeightsError(f"{path}: expected one .safetensors file or a sharded set with its "
                               f"*.safetensors.index.json; found {found}")
    return files


def block_of(name: str) -> str:
    """The unit converted at once: 'transformer_blocks.3' for its tensors, '' for the rest."""
    match = re.match(r"^(\w+_blocks\.\d+)\.", name)
    return match[1] if match else ""


class FluxCheckpoint:
    """An opened Flux checkpoint: BFL names and shapes from the headers; tensors read on demand.

    `layout` is "bfl" or "diffusers"; `shapes` maps every BFL name to its shape; `blocks()` yields
    the BFL tensors one block at a time (memory-mapped, or fused for diffusers' split linears).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = _weight_files(self.path)
        self._source_shapes: dict[str, tuple[int, ...]] = {}
        self._file_of: dict[str, Path] = {}
        for file in self.files:
            for name, shape in _read_header(file).items():
                if name in self._file_of:
                    raise FluxWeightsError(f"{self.path}: tensor {name!r} is in both {self._file_of[name].name} "
                                           f"and {file.name}")
                self._source_shapes[name], self._file_of[name] = shape, file
        if not self._source_shapes:
            raise FluxWeightsError(f"{self.path}: the checkpoint holds no tensors")
        names = list(self._source_shapes)
        self.layout = "diffusers" if any(n.startswith(_DIFFUSERS_MARKERS) for n in names) else "bfl"
        self._prefix = _BFL_PREFIX if self.layout == "bfl" and all(n.startswith(_BFL_PREFIX) for n in names) else ""
        if self.layout == "diffusers":
            # The conversion itself, on meta tensors: BFL shapes without reading a byte.
            meta = {n: torch.empty(s, device="meta") for n, s in self._source_shapes.items()}
            try:
                self.shapes = {n: tuple(t.shape) for n, t in diffusers_to_bfl(meta).items()}
            except ValueError as e:
                raise FluxWeightsError(f"{self.path}: {e}") from None
        else:
            self.shapes = {n[len(self._prefix):]: s for n, s in self._source_shapes.items()}

    def __repr__(self) -> str:
        return f"FluxCheckpoint({str(self.path)!r}, layout={self.layout!r}, {len(self.files)} file(s))"

    def blocks(self) -> Iterator[dict[str, Tensor]]:
        """BFL name -> tensor, one transformer block (then the embedders and final layer) at a time."""
        from safetensors.torch import load_file

        # load_file maps each file; its tensors are views of the mapping until something copies them.
        tensors: dict[str, Tensor] = {}
        for file in self.files:
            tensors.update(load_file(file))
        groups: dict[str, list[str]] = {}
        for name in tensors:
            groups.setdefault(block_of(name[len(self._prefix):]), []).append(name)
        for names in groups.values():
            part = {name[len(self._prefix):]: tensors[name] for name in names}
            yield diffusers_to_bfl(part) if self.layout == "diffusers" else part

    def infer_config(self, like: FluxConfig | None = None) -> FluxConfig:
        return infer_flux_config(self.shapes, like=like, source=str(self.path))


# --------------------------------------------------------------------------- what the weights say

def _shape_of(value) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, Tensor) else tuple(value)


def infer_flux_config(state: Mapping[str, Tensor | tuple[int, ...]], *, like: FluxConfig | None = None,
                      source: str = "checkpoint") -> FluxConfig:
    """The FluxConfig whose `Flux` has these BFL names and shapes (`state`: tensors or shapes).

    The weights fix every field but RoPE's `axes_dim` and `theta`, which have no tensors: those
    come from `like` when its head dim fits, else from a built-in config of the same head dim.
    """
    shapes = {name: _shape_of(v) for name, v in state.items()}
    needed = ["img_in.weight", "txt_in.weight", "vector_in.in_layer.weight", "final_layer.linear.weight"]
    missing = [n for n in needed if n not in shapes]
    blocks = {kind: sorted({int(m[1]) for n in shapes if (m := re.match(rf"^{kind}\.(\d+)\.", n))})
              for kind in ("double_blocks", "single_blocks")}
    if blocks["double_blocks"]:
        needed += ["double_blocks.0.img_attn.norm.query_norm.scale", "double_blocks.0.img_mlp.0.weight"]
    elif blocks["single_blocks"]:
        needed += ["single_blocks.0.norm.query_norm.scale", "single_blocks.0.linear1.weight"]
    else:
        missing.append("double_blocks.* or single_blocks.*")
    missing += [n for n in needed[4:] if n not in shapes]
    if missing:
        raise FluxWeightsError(f"{source}: not a Flux state dict; it has no {missing}")
    for kind, indices in blocks.items():
        if indices != list(range(len(indices))):
            raise FluxWeightsError(f"{source}: {kind} indices {indices} are not 0..{len(indices) - 1}")

    hidden, in_channels = shapes["img_in.weight"]
    if blocks["double_blocks"]:
        head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        mlp_hidden = shapes["double_blocks.0.img_mlp.0.weight"][0]
    else:
        head_dim = shapes["single_blocks.0.norm.query_norm.scale"][0]
        mlp_hidden = shapes["single_blocks.0.linear1.weight"][0] - 3 * hidden
    if hidden % head_dim:
        raise FluxWeightsError(f"{source}: hidden size {hidden} is not a multiple of the head dim {head_dim}")

    if like is not None and sum(like.axes_dim) == head_dim:
        rope = dict(axes_dim=like.axes_dim, theta=like.theta)
    else:
        known = [c for c in FLUX_CONFIGS.values() if c.head_dim == head_dim]
        if not known:
            raise FluxWeightsError(f"{source}: head dim {head_dim} matches no built-in config, and RoPE's "
                                   f"axes_dim is not stored in weights; pass a config (e.g. --model) whose "
                                   f"axes_dim sums to {head_dim}")
        rope = dict(axes_dim=known[0].axes_dim, theta=known[0].theta)
    return FluxConfig(
        in_channels=in_channels, out_channels=shapes["final_layer.linear.weight"][0],
        vec_in_dim=shapes["vector_in.in_layer.weight"][1], context_in_dim=shapes["txt_in.weight"][1],
        hidden_size=hidden, mlp_ratio=mlp_hidden / hidden, num_heads=hidden // head_dim,
        depth=len(blocks["double_blocks"]), depth_single_blocks=len(blocks["single_blocks"]),
        qkv_bias=("double_blocks.0.img_attn.qkv.bias" in shapes if blocks["double_blocks"]
                  else like.qkv_bias if like is not None else True),  # no double block: unused
        guidance_embed="guidance_in.in_layer.weight" in shapes, **rope)


def model_shapes(config: FluxConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `Flux(config)` and its shape."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return {name: tuple(p.shape) for name, p in Flux(config).named_parameters()}


def _natural(name: str) -> list:
    """Sort key putting 'blocks.2' before 'blocks.10'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _recipe_hint(fits: FluxConfig) -> str:
    """The recipe settings that describe `fits`: the nearest built-in name and its differing fields."""
    def differing(config: FluxConfig) -> dict:
        return {f: getattr(fits, f) for f in _SHAPE_FIELDS if getattr(config, f) != getattr(fits, f)}

    name = min(FLUX_CONFIGS, key=lambda n: len(differing(FLUX_CONFIGS[n])))
    sets = [f"model.name={name}"] + [f"model.overrides.{f}={json.dumps(v)}"
                                     for f, v in differing(FLUX_CONFIGS[name]).items()]
    return " ".join(f"--set {s}" for s in sets)


def check_flux_weights(shapes: Mapping[str, tuple[int, ...]], config: FluxConfig, *,
                       source: str = "checkpoint") -> None:
    """Raise FluxWeightsError unless `shapes` (BFL name -> shape) are exactly `Flux(config)`'s.

    The message lists missing, unexpected and mis-shaped tensors, the FluxConfig fields in which
    the checkpoint differs from `config`, and the recipe settings that would fit it.
    """
    expected = model_shapes(config)
    missing = [n for n in expected if n not in shapes]
    unexpected = [n for n in shapes if n not in expected]
    wrong = [f"{n} {list(shapes[n])} (model: {list(expected[n])})" for n in expected
             if n in shapes and tuple(shapes[n]) != expected[n]]
    if not (missing or unexpected or wrong):
        return
    lines = [f"{source} does not fit the model config:"]
    try:
        fits = infer_flux_config(shapes, like=config, source=source)
    except FluxWeightsError as e:
        lines.append(f"  it is no FluxConfig's state dict: {e}")
    else:
        fields = [f"{f}={getattr(fits, f)!r} (model: {getattr(config, f)!r})" for f in _SHAPE_FIELDS
                  if getattr(fits, f) != getattr(config, f)]
        if fields:
            lines.append(f"  FluxConfig fields of the checkpoint: {', '.join(fields)}")
            lines.append(f"  a recipe that fits it: {_recipe_hint(fits)}")
    for label, names, owner in (("missing from the checkpoint", missing, expected),
                                ("unexpected in the checkpoint", unexpected, shapes)):
        if names:
            shown = _collapse_blocks(names, owner)
            more = f" and {len(shown) - _LISTED} more" if len(shown) > _LISTED else ""
            lines.append(f"  {label} ({len(names)}): {', '.join(shown[:_LISTED])}{more}")
    if wrong:
        more = f" and {len(wrong) - _LISTED} more" if len(wrong) > _LISTED else ""
        lines.append(f"  wrong shape ({len(wrong)}): {', '.join(sorted(wrong, key=_natural)[:_LISTED])}{more}")
    raise FluxWeightsError("\n".join(lines))


def _collapse_blocks(names: list[str], owner: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Names sorted, a block whose every tensor is listed shown once as 'double_blocks.2.*'."""
    listed = set(names)
    per_block: dict[str, list[str]] = {}
    for name in owner:
        per_block.setdefault(block_of(name), []).append(name)
    shown = []
    for name in sorted(names, key=_natural):
        block = block_of(name)
        if block and all(n in listed for n in per_block[block]):
            entry = f"{block}.* ({len(per_block[block])} tensors)"
            if entry not in shown:
                shown.append(entry)
        else:
            shown.append(name)
    return shown


# --------------------------------------------------------------------------- loading

def load_flux_weights(path: str | Path, config: FluxConfig | None = None) -> dict[str, Tensor]:
    """BFL-named tensors of the Flux checkpoint at `path` (format detected), for `Flux.load_state_dict`.

    Strict: the checkpoint must be exactly `Flux(config)`'s state dict (default: the config its
    shapes imply, `infer_flux_config`). Tensors stay memory-mapped where BFL keeps diffusers'
    layout; diffusers' split q/k/v (and single-block MLP-in) are concatenated into new tensors.
    """
    checkpoint = FluxCheckpoint(path)
    check_flux_weights(checkpoint.shapes, config or checkpoint.infer_config(), source=str(checkpoint.path))
    return {name: tensor for block in checkpoint.blocks() for name, tensor in block.items()}


def _copy_into(param: Tensor, full: Tensor) -> None:
    """Copy a whole checkpoint tensor into a parameter; for a DTensor, only this rank's slice is read."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        full = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        param = param.to_local()
    param.copy_(full)  # converts dtype and device; reads just the mapped pages of `full` it needs


@torch.no_grad()
def init_from_checkpoint(model: nn.Module, path: str | Path) -> FluxCheckpoint:
    """Overwrite every parameter of a `Flux` (any precision, plain or FSDP2/DDP-wrapped) from `path`.

    Validates names and shapes against `model.config` before touching the model. Works on a
    model materialised with `to_empty` after meta-device construction (every parameter is
    written) and, under FSDP2, reads only the rows of each rank's shards. Returns the checkpoint.
    """
    flux = getattr(model, "module", model)  # DDP keeps the Flux as .module
    if not isinstance(getattr(flux, "config", None), FluxConfig):
        raise TypeError(f"init_from_checkpoint: expected a Flux model, got {type(model).__name__}")
    checkpoint = FluxCheckpoint(path)
    check_flux_weights(checkpoint.shapes, flux.config, source=str(checkpoint.path))
    params = dict(flux.named_parameters())
    if set(params) != set(checkpoint.shapes):  # a module renamed by a precision converter
        raise FluxWeightsError(f"{checkpoint.path}: the model's parameter names differ from Flux's: "
                               f"{sorted(set(params) ^ set(checkpoint.shapes))[:_LISTED]}")
    for block in checkpoint.blocks():
        for name, tensor in block.items():
            _copy_into(params[name], tensor)
    return checkpoint


@torch.no_grad()
def flux_from_checkpoint(path: str | Path, config: FluxConfig | None = None, *,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Flux:
    """A `Flux` holding the checkpoint at `path`, in `dtype` on `device`, built without random init.

    `config` defaults to the one the weights imply (`infer_flux_config`); a given one must fit them.
    """
    checkpoint = FluxCheckpoint(path)
    config = config or checkpoint.infer_config()
    check_flux_weights(checkpoint.shapes, config, source=str(checkpoint.path))
    with torch.device("meta"):
        model = Flux(config)
    model = model.to(dtype).to_empty(device=device)  # allocated once, in the final dtype
    for block in checkpoint.blocks():
        for name, tensor in block.items():
            model.get_parameter(name).copy_(tensor)
    return model
