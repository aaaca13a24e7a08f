"""Our Flux matches diffusers' FluxTransformer2DModel (an independent implementation) in fp32.

Both are built at the flux-tiny shape, diffusers with random non-zero weights (a zero-init model
would make every comparison trivially 0 == 0); its state dict goes through `diffusers_to_bfl` and
loads into `Flux` strictly; the same inputs must give the same output.
"""

import pytest
import torch

from mxflux.model import Flux, diffusers_to_bfl, flux_config, image_ids

diffusers = pytest.importorskip("diffusers", reason="pip install -e '.[test]' installs diffusers")


def random_diffusers_flux(config, gen):
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=config.in_channels,
        out_channels=config.out_channels,
        num_layers=config.depth,
        num_single_layers=config.depth_single_blocks,
        attention_head_dim=config.head_dim,
        num_attention_heads=config.num_heads,
        joint_attention_dim=config.context_in_dim,
        pooled_projection_dim=config.vec_in_dim,
        guidance_embeds=config.guidance_embed,
        axes_dims_rope=config.axes_dim,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:  # linear weights: unit-variance outputs, so no block is negligible
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "norm" in name:  # RMSNorm scales around 1
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("guidance_embed", [False, True], ids=["schnell", "dev"])
def test_flux_matches_diffusers(gen, guidance_embed):
    config = flux_config("flux-tiny", guidance_embed=guidance_embed)
    reference = random_diffusers_flux(config, gen)

    ours = Flux(config)
    ours.load_state_dict(diffusers_to_bfl(reference.state_dict()), strict=True)
    ours.eval()

    batch, h, w, txt_len = 2, 4, 6, 7
    img = torch.randn(batch, h * w, config.in_channels, generator=gen)
    txt = torch.randn(batch, txt_len, config.context_in_dim, generator=gen)
    y = torch.randn(batch, config.vec_in_dim, generator=gen)
    t = torch.rand(batch, generator=gen)
    guidance = 1 + 4 * torch.rand(batch, generator=gen) if guidance_embed else None
    # Non-zero text positions too, so RoPE on every axis is exercised on both streams.
    txt_pos = torch.randint(0, 9, (txt_len, 3), generator=gen).float()
    img_pos = image_ids(1, h, w)[0]

    with torch.no_grad():
        # diffusers: timestep in [0, 1] (it multiplies by 1000 itself, as BFL's embedding does);
        # ids are 2-D [L, 3], shared by the batch.
        expected = reference(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y,
                             timestep=t, img_ids=img_pos, txt_ids=txt_pos, guidance=guidance,
                             return_dict=False)[0]
        got = ours(img=img, img_ids=img_pos.expand(batch, -1, -1), txt=txt,
                   txt_ids=txt_pos.expand(batch, -1, -1), timesteps=t, y=y, guidance=guidance)

    assert got.shape == expected.shape == (batch, h * w, config.out_channels)
    scale = expected.abs().max()
    assert scale > 1e-2  # a real, non-degenerate output
    error = (got - expected).abs().max() / scale
    assert error < 1e-5, f"max |ours - diffusers| / max |diffusers| = {error:.3g}"


def test_converter_rejects_unknown_and_incomplete_state_dicts(gen):
    state = random_diffusers_flux(flux_config("flux-tiny"), gen).state_dict()
    with pytest.raises(ValueError, match=r"no BFL counterpart.*encoder_hid_proj\.weight"):
        diffusers_to_bfl({**state, "encoder_hid_proj.weight": torch.zeros(1)})
    del state["single_transformer_blocks.1.proj_mlp.bias"]
    with pytest.raises(ValueError, match=r"single_blocks\.1\.linear1\.bias concatenates .* missing "
                                         r"\['single_transformer_blocks\.1\.proj_mlp\.bias'\]"):
        diffusers_to_bfl(state)


def test_final_modulation_halves_are_swapped(gen):
    state = random_diffusers_flux(flux_config("flux-tiny"), gen).state_dict()
    scale, shift = state["norm_out.linear.weight"].chunk(2)  # diffusers: (scale, shift)
    converted = diffusers_to_bfl(state)["final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(converted, torch.cat([shift, scale]))  # BFL: (shift, scale)
