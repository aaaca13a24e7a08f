"""The Flux DiT: shapes and parameter counts, BFL names, MLPerf init, RoPE, packing, FLOPs, gradients."""

import fnmatch

import pytest
import torch
from torch import nn

from mxflux.nn.precision.default_layers import DEFAULT_PRECISION_INCLUDE
from mxflux.model import (FLUX_CONFIGS, Flux, flops_per_sample, flux_config,
                          forward_flops, image_ids, patchify, text_ids, unpatchify)
from mxflux.model import layers
from mxflux.model.layers import EmbedND, apply_rope, explicit_attention, timestep_embedding


def make_inputs(config, gen, batch=2, h=4, w=3, txt_len=5, dtype=torch.float32):
    """Random model inputs for a (2h x 2w)-latent image and txt_len text tokens."""
    latents = torch.randn(batch, config.in_channels // 4, 2 * h, 2 * w, generator=gen)
    kwargs = dict(
        img=patchify(latents).to(dtype),
        img_ids=image_ids(batch, h, w),
        txt=torch.randn(batch, txt_len, config.context_in_dim, generator=gen).to(dtype),
        txt_ids=text_ids(batch, txt_len),
        timesteps=torch.rand(batch, generator=gen),
        y=torch.randn(batch, config.vec_in_dim, generator=gen).to(dtype),
    )
    if config.guidance_embed:
        kwargs["guidance"] = 1 + 4 * torch.rand(batch, generator=gen)
    return kwargs


def break_zero_init(model, gen, std=0.05):
    """Give every zero-initialised tensor random values (a fresh Flux has zero gradients elsewhere)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(std * torch.randn(p.shape, generator=gen))


def mx_selected(model):
    return {name: m for name, m in model.named_modules()
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in DEFAULT_PRECISION_INCLUDE)}


# --------------------------------------------------------------------------- configs and names

def test_flux_12b_has_the_schnell_parameter_count_on_meta():
    with torch.device("meta"):
        model = Flux(flux_config("flux-12b"))
    assert sum(p.numel() for p in model.parameters()) == 11_891_178_560
    assert all(p.is_meta for p in model.parameters())


def test_config_validation_and_lookup():
    with pytest.raises(ValueError, match="unknown Flux config 'flux-13b'"):
        flux_config("flux-13b")
    with pytest.raises(ValueError, match="must sum to head_dim 64"):
        flux_config("flux-tiny", axes_dim=(8, 28, 30))
    with pytest.raises(ValueError, match="not divisible by num_heads 3"):
        flux_config("flux-tiny", num_heads=3)
    assert flux_config("flux-tiny", depth=1).depth == 1
    assert FLUX_CONFIGS["flux-tiny"].depth == 2  # overrides never touch the registry


def test_bfl_state_dict_names():
    model = Flux(flux_config("flux-tiny", guidance_embed=True))
    keys = set(model.state_dict())
    for key in [
        "img_in.weight", "txt_in.bias", "time_in.in_layer.weight", "time_in.out_layer.bias",
        "vector_in.in_layer.weight", "guidance_in.out_layer.weight",
        "double_blocks.0.img_mod.lin.weight", "double_blocks.1.txt_mod.lin.bias",
        "double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.proj.bias",
        "double_blocks.0.img_attn.norm.query_norm.scale", "double_blocks.0.txt_attn.norm.key_norm.scale",
        "double_blocks.1.img_mlp.0.weight", "double_blocks.1.img_mlp.2.bias",
        "double_blocks.0.txt_mlp.0.weight", "double_blocks.0.txt_mlp.2.weight",
        "single_blocks.0.linear1.weight", "single_blocks.1.linear2.bias",
        "single_blocks.0.norm.query_norm.scale", "single_blocks.0.norm.key_norm.scale",
        "single_blocks.1.modulation.lin.weight",
        "final_layer.linear.weight", "final_layer.adaLN_modulation.1.weight",
    ]:
        assert key in keys, key
    assert not any(k.endswith("norm.query_norm.weight") for k in keys)  # BFL calls it `scale`
    assert len(keys) == sum(1 for _ in model.parameters())  # no buffers in the checkpoint


@pytest.mark.parametrize("name", sorted(FLUX_CONFIGS))
def test_mx_patterns_select_only_attention_and_mlp_linears(name):
    config = flux_config(name)
    with torch.device("meta"):
        model = Flux(config)
    selected = mx_selected(model)
    assert len(selected) == 8 * config.depth + 2 * config.depth_single_blocks
    for qualified, module in selected.items():
        assert type(module) is nn.Linear, qualified
        # Every MX-eligible linear holds whole 32-blocks in both dims, in every config.
        assert module.in_features % 32 == 0 and module.out_features % 32 == 0, qualified
        assert not any(part in qualified for part in ("_in", "mod", "final_layer")), qualified
    if name == "flux-12b":
        assert len(selected) == 228
        assert selected["single_blocks.0.linear1"].out_features == 21504


def test_mx_patterns_keep_the_mlp_sequential_whole():
    """The precision policy fuses an MLP only when both its `.0` and `.2` are selected."""
    model = Flux(flux_config("flux-tiny"))
    selected = mx_selected(model)
    for block in ("double_blocks.0.img_mlp", "double_blocks.1.txt_mlp"):
        seq = model.get_submodule(block)
        assert isinstance(seq, nn.Sequential) and len(seq) == 3
        assert isinstance(seq[1], nn.GELU) and seq[1].approximate == "tanh"
        assert f"{block}.0" in selected and f"{block}.2" in selected


def test_precision_policy_swaps_exactly_the_patterns_and_keeps_the_state_dict(gen):
    from mxflux.nn import apply_precision

    config = flux_config("flux-tiny")
    model = Flux(config)
    break_zero_init(model, gen)
    keys = list(model.state_dict())
    report = apply_precision(model, "mxfp6")
    assert sorted(report.swapped) == sorted(mx_selected(Flux(config)))
    assert set(report.kept_bf16.values()) == {"not matched by precision.include"}
    assert report.swapped["double_blocks.0.img_mlp.0"].startswith("mxfp6")
    assert list(model.state_dict()) == keys  # BFL checkpoints still load
    out = model(**make_inputs(config, gen))
    assert torch.isfinite(out).all() and out.abs().max() > 0


# --------------------------------------------------------------------------- init and forward

def test_fresh_model_outputs_exactly_zero(gen):
    config = flux_config("flux-tiny")
    model = Flux(config)
    out = model(**make_inputs(config, gen))
    assert out.shape == (2, 12, 64)
    assert torch.equal(out, torch.zeros_like(out))


def test_init_follows_the_mlperf_reference():
    model = Flux(flux_config("flux-small", depth=1, depth_single_blocks=1))
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(".bias") or "mod" in name or name.startswith("final_layer"):
            assert not p.any(), f"{name} should start at zero"
        elif name.endswith(".scale"):
            assert torch.equal(p, torch.ones_like(p)), name
    for name in ("time_in.in_layer.weight", "vector_in.out_layer.weight"):
        assert abs(params[name].std().item() - 0.02) < 0.002, name
    w = params["single_blocks.0.linear1.weight"]
    bound = (6 / (w.shape[0] + w.shape[1])) ** 0.5  # Xavier-uniform
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound


def test_meta_model_can_be_swapped_materialised_and_initialised(gen):
    """The trainer's order: build on meta, apply the precision policy, materialise, initialise."""
    from mxflux.nn import apply_precision

    config = flux_config("flux-tiny")
    with torch.device("meta"):
        model = Flux(config)
    apply_precision(model, "mxfp6")
    model.to_empty(device="cpu")
    model.init_weights()
    assert not model.final_layer.linear.weight.any()
    assert model.double_blocks[0].img_mlp[2].weight.abs().max() > 0
    out = model(**make_inputs(config, gen))
    assert torch.equal(out, torch.zeros_like(out))


def test_bf16_forward_is_finite_and_keeps_dtype(gen):
    config = flux_config("flux-tiny")
    model = Flux(config)
    break_zero_init(model, gen)
    model = model.to(torch.bfloat16)
    out = model(**make_inputs(config, gen, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 12, 64)
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_gradients_reach_every_parameter_once_zero_init_is_broken(gen):
    config = flux_config("flux-tiny", guidance_embed=True)
    model = Flux(config)
    break_zero_init(model, gen)
    model(**make_inputs(config, gen)).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, f"no gradient reaches {name}"


def test_guidance_is_required_when_embedded(gen):
    config = flux_config("flux-tiny", guidance_embed=True)
    inputs = make_inputs(config, gen)
    del inputs["guidance"]
    with pytest.raises(ValueError, match=r"guidance: this config has guidance_embed=True"):
        Flux(config)(**inputs)


@pytest.mark.parametrize("tensor, bad_shape, message", [
    ("img", (2, 12, 16), r"img: expected \[B, L_img, 64\]"),
    ("txt", (2, 5, 32), r"txt: expected \[B, L_txt, 64\]"),
    ("img_ids", (12, 3), r"img_ids: expected shape \[2, 12, 3\], got \[12, 3\]"),
    ("txt_ids", (2, 4, 3), r"txt_ids: expected shape \[2, 5, 3\]"),
    ("timesteps", (2, 1), r"timesteps: expected shape \[2\]"),
    ("y", (2, 768), r"y: expected shape \[2, 32\]"),
])
def test_wrong_input_shapes_name_the_tensor(gen, tensor, bad_shape, message):
    config = flux_config("flux-tiny")
    inputs = make_inputs(config, gen)
    inputs[tensor] = torch.zeros(bad_shape)
    with pytest.raises(ValueError, match=message):
        Flux(config)(**inputs)


# --------------------------------------------------------------------------- positions, time, packing

def test_rope_shape_and_rotation():
    config = flux_config("flux-tiny")
    ids = torch.cat([text_ids(2, 5), image_ids(2, 4, 3)], dim=1)
    pe = EmbedND(config.head_dim, config.theta, config.axes_dim)(ids)
    assert pe.shape == (2, 1, 17, config.head_dim // 2, 2, 2) and pe.dtype == torch.float32
    # Text tokens sit at the origin: identity rotation.
    assert torch.equal(pe[:, :, :5], torch.eye(2).expand_as(pe[:, :, :5]))
    # Each 2x2 block is a rotation, so q keeps its norm.
    q = torch.randn(2, 2, 17, config.head_dim)
    rotated, _ = apply_rope(q, q, pe)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    # The column axis uses the last 28 dims: token (row 0, col 1) rotates pair 18 (first of axis 2)
    # by angle 1·θ^0 = 1 rad.
    angle = torch.tensor(1.0)
    expected = torch.stack([torch.cos(angle), -torch.sin(angle), torch.sin(angle), torch.cos(angle)])
    torch.testing.assert_close(pe[0, 0, 5 + 1, 18].flatten(), expected)


def test_explicit_attention_matches_sdpa_in_fp64_with_its_gradients(gen):
    """The CPU's eager attention of bf16 inputs: output and dq, dk, dv as close to the fp64 truth
    (of the unrounded inputs) as PyTorch's SDPA on the same bf16 inputs, to within 10 %."""
    q, k, v, dout = (torch.randn(3, 2, 40, 64, generator=gen) for _ in range(4))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*exact)
    want.backward(dout.double())

    def errors(fn):
        low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        got = fn(*low)
        got.backward(dout.bfloat16())
        assert got.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
        pairs = [(got, want)] + [(x.grad, y.grad) for x, y in zip(low, exact)]
        return [float((a.double() - b.detach()).norm() / b.detach().norm()) for a, b in pairs]

    ours, sdpa = errors(explicit_attention), errors(torch.nn.functional.scaled_dot_product_attention)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert a < 1.1 * b and a < 2.0**-7, (name, a, b)


def test_attention_is_explicit_in_eager_cpu_and_sdpa_when_compiled_or_long(monkeypatch, gen):
    calls = []
    real = layers.explicit_attention
    monkeypatch.setattr(layers, "explicit_attention", lambda *a: calls.append(a[0].shape[-2]) or real(*a))
    pe = torch.eye(2).expand(1, 1, 600, 32, 2, 2)
    q = torch.randn(1, 2, 600, 64, generator=gen)
    short = layers.attention(q[:, :, :40], q[:, :, :40], q[:, :, :40], pe[:, :, :40])
    assert calls == [40] and short.shape == (1, 40, 128)
    torch.testing.assert_close(short, layers.attention(q[:, :, :40], q[:, :, :40], q[:, :, :40], pe[:, :, :40]))
    layers.attention(q, q, q, pe)  # longer than CPU_EXPLICIT_ATTENTION_MAX_LEN: SDPA
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layers.attention(q[:, :, :40], q[:, :, :40], q[:, :, :40], pe[:, :, :40])
    assert calls == [40, 40]


def test_ids_layout():
    ids = image_ids(2, 3, 4)
    assert ids.shape == (2, 12, 3)
    assert ids[1, 6].tolist() == [0.0, 1.0, 2.0]  # token 6 of a 3x4 grid: row 1, col 2
    assert torch.equal(text_ids(2, 7), torch.zeros(2, 7, 3))


def test_timestep_embedding_is_cos_then_sin_of_1000t():
    t = torch.tensor([0.0, 0.25])
    emb = timestep_embedding(t, 256)
    assert emb.shape == (2, 256) and emb.dtype == torch.float32
    assert torch.equal(emb[0, :128], torch.ones(128)) and torch.equal(emb[0, 128:], torch.zeros(128))
    torch.testing.assert_close(emb[1, 0], torch.cos(torch.tensor(250.0)))
    torch.testing.assert_close(emb[1, 128], torch.sin(torch.tensor(250.0)))


def test_patchify_round_trip_and_layout(gen):
    latents = torch.randn(2, 16, 8, 6, generator=gen)
    tokens = patchify(latents)
    assert tokens.shape == (2, 4 * 3, 64)
    # "b c (h 2) (w 2) -> b (h w) (c 2 2)": token (row 1, col 2), channel 5, offset (1, 0).
    assert tokens[0, 1 * 3 + 2, 5 * 4 + 1 * 2 + 0] == latents[0, 5, 2 * 1 + 1, 2 * 2 + 0]
    assert torch.equal(unpatchify(tokens, 8, 6), latents)
    with pytest.raises(ValueError, match="even H and W"):
        patchify(latents[..., :5])
    with pytest.raises(ValueError, match=r"tokens: expected \[B, 16, 4·C\] for a 8x8 latent"):
        unpatchify(tokens, 8, 8)


# --------------------------------------------------------------------------- FLOPs

def test_flux_12b_flops_per_sample_at_256px():
    config = flux_config("flux-12b")
    fwd = forward_flops(config, img_tokens=256, txt_tokens=256)
    assert fwd.total == pytest.approx(6.81e12, rel=0.02)
    assert flops_per_sample(config, 256, 256) == pytest.approx(20.4e12, rel=0.02)
    assert fwd.mx_linear / fwd.total == pytest.approx(0.971, abs=0.001)


def test_flops_count_the_model_that_runs(gen):
    """The linear part of the count equals Σ 2·rows·in·out over the nn.Linears a forward calls."""
    config = flux_config("flux-tiny", guidance_embed=True)
    model = Flux(config)
    counted = []
    hooks = [m.register_forward_hook(lambda m, i, o: counted.append(2 * i[0][..., 0].numel() * m.in_features
                                                                     * m.out_features))
             for m in model.modules() if isinstance(m, nn.Linear)]
    inputs = make_inputs(config, gen, batch=1, h=4, w=3, txt_len=5)
    model(**inputs)
    for h in hooks:
        h.remove()
    fwd = forward_flops(config, img_tokens=12, txt_tokens=5)
    assert sum(counted) == fwd.mx_linear + fwd.other_linear
