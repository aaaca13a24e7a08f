"""The run configuration: a typed schema for recipes, with clear errors and key=value overrides.

A recipe is a YAML file (built-in ones live in `mxflux/recipes/`). Every section forbids
unknown keys, so a typo is an error naming the key, never a silently ignored setting; the
precision block is `mxflux.nn.PrecisionConfig`, which refuses wrong-precision combinations.
"""

from __future__ import annotations

import difflib
import string
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..nn.precision import PrecisionConfig
from ..nn.precision.default_layers import DEFAULT_PRECISION_INCLUDE

__all__ = ["RunConfig", "RecipeError", "load_recipe", "config_from_dict", "recipe_names", "recipe_descriptions",
           "apply_overrides"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeptBlocks(_Section):
    """How many blocks of each kind, counted from the first, `blocks_keeping_gemm_outputs` names."""
    double: int = Field(0, ge=0)
    single: int = Field(0, ge=0)


class ModelSection(_Section):
    name: str = "flux-tiny"  # a name from mxflux.model.FLUX_CONFIGS
    # Fields of that FluxConfig to replace, e.g. {depth: 4, depth_single_blocks: 8} (studies, benchmarks)
    overrides: dict[str, bool | int | float] = {}  # bool first: guidance_embed: true stays a bool
    compile: bool = False  # torch.compile each transformer block
    # torch.compile's mode for those blocks; "reduce-overhead" replays them as CUDA graphs (fewer
    # host launches and inter-kernel bubbles; not yet measured here, see benchmarks/NOTES.md)
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    # Activation checkpointing of the transformer blocks (docs/design.md, "The three GEMMs and their
    # operands"): "none" keeps every block's activations for backward; "full" keeps only each
    # block's inputs and runs the block's forward again in backward; "attention" is "full" keeping
    # attention's outputs too (2 B per token and channel), so backward runs everything again but
    # attention (mxflux.nn.recompute.full_recompute_context); "mx_packers" (needs
    # compile: true) keeps what the compiled block keeps except the FP8 column operands Xᵀ of its
    # MX linears' activations, whose packer calls run again in backward from bf16 tensors kept
    # anyway (a single block's linear2 input is rebuilt for it; mxflux.nn.recompute): with
    # precision.repack_weights the H200 proxy's peak is below FP8's (benchmarks/RESULTS.md);
    # "elementwise" (needs compile: true) keeps only the outputs of the GEMMs and of attention
    # and recomputes everything else in backward, the MX packer calls, norms, RoPE, GELU and the
    # gates included: less memory than mx_packers, in any precision, for more recompute.
    # "mx_inputs" (needs compile: true) keeps no Xᵀ of the MX linears whose input backward can rebuild
    # from what it keeps anyway (attention's proj, the MLP's fc2, a single block's linear2): their
    # inputs are rebuilt in backward and packed again; no packer call runs twice
    # (mxflux.train.parallelize.mx_repacked_inputs).
    # The booleans of older recipes still work: true is "full", false "none".
    activation_checkpointing: Literal["none", "full", "attention", "mx_packers", "elementwise", "mx_inputs"] = "none"
    # Under "full" or "attention", the first `double` double and `single` single blocks also keep
    # their linears' GEMM outputs, so backward does not run those GEMMs again: memory a card has
    # left bought back as speed (a single block's, per byte, buys back the most: the LoRA recipes)
    blocks_keeping_gemm_outputs: KeptBlocks = KeptBlocks()
    # Released weights to start from (mxflux.model.load_flux_weights): a BFL .safetensors file, a
    # diffusers transformer/ folder or pipeline folder; None: the MLPerf random initialisation.
    # `mxflux check-config` checks it against this section's FluxConfig from the file headers.
    init_from: str | None = None

    def flux_config(self):
        """The FluxConfig this section describes: the named config with `overrides` applied."""
        from ..model import flux_config

        return flux_config(self.name, **self.overrides)

    @model_validator(mode="after")
    def _valid_overrides(self) -> "ModelSection":
        try:
            self.flux_config()
        except (TypeError, ValueError) as e:
            raise ValueError(f"overrides: {e}") from None
        return self

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _from_bool(cls, value):
        # before this field had modes it was a bool (recipes, checkpoints' saved configs, --set ...=true)
        if isinstance(value, bool):
            return "full" if value else "none"
        return value

    @model_validator(mode="after")
    def _selective_compiled(self) -> "ModelSection":
        mode = self.activation_checkpointing
        if mode in ("mx_packers", "elementwise", "mx_inputs") and not self.compile:
            # Eager selective checkpointing would save every other op's output and run the packer
            # calls again with their fold-window count (counted twice); see mxflux.nn.recompute.
            raise ValueError(f"activation_checkpointing: {mode} needs model.compile: true (the "
                             "selective recompute is the compiled partitioner's); set "
                             "model.compile=true or use activation_checkpointing: full")
        return self

    @model_validator(mode="after")
    def _kept_blocks_exist(self) -> "ModelSection":
        kept, config = self.blocks_keeping_gemm_outputs, self.flux_config()
        if (kept.double or kept.single) and self.activation_checkpointing not in ("full", "attention"):
            raise ValueError(f"blocks_keeping_gemm_outputs: applies under activation_checkpointing full or "
                             f"attention, got {self.activation_checkpointing!r} (set it to "
                             "{double: 0, single: 0} or change the mode)")
        for field, n, depth in (("double", kept.double, config.depth), ("single", kept.single,
                                                                          config.depth_single_blocks)):
            if n > depth:
                raise ValueError(f"blocks_keeping_gemm_outputs.{field}: {n} is more than the model's {depth} "
                                 f"{field} blocks")
        return self

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from ..model import FLUX_CONFIGS

        if name not in FLUX_CONFIGS:
            raise ValueError(f"unknown model {name!r}; expected one of {sorted(FLUX_CONFIGS)}")
        return name


class DataSection(_Section):
    root: str | None = None  # dataset directory (docs/DATA_FORMAT.md); None = the built-in demo
    num_workers: int = Field(2, ge=0)
    prefetch_factor: int = Field(4, ge=1)
    cfg_dropout: float = Field(0.1, ge=0.0, le=1.0)  # per-sample drop to the empty encodings


class OptimSection(_Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)  # linear warm-up, then constant (MLPerf reference)
    # After the warm-up: "none" keeps the LR constant (MLPerf reference); "cosine" / "linear" decay
    # it over the run's last `decay_steps` steps (None: every step after the warm-up) towards
    # lr·min_lr_ratio, reached where the run ends (the last step takes a little more).
    decay: Literal["none", "cosine", "linear"] = "none"
    decay_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    grad_clip: float = Field(1.0, gt=0)
    # Clipping by the gradients' total norm: true applies the factor inside the optimizer's own pass
    # over the gradients (equal to torch's clip_grad_norm_ then step up to fp32 rounding where it
    # clips); false runs torch's separate pass and torch's kernel (train.clipping).
    clip_in_optimizer: bool = True
    # AdamW kernels: "fused" is torch's, one kernel per dtype/device group (about half the memory
    # traffic of "foreach", which launches one kernel per update term); "auto" is fused, with our
    # Triton kernel for the large fp32 parameters on CUDA (train.optimizer, train.adamw_cuda).
    implementation: Literal["auto", "foreach", "fused"] = "auto"


class BatchSection(_Section):
    global_batch_size: int = Field(32, ge=1)
    micro_batch_size: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _divisible(self) -> "BatchSection":
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size}"
            )
        return self

    def accumulation_steps(self, world_size: int = 1) -> int:
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:  # a recipe error: the command says so in one line
            raise RecipeError(
                f"batch.global_batch_size {self.global_batch_size} is not divisible by "
                f"micro_batch_size × world size = {self.micro_batch_size} × {world_size}"
            )
        return self.global_batch_size // per_step


class TrainSection(_Section):
    train_samples: int = Field(4096, ge=1)  # stop after this many training samples
    eval_every_samples: int = Field(1024, ge=1)
    eval_samples: int | None = Field(None, ge=1)  # None: the whole eval split
    eval_batch_size: int = Field(64, ge=1)
    seed: int = 0
    log_every: int = Field(10, ge=1)  # optimizer steps between logged metrics
    checkpoint_every: int | None = Field(None, ge=1)  # optimizer steps; None: only at the end
    out_dir: str = "runs/{name}"
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    sample_prompts: tuple[str, ...] = ()
    sample_steps: int = Field(20, ge=1)
    sample_guidance: float = Field(1.0, ge=0.0)  # classifier-free guidance scale for samples (1 = none)
    # The guidance input of a guidance-distilled model (FLUX.1-dev: guidance_embed), fed in training,
    # evaluation and the run's samples (mxflux.train.guidance). Required for such a model; refused for
    # any other, which has no such input.
    distilled_guidance: float | None = Field(None, ge=0.0)
    # Training times t ~ U(0, 1) moved towards the noise: s·t / (1 + (s − 1)·t) (1 = none; SD3, Flux)
    timestep_shift: float = Field(1.0, gt=0.0)
    # The sampler's time grid, shifted the same way; None: timestep_shift
    sample_shift: float | None = Field(None, gt=0.0)
    # An exponential moving average of the weights (mxflux.train.ema), kept in checkpoints; the
    # run's samples.png and `mxflux sample` draw with it. Decay per step min(ema_decay, (1+n)/(10+n))
    # after step n; None: no average.
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)
    # Capture the optimizer step (forward, backward, clipping, AdamW) once as a CUDA graph and
    # replay it (mxflux.train.captured): no host work per op, for small micro-batches where the
    # host is what a step waits on. One process on a CUDA device; the losses are those of the
    # eager step up to AdamW's bias corrections, which are then taken on the device in fp32.
    cuda_graph: bool = False

    @field_validator("out_dir")
    @classmethod
    def _out_dir_template(cls, v: str) -> str:
        """The run directory may name the recipe as {name}, nothing else (a typo would be a KeyError at the
        run's start, an unbalanced brace a ValueError)."""
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None]
        except ValueError as e:
            raise ValueError(f"{v!r} is not a valid template ({e}); write {{{{ and }}}} for literal braces") from None
        bad = [f for f in fields if f != "name"]
        if bad:
            raise ValueError(f"{v!r} names {{{bad[0]}}}; the only placeholder is {{name}} (the recipe's name)")
        return v

    @property
    def sampler_shift(self) -> float:
        return self.timestep_shift if self.sample_shift is None else self.sample_shift


class DistributedSection(_Section):
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    ddp_bucket_mb: float = Field(25.0, gt=0)
    fsdp_reshard_after_forward: bool = True
    # FSDP2's communication granularity: consecutive transformer blocks (of one kind) that share
    # one unit, i.e. one parameter all-gather and one gradient reduce-scatter. Larger units mean
    # fewer, bigger collectives and more unsharded parameters alive at once (the analogue of the
    # seed's ddp_bucket_size sweep; benchmarks/sweep_comm.py).
    fsdp_blocks_per_unit: int = Field(1, ge=1)
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"


class MLPerfSection(_Section):
    enabled: bool = False  # write an MLPerf log (mlperf.log) and stop at the target
    target_eval_loss: float = Field(0.586, gt=0)  # flux1 convergence target (closed division)
    warmup_steps: int = Field(0, ge=0)  # untimed steps before run_start; they leave no trace
    submission_org: str = "mxflux"
    submission_platform: str | None = None  # default: "<world>x<device name>"


# Fields that moved from `optim` to `precision` (MXFP6's options), migrated on load.
MOVED_TO_PRECISION = ("weight_exponents_in_optimizer", "weight_operands_in_optimizer")


class LoraSection(_Section):
    """Train low-rank adapters on a frozen base instead of the model itself (docs/design.md, "LoRA on
    a frozen MXFP6 base"). Unset (`lora: null`): the whole model trains."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input; its draws come from torch's RNG
    # Which linears get adapters: fnmatch patterns over module names, as precision.include; by default
    # the ones MXFP6 runs (attention and MLP linears of every block).
    include: tuple[str, ...] = DEFAULT_PRECISION_INCLUDE
    exclude: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _some(self) -> "LoraSection":
        if not self.include:
            raise ValueError("lora.include: empty, so no linear would get an adapter; leave it out for the "
                             "attention and MLP linears")
        return self


class RunConfig(_Section):
    name: str
    description: str = ""
    model: ModelSection = ModelSection()
    precision: PrecisionConfig = PrecisionConfig()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    batch: BatchSection = BatchSection()
    train: TrainSection = TrainSection()
    distributed: DistributedSection = DistributedSection()
    mlperf: MLPerfSection = MLPerfSection()
    lora: LoraSection | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.train.out_dir.format(name=self.name))

    @model_validator(mode="before")
    @classmethod
    def _moved_to_precision(cls, data):
        """Recipes and checkpoints written before the MX weights' optimizer flags moved from
        `optim` to `precision` (they are options of MXFP6) still load: the value moves with them;
        under another precision, where it never did anything, it is dropped."""
        if not isinstance(data, dict) or not isinstance(data.get("optim"), dict):
            return data
        optim = dict(data["optim"])
        moved = {k: optim.pop(k) for k in MOVED_TO_PRECISION if k in optim}
        if not moved:
            return data
        precision = data.get("precision") or {}
        if not isinstance(precision, dict):
            return data  # the precision section's own error says what is wrong
        both = sorted(set(moved) & set(precision))
        if both:
            raise ValueError(f"optim.{both[0]} and precision.{both[0]} are both set: it is a precision "
                             f"option now; keep precision.{both[0]} only")
        if precision.get("fp6") is not None:
            precision = {**precision, **moved}
        return {**data, "optim": optim, "precision": precision}

    @model_validator(mode="after")
    def _one_graph(self) -> "RunConfig":
        if self.train.cuda_graph and self.model.compile_mode == "reduce-overhead":
            # reduce-overhead replays each block as a CUDA graph of its own (cudagraph trees),
            # which cannot run inside the captured step
            raise ValueError("train.cuda_graph: true captures the whole step, which cannot hold the per-block "
                             "CUDA graphs of model.compile_mode: reduce-overhead; use compile_mode: default")
        return self

    @model_validator(mode="after")
    def _lora_base(self) -> "RunConfig":
        if self.lora is None:
            return self
        if self.precision.name == "fp8":
            raise ValueError("lora: an FP8 base (precision.fp8) is not supported; adapters train on an MXFP6 base "
                             "(precision.fp6: e2m3) or a bf16 one (no precision selector)")
        if self.precision.name == "mxfp6" and self.precision.fused_mlp == "on":
            raise ValueError("precision.fused_mlp: on multiplies the MLP weights inside one Function, which a frozen "
                             "base with adapters replaces by its two linears; use auto or off with lora")
        if not self.model.init_from:
            raise ValueError("model.init_from: a LoRA run adapts a trained base; name its weights (BFL or "
                             "diffusers safetensors, or a run's `mxflux export`). A fresh Flux passes no gradient "
                             "to its blocks (its output layer starts at zero), so adapters there would not learn")
        if self.train.cuda_graph:
            raise ValueError("train.cuda_graph: not validated with lora; leave it false")
        if self.mlperf.enabled:
            raise ValueError("mlperf.enabled: an MLPerf run trains the whole model; remove lora or mlperf")
        return self

    @model_validator(mode="after")
    def _guidance_input(self) -> "RunConfig":
        embedded, value, name = self.model.flux_config().guidance_embed, self.train.distilled_guidance, self.model.name
        if embedded and value is None:
            raise ValueError(f"train.distilled_guidance: required: model {name} has a guidance embedder "
                             "(guidance_embed: a guidance-distilled model such as FLUX.1-dev) and needs the value "
                             "fed as its guidance input; set it, e.g. --set train.distilled_guidance=1.0 "
                             "(flux12b-mxfp6-finetune-dev's)")
        if value is not None and not embedded:
            raise ValueError(f"train.distilled_guidance: {value} is set, but model {name} has no guidance embedder "
                             "(guidance_embed false), so nothing would read it; remove it, or train a "
                             "guidance-distilled model (e.g. model.name=flux-12b-dev)")
        return self


class RecipeError(ValueError):
    """A recipe that cannot be loaded or validated; the message names the recipe and field."""


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("mxflux.recipes").iterdir() if p.name.endswith(".yaml"))


def recipe_descriptions() -> dict[str, str]:
    """Each built-in recipe's name and its `description` line."""
    return {name: str((_parse(_builtin(name).read_text(), name) or {}).get("description", "")).strip()
            for name in recipe_names()}


def _builtin(name: str):
    return resources.files("mxflux.recipes") / f"{name}.yaml"


def _parse(text: str, label: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError(f"recipe {label}: YAML syntax error{where}: {problem}") from None


def _read(recipe: str) -> tuple[dict, str]:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise RecipeError(f"recipe: no such file {recipe!r}")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise RecipeError(f"recipe {path}: not a text file, expected a YAML recipe") from None
        return _not_empty(_parse(text, str(path)), str(path)), str(path)
    res = _builtin(recipe)
    if not res.is_file():
        raise RecipeError(f"recipe: unknown recipe {recipe!r}{did_you_mean(recipe, recipe_names())}; built-in "
                          f"recipes: {', '.join(recipe_names())} (`mxflux recipes` says what each is for)")
    return _not_empty(_parse(res.read_text(), recipe), recipe), recipe


def _not_empty(data, label: str):
    """An empty file is a mistake (the wrong file, a failed copy), not a request for the defaults."""
    if data is None or data == {}:
        raise RecipeError(f"recipe {label} is empty: expected a mapping of sections (model, precision, data, "
                          f"optim, batch, train); `mxflux recipes` lists complete recipes to start from")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` overrides (values parsed as YAML: 3e-4, true, [a, b])."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value, e.g. optim.lr=3e-4")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {item!r}: {p!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise RecipeError(f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None
    return data


def did_you_mean(word: str, choices) -> str:
    """" (did you mean 'x'?)" naming the closest of `choices` to a mistyped `word`, or "" where none is close."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _valid_keys(loc: tuple) -> list[str]:
    """The keys the recipe section at `loc` (a pydantic error location, e.g. ("optim",)) accepts."""
    model: type = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def load_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a built-in recipe by name or a YAML file by path, apply overrides, and validate."""
    data, label = _read(recipe)
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {label}: expected a mapping at the top level")
    data = dict(data)
    data.setdefault("name", Path(label).stem)
    return config_from_dict(data, label, overrides)


def _string_keys(node, where: str, label: str) -> None:
    """Refuse a mapping key that is not a string (YAML reads `1:` or `true:` as others), naming where."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                raise RecipeError(f"recipe {label}: {('section ' + where) if where else 'the top level'} has the key "
                                  f"{key!r} ({type(key).__name__}); expected a field name (a string)")
            _string_keys(value, f"{where}.{key}" if where else key, label)


def config_from_dict(data: dict, label: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Validate a recipe's data (e.g. the config a checkpoint holds) with overrides applied;
    `label` names it in errors."""
    data = apply_overrides(data, list(overrides))
    _string_keys(data, "", label)
    try:
        return RunConfig(**data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key" + did_you_mean(str(err["loc"][-1]), _valid_keys(err["loc"][:-1]))
            # a check across sections names its own fields first ("train.cuda_graph: ...")
            lines.append(f"  {where}: {msg}" if where else f"  {msg}")
        raise RecipeError(f"recipe {label} is invalid:\n" + "\n".join(lines)) from None
