"""FusedMXFP6MLP: one autograd Function for fc1 → GELU(tanh) → fc2, and its per-module fallbacks."""

import warnings

import pytest
import torch
from torch import nn

from mxflux.mx import snr_db
from mxflux.nn import FusedMXFP6MLP


def grads_of(mlp, x, dy):
    x = x.detach().clone().requires_grad_()
    mlp.zero_grad()
    y = mlp(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in mlp.parameters()]


def test_fused_equals_unfused_bit_for_bit(gen):
    fused = FusedMXFP6MLP(256, 1024, mode="on").bfloat16()
    for p in fused.parameters():
        nn.init.normal_(p, std=0.05, generator=gen)
    unfused = FusedMXFP6MLP(256, 1024, mode="off").bfloat16()
    unfused.load_state_dict(fused.state_dict())
    assert fused.fused and not unfused.fused
    x = torch.randn(2, 96, 256, generator=gen).bfloat16()
    dy = torch.randn(2, 96, 256, generator=gen).bfloat16()
    a, b = grads_of(fused, x, dy), grads_of(unfused, x, dy)
    names = ["output", "dx", "0.weight", "0.bias", "2.weight", "2.bias"]
    for name, ta, tb in zip(names, a, b):
        print(f"fused vs unfused {name}: SNR {snr_db(tb, ta)} dB")
        assert torch.equal(ta, tb), name
    assert all(t.abs().sum() > 0 for t in a)


def test_fused_against_fp64(gen):
    mlp = FusedMXFP6MLP(256, 768, mode="on").bfloat16()
    x = torch.randn(128, 256, generator=gen).bfloat16()
    dy = torch.randn(128, 256, generator=gen).bfloat16()
    got = grads_of(mlp, x, dy)
    ref = nn.Sequential(nn.Linear(256, 768), nn.GELU(approximate="tanh"), nn.Linear(768, 256)).double()
    ref.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
    want = grads_of(ref, x.double(), dy.double())
    for name, g, r in zip(["output", "dx", "w1", "b1", "w2", "b2"], got, want):
        assert snr_db(r, g) > 22, name


def test_activation_never_saved_in_bf16(gen):
    mlp = FusedMXFP6MLP(128, 512, mode="on").bfloat16()
    x = torch.randn(64, 128, generator=gen).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mlp(x)
    bf16 = [t for t in saved if t.dtype == torch.bfloat16]
    # Only the pre-activation h (what GELU's backward needs) is kept in bf16; the activation
    # and everything else are FP8 operands.
    assert [tuple(t.shape) for t in bf16] == [(64, 512)]


def test_auto_mode_warns_once_and_falls_back():
    with pytest.warns(UserWarning, match="falling back to the unfused MXFP6 MLP: activation 'gelu' is not tanh GELU"):
        mlp = FusedMXFP6MLP(64, 128, mode="auto", activation="gelu")
    assert not mlp.fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp(torch.randn(4, 64).bfloat16())  # the fallback runs, silently


def test_on_mode_raises_on_a_fallback():
    with pytest.raises(ValueError, match="fused_mlp mode is 'on' but this MLP cannot be fused: activation 'silu'"):
        FusedMXFP6MLP(64, 128, mode="on", activation="silu")


def test_off_mode_forces_unfused_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp = FusedMXFP6MLP(64, 128, mode="off")
    assert not mlp.fused


def test_a_mode_not_in_the_list_is_refused():
    with pytest.raises(ValueError, match=r"fused_mlp mode: expected one of \('auto', 'on', 'off'\), got 'sometimes'"):
        FusedMXFP6MLP(64, 128, mode="sometimes")


def test_shapes_that_cannot_be_mx_are_refused():
    with pytest.raises(ValueError, match="out_features=100 not a multiple of 32"):
        FusedMXFP6MLP(64, 100)


def test_it_is_the_sequential_it_replaces(gen):
    """Same keys and indexing as nn.Sequential(Linear, GELU, Linear): checkpoints and code that
    index the bf16 MLP work unchanged; from_linears keeps the Parameters."""
    bf16 = nn.Sequential(nn.Linear(64, 128), nn.GELU(approximate="tanh"), nn.Linear(128, 64))
    mlp = FusedMXFP6MLP.from_linears(bf16[0], bf16[2], activation="gelu_tanh", mode="on")
    assert list(mlp.state_dict()) == list(bf16.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert mlp[0] is mlp.fc1 and mlp[2] is mlp.fc2 and isinstance(mlp[1], nn.GELU)
    assert mlp.fc1.weight is bf16[0].weight and mlp.fc2.bias is bf16[2].bias
    x = torch.randn(16, 64, generator=gen).bfloat16()
    assert snr_db(bf16.bfloat16()(x).float(), mlp(x).float()) > 20


def test_six_bit_saved_operands_give_bit_identical_outputs_and_gradients(gen):
    """The fused MLP saves four col operands; compacted, every output and gradient is unchanged."""
    x = torch.randn(150, 128, generator=gen).bfloat16()
    dy = torch.randn(150, 128, generator=gen).bfloat16()
    out = {}
    for saved in ("e4m3", "e2m3"):
        torch.manual_seed(0)
        mlp = FusedMXFP6MLP(128, 256, mode="on", saved_operands=saved)
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        y.backward(dy)
        out[saved] = [y, xi.grad] + [p.grad for p in mlp.parameters()]
    for a, b in zip(out["e4m3"], out["e2m3"]):
        assert torch.equal(a, b)
