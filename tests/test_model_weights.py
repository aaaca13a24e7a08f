"""Released-checkpoint loading: diffusers folders (sharded, pipelines) and BFL single files become
the same BFL state dict, give diffusers' own output through `Flux`, and a checkpoint that does not
fit the model config is refused with the tensors and FluxConfig fields that differ."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mxflux.model import (Flux, FluxCheckpoint, FluxWeightsError, flux_config, flux_from_checkpoint, image_ids,
                          infer_flux_config, init_from_checkpoint, load_flux_weights)

diffusers = pytest.importorskip("diffusers", reason="pip install -e '.[test]' installs diffusers")

from test_model_diffusers_equivalence import random_diffusers_flux  # noqa: E402


def save_pipeline(model, root, *, shard="1MB"):
    """A diffusers pipeline folder holding just the transformer, saved in shards of `shard`."""
    model.save_pretrained(root / "transformer", max_shard_size=shard)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                        "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    return root


def save_bfl_file(state, path, prefix=""):
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, path)
    return path


def outputs(model, config, gen, guidance_embed):
    batch, h, w, txt_len = 2, 4, 6, 7
    img = torch.randn(batch, h * w, config.in_channels, generator=gen)
    txt = torch.randn(batch, txt_len, config.context_in_dim, generator=gen)
    y = torch.randn(batch, config.vec_in_dim, generator=gen)
    t = torch.rand(batch, generator=gen)
    guidance = 1 + 4 * torch.rand(batch, generator=gen) if guidance_embed else None
    img_pos, txt_pos = image_ids(1, h, w)[0], torch.zeros(txt_len, 3)
    with torch.no_grad():
        expected = model(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=t,
                         img_ids=img_pos, txt_ids=txt_pos, guidance=guidance, return_dict=False)[0]
        return expected, dict(img=img, img_ids=img_pos.expand(batch, -1, -1), txt=txt,
                              txt_ids=txt_pos.expand(batch, -1, -1), timesteps=t, y=y, guidance=guidance)


@pytest.mark.parametrize("guidance_embed", [False, True], ids=["schnell", "dev"])
def test_sharded_diffusers_pipeline_loads_and_matches_diffusers(gen, tmp_path, guidance_embed):
    config = flux_config("flux-tiny", guidance_embed=guidance_embed)
    reference = random_diffusers_flux(config, gen)
    root = save_pipeline(reference, tmp_path / "pipe")
    shards = sorted((root / "transformer").glob("*.safetensors"))
    assert len(shards) > 2 and list((root / "transformer").glob("*.safetensors.index.json"))

    state = load_flux_weights(root)  # the pipeline folder: transformer/ is found
    assert infer_flux_config(state) == config  # guidance_embed from the guidance embedder's presence
    ours = Flux(config)
    ours.load_state_dict(state, strict=True)
    ours.eval()

    expected, inputs = outputs(reference, config, gen, guidance_embed)
    with torch.no_grad():
        got = ours(**inputs)
    scale = expected.abs().max()
    assert scale > 1e-2
    error = (got - expected).abs().max() / scale
    assert error <= 1e-5, f"max |ours - diffusers| / max |diffusers| = {error:.3g}"

    # The transformer/ folder itself, and the model built straight from the weights, are the same.
    direct = load_flux_weights(root / "transformer")
    assert direct.keys() == state.keys() and all(torch.equal(direct[k], state[k]) for k in state)
    built = flux_from_checkpoint(root)
    assert built.config == config
    with torch.no_grad():
        assert torch.equal(built.eval()(**inputs), got)


def test_bfl_single_file_loads_identically(gen, tmp_path):
    reference = random_diffusers_flux(flux_config("flux-tiny"), gen)
    save_pipeline(reference, tmp_path / "pipe")
    state = load_flux_weights(tmp_path / "pipe")
    bfl = save_bfl_file(state, tmp_path / "flux1-tiny.safetensors")
    comfy = save_bfl_file(state, tmp_path / "comfy.safetensors", prefix="model.diffusion_model.")
    reference.save_pretrained(tmp_path / "single", max_shard_size="1GB")  # diffusers, one file
    assert len(list((tmp_path / "single").glob("*.safetensors"))) == 1

    for path, layout in ((bfl, "bfl"), (comfy, "bfl"), (tmp_path / "single", "diffusers")):
        assert FluxCheckpoint(path).layout == layout
        loaded = load_flux_weights(path)
        assert loaded.keys() == state.keys(), path
        assert all(torch.equal(loaded[k], state[k]) for k in state), path


def test_wrong_config_fails_naming_the_mismatch(gen, tmp_path):
    model_config = flux_config("flux-tiny")
    other = random_diffusers_flux(flux_config("flux-tiny", depth=3, guidance_embed=True), gen)
    root = save_pipeline(other, tmp_path / "pipe")

    model = Flux(model_config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FluxWeightsError) as err:
        init_from_checkpoint(model, root)
    message = str(err.value)
    assert "depth=3 (model: 2)" in message and "guidance_embed=True (model: False)" in message
    assert "--set model.name=flux-tiny --set model.overrides.depth=3 --set model.overrides.guidance_embed=true" \
        in message
    assert ("unexpected in the checkpoint (28): double_blocks.2.* (24 tensors), guidance_in.in_layer.bias, "
            "guidance_in.in_layer.weight, guidance_in.out_layer.bias, guidance_in.out_layer.weight") in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any copy

    # One mis-shaped tensor: a wider text input (context_in_dim) is named with both shapes.
    state = load_flux_weights(root)
    state["txt_in.weight"] = torch.zeros(128, 96)
    bad = save_bfl_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(FluxWeightsError, match=r"wrong shape \(1\): txt_in.weight \[128, 96\] \(model: \[128, 64\]\)"):
        load_flux_weights(bad, flux_config("flux-tiny", depth=3, guidance_embed=True))
    # With no config given, a consistent file is its own config (context_in_dim 96) ...
    assert infer_flux_config(load_flux_weights(bad)).context_in_dim == 96
    # ... and an inconsistent one is no config's state dict.
    state["double_blocks.1.img_attn.qkv.weight"] = torch.zeros(3 * 128 + 2, 128)
    save_bfl_file(state, bad)
    with pytest.raises(FluxWeightsError, match=r"wrong shape \(1\): double_blocks.1.img_attn.qkv.weight "
                                               r"\[386, 128\] \(model: \[384, 128\]\)"):
        load_flux_weights(bad)


def test_init_from_checkpoint_fills_an_mxfp6_model(gen, tmp_path):
    from mxflux.nn import PrecisionConfig, apply_precision

    config = flux_config("flux-tiny")
    root = save_pipeline(random_diffusers_flux(config, gen), tmp_path / "pipe")
    model = Flux(config)
    report = apply_precision(model, PrecisionConfig(fp6="e2m3"))
    assert report.swapped  # MX modules take their weights by the same names
    init_from_checkpoint(model, root)
    state = load_flux_weights(root)
    params = dict(model.named_parameters())
    assert params.keys() == state.keys()
    assert all(torch.equal(params[k], state[k]) for k in state)


def test_unreadable_paths_say_what_was_expected(tmp_path):
    with pytest.raises(FluxWeightsError, match="no such file or directory"):
        load_flux_weights(tmp_path / "nowhere")
    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    with pytest.raises(FluxWeightsError, match=r"expected a \.safetensors file"):
        load_flux_weights(tmp_path / "w.bin")
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(FluxWeightsError, match="not a safetensors file"):
        load_flux_weights(tmp_path / "x.safetensors")
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a", "b"):
        save_file({name: torch.zeros(2)}, folder / f"{name}.safetensors")
    with pytest.raises(FluxWeightsError, match=r"found several \(\['a.safetensors', 'b.safetensors'\]\)"):
        load_flux_weights(folder)
    save_file({"encoder.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(FluxWeightsError, match=r"not a Flux state dict; it has no \['img_in.weight'"):
        load_flux_weights(tmp_path / "other.safetensors")
