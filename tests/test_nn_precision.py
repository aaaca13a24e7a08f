"""Precisions as registered converters: the config, the layer choice, the report, and each converter."""

import fnmatch

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from mxflux.model import Flux, flux_config
from mxflux.nn.precision.default_layers import DEFAULT_PRECISION_INCLUDE
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear, PrecisionConfig, PrecisionConverter, apply_precision
from mxflux.nn.precision import register_precision, registered_precisions
from mxflux.nn.precision.fp8 import float8_linear_config

# --------------------------------------------------------------------------- the config


@pytest.mark.parametrize("other, value", [("fp8", "hybrid")])
def test_two_precisions_are_rejected_naming_both_fields(other, value):
    with pytest.raises(ValidationError, match=f"fp6 and {other} are both set"):
        PrecisionConfig(fp6="e2m3", **{other: value})


@pytest.mark.parametrize("selector, option, value, owner", [
    ({"fp6": "e2m3"}, "fp8_scaling", "rowwise", "fp8"),
    ({"fp8": "hybrid"}, "mx_gemm", "exact", "mxfp6"),
    ({}, "fused_mlp", "off", "mxfp6"),
    ({"fp8": "hybrid"}, "saved_operands", "e2m3", "mxfp6"),
    ({}, "fp8_scaling", "rowwise", "fp8"),
    ({"fp6": "e2m3"}, "fp8_fast_accumulation", False, "fp8"),
])
def test_an_option_of_an_unselected_precision_is_an_error(selector, option, value, owner):
    with pytest.raises(ValidationError, match=f"{option}: an option of precision {owner}, but this recipe runs"):
        PrecisionConfig(**selector, **{option: value})


@pytest.mark.parametrize("recipe", ["tiny-mxfp6", "tiny-bf16", "flux12b-fp8-mlperf", "flux12b-mxfp6-mlperf"])
def test_a_dumped_config_loads_back_unchanged(recipe):
    """Checkpoints store the config as a dump, which lists every field of every precision."""
    from mxflux.train.config import load_recipe

    cfg = load_recipe(recipe).precision
    assert PrecisionConfig(**cfg.model_dump(mode="json")) == cfg


def test_other_invalid_configs():
    with pytest.raises(ValidationError, match="fp4: MXFP4/NVFP4 linears are not implemented"):
        PrecisionConfig(fp4="mxfp4")
    with pytest.raises(ValidationError, match="fp4_to_fp8_switch_iter: needs fp4"):
        PrecisionConfig(fp8="hybrid", fp4_to_fp8_switch_iter=10)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        PrecisionConfig(fp6="e2m3", fp6_format="e3m2")
    with pytest.raises(ValidationError, match="mx_gemm"):
        PrecisionConfig(fp6="e2m3", mx_gemm="tensorwise")
    with pytest.raises(ValidationError, match="fp8_scaling"):
        PrecisionConfig(fp8="hybrid", fp8_scaling="blockwise")
    with pytest.raises(ValidationError, match="include: empty"):
        PrecisionConfig(fp6="e2m3", include=())
    with pytest.raises(ValueError, match="precision: expected one of"):
        PrecisionConfig.from_name("mxfp4")


def test_names_and_defaults():
    assert PrecisionConfig().name == "bf16"
    assert PrecisionConfig(fp8="hybrid").name == "fp8"
    assert PrecisionConfig.from_name("fp8").fp8_scaling == "tensorwise"
    assert PrecisionConfig.from_name("mxfp6", mx_gemm="exact").name == "mxfp6"
    assert PrecisionConfig().include == DEFAULT_PRECISION_INCLUDE and PrecisionConfig().exclude == ()
    assert registered_precisions() == ("bf16", "mxfp6", "fp8")


def test_registry_refuses_a_second_precision_of_the_same_name_or_selector():
    with pytest.raises(ValueError, match="'mxfp6' is already registered"):
        register_precision(type("Again", (PrecisionConverter,), {"name": "mxfp6", "selected_by": "fp4"}))
    with pytest.raises(ValueError, match="selector field 'fp8' already selects another precision"):
        register_precision(type("Other", (PrecisionConverter,), {"name": "fp8b", "selected_by": "fp8"}))
    assert registered_precisions() == ("bf16", "mxfp6", "fp8")


# --------------------------------------------------------------------------- layer choice and report


class TinyBlock(nn.Module):
    """A transformer-ish block with Flux's shapes in miniature and its zero-initialised tails."""

    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.mod = nn.Linear(dim, 3 * dim)  # modulation: stays bf16 under the Flux choice
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, 10)  # 10 outputs: neither MX nor FP8 can take it
        nn.init.zeros_(self.mod.weight), nn.init.zeros_(self.mod.bias)
        nn.init.zeros_(self.head.weight), nn.init.zeros_(self.head.bias)

    def forward(self, x):
        shift, scale, gate = self.mod(x.mean(1, keepdim=True)).chunk(3, -1)
        h = nn.functional.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift
        q, k, v = self.qkv(h).chunk(3, -1)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + gate * self.proj(a)
        x = x + self.mlp(nn.functional.layer_norm(x, x.shape[-1:]))
        return self.head(x)


FLUX_LIKE = dict(include=("*qkv", "*proj", "*mlp.0", "*mlp.2", "head", "mod"), exclude=("mod",))


def mxfp6(**kw):
    return PrecisionConfig(fp6="e2m3", **{**FLUX_LIKE, **kw})


def test_mxfp6_swaps_the_chosen_linears_keeps_parameters_and_reports_why_not(caplog):
    block = TinyBlock()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    params = dict(block.named_parameters())
    report = apply_precision(block, mxfp6())
    assert isinstance(block.qkv, MXFP6Linear) and isinstance(block.proj, MXFP6Linear)
    assert isinstance(block.mlp, FusedMXFP6MLP) and block.mlp.fused
    assert type(block.mod) is nn.Linear and type(block.head) is nn.Linear
    assert report.swapped == {"qkv": "mxfp6", "proj": "mxfp6", "mlp.0": "mxfp6-fused", "mlp.2": "mxfp6-fused"}
    assert report.kept_bf16 == {"mod": "matched by precision.exclude 'mod'",
                                "head": "ineligible for mxfp6: out_features=10 not a multiple of 32"}
    after = block.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p is params[n] for n, p in block.named_parameters())
    assert report.count("mxfp6") == 2 and report.count("mxfp6-fused") == 2 and report.count("bf16") == 2


def test_a_linear_no_include_pattern_matches_stays_bf16_with_that_reason():
    block = TinyBlock()
    report = apply_precision(block, PrecisionConfig(fp6="e2m3", include=("qkv", "mlp.*")))
    assert set(report.swapped) == {"qkv", "mlp.0", "mlp.2"}
    assert report.kept_bf16["proj"] == "not matched by precision.include"
    assert type(block.proj) is nn.Linear


@pytest.mark.parametrize("field", ["include", "exclude"])
def test_a_pattern_matching_no_linear_is_an_error_naming_it(field):
    patterns = dict(FLUX_LIKE)
    patterns[field] = (*patterns[field], "*mpl.0")  # a typo
    block = TinyBlock()
    with pytest.raises(ValueError, match=rf"precision\.{field}: pattern '\*mpl\.0' matches no nn\.Linear of this TinyBlock"):
        apply_precision(block, PrecisionConfig(fp6="e2m3", **patterns))
    assert type(block.qkv) is nn.Linear  # nothing was converted before the error


def test_converting_twice_is_an_error():
    block = TinyBlock()
    apply_precision(block, mxfp6())
    with pytest.raises(ValueError, match="qkv is already a MXFP6Linear"):
        apply_precision(block, mxfp6())


def test_the_report_text_groups_layers_and_reasons():
    model = Flux(flux_config("flux-tiny"))
    report = apply_precision(model, PrecisionConfig(fp6="e2m3", exclude=("single_blocks.1.*",)))
    text = report.format()
    lines = text.splitlines()
    assert lines[0] == ("precision mxfp6 (mx_gemm=rowwise, hadamard=True, fused_mlp=auto, saved_operands=e4m3, "
                        "repack_weights=False, weight_exponents_in_optimizer=True, weight_operands_in_optimizer=True, "
                        "kept_weight_cols=True, release_weight_rows=True, held_col_erefs=False, held_headroom_x=1, "
                        "held_headroom_dy=2): "
                        "18 of 34 linears converted")
    assert "  mxfp6-fused      8  double_blocks.*.img_mlp.0 ×2, double_blocks.*.img_mlp.2 ×2," in text
    assert "single_blocks.*.linear1, single_blocks.*.linear2" in text  # one single block left: no ×
    assert "    matched by precision.exclude 'single_blocks.1.*' (2): single_blocks.*.linear1, " in text
    assert "    not matched by precision.include (14): img_in, " in text
    assert str(report) == text


def test_bf16_converts_nothing_and_says_so():
    model = Flux(flux_config("flux-tiny"))
    report = apply_precision(model, "bf16")
    assert report.swapped == {} and len(report.kept_bf16) == 34
    assert report.kept_bf16["single_blocks.0.linear1"] == "the recipe's precision is bf16"
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


# --------------------------------------------------------------------------- mxfp6: the fused MLP


def test_fused_mlp_needs_both_linears_chosen():
    block = TinyBlock()
    report = apply_precision(block, mxfp6(exclude=("mod", "mlp.2")))
    assert type(block.mlp) is nn.Sequential and isinstance(block.mlp[0], MXFP6Linear)
    assert type(block.mlp[2]) is nn.Linear
    assert report.swapped["mlp.0"] == "mxfp6"


def test_fused_mlp_off_and_non_tanh_gelu():
    block = TinyBlock()
    apply_precision(block, mxfp6(fused_mlp="off"))
    assert type(block.mlp) is nn.Sequential and isinstance(block.mlp[0], MXFP6Linear)
    block = TinyBlock()
    block.mlp[1] = nn.GELU()  # erf GELU: the fused prologue cannot reproduce it
    with pytest.warns(UserWarning, match="not tanh GELU"):
        report = apply_precision(block, mxfp6())
    assert isinstance(block.mlp, FusedMXFP6MLP) and not block.mlp.fused and report.swapped["mlp.0"] == "mxfp6"
    block = TinyBlock()
    block.mlp[1] = nn.GELU()
    with pytest.raises(ValueError, match="mode is 'on'"):
        apply_precision(block, mxfp6(fused_mlp="on"))


def test_fused_mlp_keeps_the_unfused_numbers(gen):
    """The converter's fused MLP computes what the unfused MXFP6 MLP computes, bit for bit."""
    fused, unfused = TinyBlock(), TinyBlock()
    unfused.load_state_dict(fused.state_dict())
    apply_precision(fused, mxfp6())
    apply_precision(unfused, mxfp6(fused_mlp="off"))
    assert fused.mlp.fused
    x = torch.randn(2, 64, 64, generator=gen).bfloat16()
    assert torch.equal(fused.mlp(x), unfused.mlp(x))


def break_zero_init(block, gen):
    for lin in (block.mod, block.head):
        nn.init.normal_(lin.weight, std=0.1, generator=gen)
        nn.init.normal_(lin.bias, std=0.1, generator=gen)


def mx_linears(block):
    return [m for m in block.modules() if isinstance(m, MXFP6Linear)]


def test_zero_init_premise_then_non_zero_gradients_in_every_mx_linear(gen):
    block = TinyBlock()
    apply_precision(block, mxfp6())
    block = block.bfloat16()
    x = torch.randn(2, 64, 64, generator=gen).bfloat16()
    block(x).float().square().sum().backward()
    # The premise: with zero-initialised tails every MX linear's gradient is exactly zero, so
    # "grad is not None" would prove nothing.
    assert all(torch.count_nonzero(m.weight.grad) == 0 for m in mx_linears(block))
    break_zero_init(block, gen)
    block.zero_grad()
    block(x).float().square().sum().backward()
    lins = mx_linears(block)
    assert len(lins) == 4
    for m in lins:
        assert torch.count_nonzero(m.weight.grad) > 0.9 * m.weight.numel()


def test_training_with_fp32_master_weights_decreases_the_loss(gen):
    """Parameters stay fp32 (master); MX modules compute in bf16. A bf16 SGD loop could not show
    this: its updates would round away."""
    block = TinyBlock()
    break_zero_init(block, gen)
    apply_precision(block, mxfp6())
    assert all(p.dtype == torch.float32 for p in block.parameters())
    x = torch.randn(8, 32, 64, generator=gen)
    target = torch.randn(8, 32, 10, generator=gen)
    opt = torch.optim.AdamW(block.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = nn.functional.mse_loss(block(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


# --------------------------------------------------------------------------- fp8 on torchao.float8


def test_fp8_puts_torchao_float8_linears_exactly_where_the_patterns_say():
    from torchao.float8.float8_linear import Float8Linear

    model = Flux(flux_config("flux-tiny"))
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    include = (*DEFAULT_PRECISION_INCLUDE, "final_layer.linear")
    exclude = ("double_blocks.1.*", "*.linear2")
    report = apply_precision(model, PrecisionConfig(fp8="hybrid", fp8_scaling="rowwise",
                                                    include=include, exclude=exclude))
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    want = {n for n in linears if any(fnmatch.fnmatchcase(n, p) for p in include)
            and not any(fnmatch.fnmatchcase(n, p) for p in exclude)}
    assert len(want) == 8 + 2 + 1  # double block 0, single blocks' linear1, the final linear
    got = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert got == want
    assert report.swapped == {n: "fp8" for n in linears if n in want}
    assert report.kept_bf16["double_blocks.1.img_attn.qkv"] == "matched by precision.exclude 'double_blocks.1.*'"
    config = float8_linear_config("rowwise")
    assert all(model.get_submodule(n).config == config for n in want)
    assert list(model.state_dict()) == keys  # checkpoints load unchanged
    assert all(p is params[n] for n, p in model.named_parameters())


def test_fp8_refuses_shapes_torchao_cannot_take():
    block = TinyBlock()
    report = apply_precision(block, PrecisionConfig(fp8="hybrid", **FLUX_LIKE))
    assert report.kept_bf16["head"] == "ineligible for fp8: out_features=10 not a multiple of 16"
    assert report.count("fp8") == 4 and type(block.head) is nn.Linear
    assert type(block.mlp) is nn.Sequential  # no fused MLP outside mxfp6


def test_fp8_hybrid_configs_are_torchaos_recipes_with_e5m2_gradients():
    from torchao.float8 import Float8LinearConfig, ScalingGranularity

    tensorwise = float8_linear_config("tensorwise")
    assert tensorwise == Float8LinearConfig()  # torchao's default recipe is hybrid tensor-wise
    rowwise = float8_linear_config("rowwise")
    torchao_rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    for cfg in (tensorwise, rowwise):
        assert cfg.cast_config_input.target_dtype == torch.float8_e4m3fn
        assert cfg.cast_config_weight.target_dtype == torch.float8_e4m3fn
        assert cfg.cast_config_grad_output.target_dtype == torch.float8_e5m2
        assert cfg.cast_config_grad_output_for_grad_weight.target_dtype == torch.float8_e5m2
    for role in ("input", "weight", "grad_output"):
        assert getattr(rowwise, f"cast_config_{role}").scaling_granularity is ScalingGranularity.AXISWISE
    # Everything but the gradient's dtype as torchao's row-wise recipe.
    assert rowwise.round_scales_to_power_of_2 == torchao_rowwise.round_scales_to_power_of_2 is True
    assert (rowwise.gemm_config_output, rowwise.gemm_config_grad_input, rowwise.gemm_config_grad_weight) == (
        torchao_rowwise.gemm_config_output, torchao_rowwise.gemm_config_grad_input,
        torchao_rowwise.gemm_config_grad_weight)
    assert torchao_rowwise.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_scaling: expected"):
        float8_linear_config("blockwise")


def test_fp8_without_fast_accumulation_promotes_the_forward_gemms_sums_too():
    """`fp8_fast_accumulation: false` (the bench setting fp8-tensorwise-exact): torchao's tensor-wise recipe
    with the output GEMM's sums in fp32, the backward GEMMs' as they were: the accumulation of MXFP6's GEMM
    contract. The swapped linears carry it."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    exact = float8_linear_config("tensorwise", fast_accumulation=False)
    default = Float8LinearConfig()
    assert default.gemm_config_output.use_fast_accum is True  # what torchao ships
    assert exact.gemm_config_output.use_fast_accum is False
    assert (exact.gemm_config_grad_input, exact.gemm_config_grad_weight) == (default.gemm_config_grad_input,
                                                                              default.gemm_config_grad_weight)
    assert float8_linear_config("tensorwise", fast_accumulation=True) == default
    block = TinyBlock()
    apply_precision(block, PrecisionConfig(fp8="hybrid", fp8_fast_accumulation=False, **FLUX_LIKE))
    swapped = [m for m in block.modules() if isinstance(m, Float8Linear)]
    assert len(swapped) == 4 and all(m.config == exact for m in swapped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where FP8 cannot run")
def test_running_fp8_where_it_cannot_run_raises_naming_the_field(gen):
    model = Flux(flux_config("flux-tiny"))
    apply_precision(model, "fp8")  # converting works anywhere, so recipes validate on the CPU
    c = model.config
    inputs = dict(img=torch.randn(1, 4, c.in_channels, generator=gen), img_ids=torch.zeros(1, 4, 3),
                  txt=torch.randn(1, 3, c.context_in_dim, generator=gen), txt_ids=torch.zeros(1, 3, 3),
                  timesteps=torch.rand(1, generator=gen), y=torch.randn(1, c.vec_in_dim, generator=gen))
    if c.guidance_embed:
        inputs["guidance"] = torch.ones(1)
    for _ in range(2):  # the check stays until a forward passes it
        with pytest.raises(RuntimeError, match="precision.fp8: torchao float8 training cannot run here: "
                                               "the model is on cpu, not a CUDA GPU"):
            model(**inputs)
