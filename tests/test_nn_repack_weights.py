"""`precision.repack_weights`: backward packs Wᵀ again from the parameter instead of keeping it.

The packer is deterministic, so outputs, gradients and the fold counters must equal the default
(Wᵀ kept from forward) bit for bit, and what autograd keeps must shrink by exactly the Wᵀ operands
(docs/design.md, "The three GEMMs and their operands"): in eager mode, and under torch.compile,
whose partitioner could otherwise move the backward packer call into forward and save its output.
On the CPU, and on CUDA (the Triton packer) when one is present.
"""

from __future__ import annotations

import pytest
import torch

from test_saved_tensors import _record_saved

from mxflux.model import Flux, flux_config, image_ids, text_ids
from mxflux.nn import FusedMXFP6MLP, MXFP6Linear, apply_precision
from mxflux.nn.precision.config import PrecisionConfig
from mxflux.nn.recompute import mark_input_repacked
from mxflux.train.config import load_recipe

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _wide_rows(r, c, gen):
    """Groups of 32 rows up to 2^±12 apart, so that the wgrad operand Xᵀ (blocks of 32 rows) has
    blocks outside the fold window. The first two groups are pinned 2^23 apart (far wider than the
    window) so that every seed has such blocks; the others are drawn."""
    exponents = torch.randint(-12, 12, (-(-r // 32), 1), generator=gen)
    exponents[:2, 0] = torch.tensor([11, -12])
    scale = torch.exp2(exponents.float()).repeat_interleave(32, 0)[:r]
    return (torch.randn(r, c, generator=gen) * scale).bfloat16()


def _step(module, x, dy):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    counters = [m.blocks_outside_window.clone() for m in module.modules() if isinstance(m, MXFP6Linear)]
    return [y, x.grad] + [p.grad for p in module.parameters()] + counters


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mx_gemm", ["rowwise", "blockwise", "exact"])
@pytest.mark.parametrize("saved_operands", ["e4m3", "e2m3"])
def test_repacked_weights_give_bit_identical_outputs_gradients_and_counts(device, mx_gemm, saved_operands, gen):
    x = _wide_rows(200, 256, gen).to(device)
    dy = torch.randn(200, 128, generator=gen).bfloat16().to(device)
    w = (torch.randn(128, 256, generator=gen) * torch.exp2(torch.randint(-14, 2, (128, 1), generator=gen))).to(device)
    out = {}
    for repack in (False, True):
        layer = MXFP6Linear(256, 128, mx_gemm=mx_gemm, saved_operands=saved_operands, repack_weights=repack,
                            device=device)
        with torch.no_grad():
            layer.weight.copy_(w)  # fp32 master weights, some blocks outside the window
            layer.bias.copy_(w[:, 0])
        out[repack] = _step(layer, x, dy)
    if mx_gemm != "exact":  # (exact has no fold window)
        assert int(out[False][-1]) > 0  # the counters compared below saw out-of-window blocks
    for i, (a, b) in enumerate(zip(out[False], out[True])):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("device", DEVICES)
def test_repacked_weights_in_the_fused_mlp_are_bit_identical(device, gen):
    x = _wide_rows(96, 128, gen).to(device)
    dy = torch.randn(96, 128, generator=gen).bfloat16().to(device)
    out = {}
    for repack in (False, True):
        torch.manual_seed(0)
        mlp = FusedMXFP6MLP(128, 512, mode="on", repack_weights=repack).to(device)
        assert mlp.fused and mlp.fc1.cfg.repack_weights is repack
        out[repack] = _step(mlp, x, dy)
    for i, (a, b) in enumerate(zip(out[False], out[True])):
        assert torch.equal(a, b), i


def _e4m3_bytes(module, x) -> int:
    """The E4M3 bytes autograd keeps for one forward of `module` on `x`."""
    _, saved = _record_saved(lambda: module(x.clone().requires_grad_()))
    return sum(t.numel() for t in saved if t.dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mx_gemm", ["rowwise", "blockwise", "exact"])
def test_repacked_inputs_give_bit_identical_outputs_gradients_and_counts(device, mx_gemm, gen):
    """`MXConfig.repack_input` (`activation_checkpointing: mx_inputs` sets it): Xᵀ packed in backward
    from the kept input gives forward's bytes, and the fold-window blocks count once; the input
    itself is what is kept, not an E4M3 Xᵀ."""
    x = _wide_rows(200, 256, gen).to(device)
    dy = torch.randn(200, 128, generator=gen).bfloat16().to(device)
    w = torch.randn(128, 256, generator=gen).to(device)
    out, kept = {}, {}
    for repack in (False, True):
        layer = MXFP6Linear(256, 128, mx_gemm=mx_gemm, device=device)
        if repack:
            mark_input_repacked(layer)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(w[:, 0])
        out[repack] = _step(layer, x, dy)
        kept[repack] = _e4m3_bytes(layer, x)
    if mx_gemm != "exact":
        assert int(out[False][-1]) > 0
    for i, (a, b) in enumerate(zip(out[False], out[True])):
        assert torch.equal(a, b), i
    assert kept[False] - kept[True] >= 256 * 200, kept  # Xᵀ: [256, 200 tokens (or more, padded)], 1 B each


@pytest.mark.parametrize("device", DEVICES)
def test_repacked_activation_in_the_fused_mlp_is_bit_identical(device, gen):
    """A fused MLP's fc2 input (GELU of h) packed again from h in backward: the same bits, and no Xᵀ of
    the activation kept."""
    x = _wide_rows(96, 128, gen).to(device)
    dy = torch.randn(96, 128, generator=gen).bfloat16().to(device)
    out, kept = {}, {}
    for repack in (False, True):
        torch.manual_seed(0)
        mlp = FusedMXFP6MLP(128, 512, mode="on").to(device)
        if repack:
            mark_input_repacked(mlp)
        assert mlp.fused
        out[repack] = _step(mlp, x, dy)
        kept[repack] = _e4m3_bytes(mlp, x)
    for i, (a, b) in enumerate(zip(out[False], out[True])):
        assert torch.equal(a, b), i
    assert kept[False] - kept[True] == 512 * 96, kept  # the activation's Xᵀ: [512, 96 tokens], 1 B each


@pytest.mark.parametrize("device", DEVICES)
def test_a_repacking_linear_keeps_its_parameter_not_a_weight_operand(device):
    m_rows, k, n = 96, 256, 160
    layer = MXFP6Linear(k, n, repack_weights=True, device=device)
    x = torch.randn(m_rows, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    _, saved = _record_saved(lambda: layer(x))
    weights = [t for t in saved if t.untyped_storage().data_ptr() == layer.weight.untyped_storage().data_ptr()]
    others = [t for t in saved if t.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()]
    assert len(weights) == 1 and weights[0] is layer.weight  # alive anyway: no bytes added
    # Xᵀ [K, M] in E4M3 and its scales, nothing else
    assert [(t.dtype, tuple(t.shape)) for t in others] == [(torch.float8_e4m3fn, (k, m_rows)), (torch.float32, (k, 1))]
    # without an input gradient no Wᵀ is needed: not even the parameter is kept
    _, saved = _record_saved(lambda: layer(x.detach()))
    assert all(t.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr() for t in saved)
    assert sum(t.numel() * t.element_size() for t in saved) == k * m_rows + 4 * k


@pytest.mark.slow
def test_compiled_block_keeps_exactly_the_weight_operands_less():
    """Compiled, the partitioner keeps the backward packer call in backward (a parameter is free to
    save, its FP8 operand is not): the block saves exactly the Wᵀ operands (1 B per weight element
    plus one fp32 scale per row of Wᵀ) less than with Wᵀ kept, and nothing more."""
    cfg = flux_config("flux-tiny", depth=1, depth_single_blocks=1)
    saved_bytes = {}
    for repack in (False, True):
        torch.manual_seed(0)
        model = Flux(cfg)
        precision = load_recipe("tiny-mxfp6").precision.model_copy(update={"repack_weights": repack})
        apply_precision(model, precision)
        block = model.single_blocks[0]
        b, n, d = 2, 96, cfg.hidden_size
        x = torch.randn(b, n, d, requires_grad=True)
        vec = torch.randn(b, d, requires_grad=True)
        pe = model.pe_embedder(torch.cat([text_ids(b, 32), image_ids(b, 8, 8)], 1))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return block(x, vec, pe)

        compiled = torch.compile(step)
        compiled()  # compile
        out, saved = _record_saved(compiled)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        saved_bytes[repack] = sum(t.numel() * t.element_size() for t in saved
                                  if t.untyped_storage().data_ptr() not in params)
        out.float().square().mean().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    mx = [m for m in block.modules() if isinstance(m, MXFP6Linear)]
    weight_operands = sum(m.in_features * m.out_features + 4 * m.in_features for m in mx)
    assert saved_bytes[False] - saved_bytes[True] == weight_operands, saved_bytes


def test_repack_weights_is_an_mxfp6_option():
    with pytest.raises(ValueError, match="repack_weights: an option of precision mxfp6"):
        PrecisionConfig(fp8="hybrid", repack_weights=True)
    with pytest.raises(ValueError, match="repack_weights"):
        MXFP6Linear(64, 32, repack_weights="yes")
    assert "repack_weights=True" in repr(MXFP6Linear(64, 32, repack_weights=True))
