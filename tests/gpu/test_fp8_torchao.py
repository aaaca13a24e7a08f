"""`fp8: hybrid` on torchao.float8 on a GPU: E4M3 forward, E5M2 gradients, in both scalings."""

import pytest
import torch
from torch import nn

from mxflux.mx import snr_db
from mxflux.nn import PrecisionConfig, apply_precision

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_hybrid_gemm_operands_and_accuracy(scaling, gen, monkeypatch):
    k, n, m = 3072, 1024, 2048
    model = nn.Sequential(nn.Linear(k, n))  # converted on the CPU, run on the GPU, as the trainer may
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
        model[0].bias.copy_(torch.randn(n, generator=gen))
    w64, b64 = model[0].weight.detach().double(), model[0].bias.detach().double()
    report = apply_precision(model, PrecisionConfig(fp8="hybrid", fp8_scaling=scaling, include=("0",)))
    assert report.swapped == {"0": "fp8"}
    model = model.cuda()

    calls = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, scale_a, scale_b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, tuple(scale_a.shape), tuple(scale_b.shape), a.shape[0], b.shape[1]))
        return scaled_mm(a, b, scale_a, scale_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    x = torch.randn(m, k, generator=gen).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    xc = x.cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(xc)
    y.backward(dy.cuda())

    x64, dy64 = x.double().requires_grad_(), dy.double()
    y64 = x64 @ w64.t() + b64
    y64.backward(dy64)
    snr = {"fprop": snr_db(y64, y.double().cpu()), "dgrad": snr_db(x64.grad, xc.grad.double().cpu()),
           "wgrad": snr_db(dy64.t() @ x.double(), model[0].weight.grad.double().cpu())}
    print(f"fp8 hybrid {scaling} SNR dB: " + ", ".join(f"{g}={v:.2f}" for g, v in snr.items()))
    assert snr["fprop"] > 25 and snr["dgrad"] > 20 and snr["wgrad"] > 20, snr  # E4M3 ~28.7, E5M2 ~24.7

    # fprop X·Wᵀ in E4M3 x E4M3; dgrad dY·W and wgrad dYᵀ·X with dY in E5M2.
    assert [c[:2] for c in calls] == [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)], calls
    unit = ((), (1,), (1, 1))
    for i, (_, _, sa, sb, rows, cols) in enumerate(calls):
        if scaling == "tensorwise":
            assert sa in unit and sb in unit, (sa, sb)
        elif i == 0:  # fprop (fast accumulation): one scale per row of X and per row of W
            assert sa == (rows, 1) and sb == (1, cols), (sa, sb, rows, cols)
        else:
            # torchao runs a row-wise GEMM without fast accumulation (the gradient GEMMs) on the
            # tensor-wise kernel with unit scales and multiplies the row and column scales into
            # the output afterwards; the accuracy above shows they are applied.
            assert (sa, sb) in {((rows, 1), (1, cols))} | {(u, v) for u in unit for v in unit}, (sa, sb)


def test_the_device_check_passes_once_and_leaves(gen):
    """Converted on the CPU, the model checks its device at the first forward (a capable GPU
    here), then drops the check: later steps and compiled graphs never see it."""
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    apply_precision(model, PrecisionConfig(fp8="hybrid", include=("*",)))
    assert len(model._forward_pre_hooks) == 1
    model = model.cuda()
    x = torch.randn(64, 256, generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x)
    assert torch.isfinite(y).all() and y.abs().max() > 0
    assert len(model._forward_pre_hooks) == 0
