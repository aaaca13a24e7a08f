"""What autograd keeps for backward around MX GEMMs: exactly the packed column operands.

An MX linear's backward needs Xᵀ and Wᵀ quantized along M and N (docs/design.md, "The three GEMMs
and their operands"), never X or W themselves, so forward must save 1 byte per element of each
(the E4M3 column operand) plus one fp32 scale per row of it, and no bf16 copy of its input. These
tests count the saved bytes with `saved_tensors_hooks`; they run on the CPU (the numba packer) and,
with the `gpu` mark, on CUDA (the Triton packer).
"""

from __future__ import annotations

import pytest
import torch

from mxflux.model import Flux, flux_config, image_ids, text_ids
from mxflux.nn import MXFP6Linear, apply_precision
from mxflux.train.config import load_recipe

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _record_saved(fn):
    """Run fn() under a pack hook; return the distinct saved tensors (by storage) in order."""
    saved, seen = [], set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_mx_linear_saves_only_packed_column_operands(device, bias):
    torch.manual_seed(0)
    m_rows, k, n = 96, 256, 160
    layer = MXFP6Linear(k, n, bias=bias, device=device)
    x = torch.randn(m_rows, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    y, saved = _record_saved(lambda: layer(x))
    assert len(saved) == 4, [(t.dtype, tuple(t.shape)) for t in saved]
    data = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    scales = [t for t in saved if t.dtype == torch.float32]
    assert len(data) == 2 and len(scales) == 2
    # Xᵀ [K, M'] and Wᵀ [K, N'] (M', N' padded to whole blocks of 32 along the new contraction axis)
    assert sorted(tuple(d.shape) for d in data) == sorted([(k, 96), (k, 160)])
    assert all(s.shape == (k, 1) for s in scales)
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    assert nbytes == k * (m_rows + n) + 2 * k * 4
    assert not any(t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.dim() == 2 and t.shape[1] > 1
                   for t in saved), "a high-precision copy of an operand was saved"
    y.float().sum().backward()  # the saved operands are enough for dgrad, wgrad and dbias
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_six_bit_saved_operands_keep_25_32_byte_per_element(device, bias):
    """saved_operands="e2m3": per col operand 6-bit codes (3/4 B per element) and one shift byte
    per 32-element block (1/32 B), plus the same fp32 scales; backward gives the e4m3 gradients."""
    m_rows, k, n = 96, 256, 160
    grads = {}
    for saved_operands in ("e4m3", "e2m3"):
        torch.manual_seed(0)
        layer = MXFP6Linear(k, n, bias=bias, device=device, saved_operands=saved_operands)
        x = torch.randn(m_rows, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        y, saved = _record_saved(lambda: layer(x))
        if saved_operands == "e2m3":
            assert len(saved) == 6, [(t.dtype, tuple(t.shape)) for t in saved]
            assert not any(t.dtype == torch.float8_e4m3fn for t in saved)
            codes = [t for t in saved if t.dtype == torch.uint8 and t.shape[1] % 24 == 0 and t.shape[1] > 8]
            assert sorted(tuple(t.shape) for t in codes) == sorted([(k, 96 * 3 // 4), (k, 160 * 3 // 4)])
            nbytes = sum(t.numel() * t.element_size() for t in saved)
            assert nbytes == k * (m_rows + n) * 25 // 32 + 2 * k * 4
        y.float().sum().backward()
        grads[saved_operands] = [x.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads["e4m3"], grads["e2m3"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_kind", ["double", "single"])
def test_flux_block_saves_no_high_precision_copy_of_an_mx_gemm_input(device, block_kind):
    """Eager, no activation checkpointing: no saved tensor is (a view of) the input of an MX GEMM."""
    torch.manual_seed(0)
    cfg = flux_config("flux-tiny", depth=1, depth_single_blocks=1)
    model = Flux(cfg).to(device)
    apply_precision(model, load_recipe("tiny-mxfp6").precision)
    block = model.double_blocks[0] if block_kind == "double" else model.single_blocks[0]
    mx_inputs = []
    hooks = [mod.register_forward_pre_hook(lambda mod, args: mx_inputs.append(args[0]))
             for mod in block.modules() if isinstance(mod, MXFP6Linear)]
    assert hooks, "the recipe put no MX linear in the block"
    b, n_img, n_txt, d = 2, 64, 32, cfg.hidden_size
    img = torch.randn(b, n_img, d, device=device, requires_grad=True)
    txt = torch.randn(b, n_txt, d, device=device, requires_grad=True)
    vec = torch.randn(b, d, device=device, requires_grad=True)
    pe = model.pe_embedder(torch.cat([text_ids(b, n_txt, device=device), image_ids(b, 8, 8, device=device)], 1))
    with torch.autocast(device, dtype=torch.bfloat16):
        if block_kind == "double":
            out, saved = _record_saved(lambda: block(img, txt, vec, pe))
        else:
            out, saved = _record_saved(lambda: block(torch.cat([txt, img], 1), vec, pe))
    for h in hooks:
        h.remove()
    inputs = {x.untyped_storage().data_ptr() for x in mx_inputs}
    offenders = [(t.dtype, tuple(t.shape)) for t in saved if t.untyped_storage().data_ptr() in inputs]
    assert not offenders, f"inputs of MX GEMMs saved for backward: {offenders}"
    fp8 = sum(t.numel() for t in saved if t.dtype == torch.float8_e4m3fn)
    assert fp8 > 0
    loss = sum(o.float().square().mean() for o in (out if isinstance(out, tuple) else (out,)))
    loss.backward()
    assert img.grad is not None and torch.isfinite(img.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_under_autocast_an_mx_linear_returns_the_autocast_dtype_like_nn_linear(device):
    layer = MXFP6Linear(64, 32, device=device)
    x = torch.randn(8, 64, device=device)  # fp32, as a LayerNorm's output under autocast is
    assert layer(x).dtype == torch.float32
    with torch.autocast(device, dtype=torch.bfloat16):
        assert layer(x).dtype == torch.nn.Linear(64, 32, device=device)(x).dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_a_single_block_in_mxfp6_saves_fewer_bytes_than_in_bf16(device):
    """The fp32 residual stream under bf16 autocast, as in training: every MX GEMM saves 1 byte per
    element where nn.Linear saves 2, and nothing downstream of an MX GEMM is saved in fp32."""
    cfg = flux_config("flux-tiny", depth=1, depth_single_blocks=1)
    saved_bytes = {}
    for precision in ("bf16", "mxfp6"):
        torch.manual_seed(0)
        model = Flux(cfg).to(device)
        apply_precision(model, load_recipe(f"tiny-{precision}").precision)
        block = model.single_blocks[0]
        b, n, d = 2, 96, cfg.hidden_size
        x = torch.randn(b, n, d, device=device, requires_grad=True)
        vec = torch.randn(b, d, device=device, requires_grad=True)
        pe = model.pe_embedder(torch.cat([text_ids(b, 32, device=device), image_ids(b, 8, 8, device=device)], 1))
        with torch.autocast(device, dtype=torch.bfloat16):
            _, saved = _record_saved(lambda: block(x, vec, pe))
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        acts = [t for t in saved if t.untyped_storage().data_ptr() not in params]
        saved_bytes[precision] = sum(t.numel() * t.element_size() for t in acts)
        if precision == "mxfp6":
            wide_fp32 = [tuple(t.shape) for t in acts if t.dtype == torch.float32 and t.shape[-1] > d]
            assert not wide_fp32, f"fp32 activations wider than the residual saved: {wide_fp32}"
    assert saved_bytes["mxfp6"] < 0.9 * saved_bytes["bf16"], saved_bytes
