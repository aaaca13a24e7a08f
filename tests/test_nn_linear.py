"""MXFP6Linear on the CPU reference path: SNR, bias, shapes, saved tensors, errors."""

import pytest
import torch
from torch import nn

from mxflux.mx import mx_matmul, quantize, snr_db
from mxflux.nn import MXFP6Linear


def fp64_reference(x, weight, bias, dy):
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    y = nn.functional.linear(x64, w64, b64)
    y.backward(dy.double())
    return y, x64.grad, w64.grad, b64.grad


def run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    y.backward(dy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("m, k, n", [(256, 256, 512), (512, 1536, 256), (2048, 512, 1536), (1024, 1024, 1024)])
def test_mxfp6_linear_snr_against_fp64(gen, m, k, n):
    lin = nn.Linear(k, n).bfloat16()
    nn.init.normal_(lin.bias, std=0.5, generator=gen)
    layer = MXFP6Linear.from_linear(lin)
    x = torch.randn(m, k, generator=gen).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    y, dx, dw, db = run(layer, x, dy)
    ry, rdx, rdw, rdb = fp64_reference(x, lin.weight, lin.bias, dy)
    snr = {name: snr_db(r, g) for name, r, g in (("fprop", ry, y), ("dgrad", rdx, dx), ("wgrad", rdw, dw))}
    print(f"MXFP6Linear M={m} K={k} N={n} SNR dB: " + ", ".join(f"{k_}={v:.2f}" for k_, v in snr.items()))
    assert all(v >= 24.0 for v in snr.values()), snr
    assert all(v <= 32.0 for v in snr.values()), snr  # quantization really happened
    # The bias gradient is the fp32 column sum of dY, rounded once.
    assert torch.equal(db, dy.float().sum(0).bfloat16())
    assert snr_db(rdb, db) > 45


def test_forward_is_the_reference_mx_gemm(gen):
    layer = MXFP6Linear(256, 96).bfloat16()
    x = torch.randn(64, 256, generator=gen).bfloat16()
    want = mx_matmul(quantize(x), quantize(layer.weight.detach()), layer.bias.detach())
    assert torch.equal(layer(x), want)


def test_training_autocast_does_not_change_the_gemm(gen):
    """Inside a bf16 autocast region (a training step) the MX GEMM still accumulates in fp32 and
    rounds once after the bias: the layer and the reference give the same bits as outside it."""
    layer = MXFP6Linear(256, 96).bfloat16()
    with torch.no_grad():
        layer.bias.normal_(generator=gen)
    x = torch.randn(64, 256, generator=gen).bfloat16()
    want = mx_matmul(quantize(x), quantize(layer.weight.detach()), layer.bias.detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_layer = layer(x)
        got_ref = mx_matmul(quantize(x), quantize(layer.weight.detach()), layer.bias.detach())
    assert torch.equal(got_layer, want) and torch.equal(got_ref, want)


def test_gemm_modes_agree_when_every_block_is_inside_the_window(gen):
    x = torch.randn(128, 512, generator=gen).bfloat16()
    dy = torch.randn(128, 256, generator=gen).bfloat16()
    base = nn.Linear(512, 256).bfloat16()
    results = {}
    for mode in ("rowwise", "blockwise", "exact"):
        layer = MXFP6Linear.from_linear(base, mx_gemm=mode)
        results[mode] = run(layer, x, dy)
        assert int(layer.blocks_outside_window) == 0
    for mode in ("blockwise", "exact"):
        for a, b in zip(results["rowwise"], results[mode]):
            assert torch.equal(a, b), mode


def test_three_d_input_equals_flattened(gen):
    layer = MXFP6Linear(128, 64).bfloat16()
    x = torch.randn(3, 40, 128, generator=gen).bfloat16()
    dy = torch.randn(3, 40, 64, generator=gen).bfloat16()
    y3, dx3, dw3, db3 = run(layer, x, dy)
    y2, dx2, dw2, db2 = run(layer, x.reshape(120, 128), dy.reshape(120, 64))
    assert y3.shape == (3, 40, 64) and dx3.shape == x.shape
    assert torch.equal(y3.reshape(120, 64), y2) and torch.equal(dx3.reshape(120, 128), dx2)
    assert torch.equal(dw3, dw2) and torch.equal(db3, db2)


def test_ragged_token_count_is_zero_padded_exactly(gen):
    layer = MXFP6Linear(96, 64).bfloat16()
    x = torch.randn(100, 96, generator=gen).bfloat16()  # 100 tokens: not a multiple of 32
    dy = torch.randn(100, 64, generator=gen).bfloat16()
    _, _, dw, _ = run(layer, x, dy)
    pad = lambda t: torch.cat([t, torch.zeros(28, t.shape[1], dtype=t.dtype)])  # noqa: E731
    _, _, dw_padded, _ = run(layer, pad(x), pad(dy))
    assert torch.equal(dw, dw_padded)
    _, _, rdw, _ = fp64_reference(x, layer.weight, layer.bias, dy)
    assert snr_db(rdw, dw) > 24


def test_drop_in_for_nn_linear(gen):
    lin = nn.Linear(64, 32)
    layer = MXFP6Linear.from_linear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    fresh = MXFP6Linear(64, 32, bias=False)
    assert fresh.bias is None and list(fresh.state_dict()) == ["weight"]
    # fp32 input and fp32 (master) weights: computed in bf16, returned in the input's dtype.
    x = torch.randn(8, 64, generator=gen, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_parameter_gradients_leave_in_the_parameters_dtype(dtype, gen):
    """fp32 (master) or fp16 parameters: the operands are those of their bf16 rounding, and dW / db
    come back in the parameters' dtype from the GEMM's fp32 accumulator and the packer's fp32
    column sums, rounded once; bf16 parameters (FSDP's mixed precision) see the same values
    rounded to bf16."""
    lin = MXFP6Linear(96, 64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 96, generator=gen) * 0.1)
        lin.bias.copy_(torch.randn(64, generator=gen))
    wide = lin.to(dtype)
    narrow = MXFP6Linear(96, 64).to(torch.bfloat16)
    with torch.no_grad():
        narrow.weight.copy_(wide.weight)  # the bf16 rounding of the same parameters
        narrow.bias.copy_(wide.bias)
    x = torch.randn(80, 96, generator=gen).bfloat16()
    dy = torch.randn(80, 64, generator=gen).bfloat16()
    y_w, dx_w, dw_w, db_w = run(wide, x, dy)
    y_n, dx_n, dw_n, db_n = run(narrow, x, dy)
    assert dw_w.dtype == db_w.dtype == dtype and dw_n.dtype == db_n.dtype == torch.bfloat16
    assert torch.equal(y_w, y_n) and torch.equal(dx_w, dx_n)
    if dtype == torch.float32:  # one rounding: of the fp32 result, to bf16, gives the bf16 run's
        assert torch.equal(dw_w.bfloat16(), dw_n) and torch.equal(db_w.bfloat16(), db_n)
        assert not torch.equal(dw_w, dw_w.bfloat16().float())  # and fp32 keeps what bf16 drops
    else:
        assert torch.allclose(dw_w.float(), dw_n.float(), rtol=2**-7, atol=0)


def test_forward_saves_quantized_tensors_not_bf16_copies(gen):
    layer = MXFP6Linear(256, 128).bfloat16()
    x = torch.randn(64, 256, generator=gen).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    assert saved, "nothing saved"
    dtypes = {t.dtype for t in saved}
    assert dtypes <= {torch.float8_e4m3fn, torch.float32}, dtypes
    big_fp32 = [t for t in saved if t.dtype == torch.float32 and t.numel() >= 64 * 256 // 32]
    assert not big_fp32  # fp32 tensors saved are per-row scales only


def test_nan_propagates_to_its_rows_only(gen):
    layer = MXFP6Linear(64, 32).bfloat16()
    x = torch.randn(4, 64, generator=gen).bfloat16()
    x[2, 5] = float("nan")
    y = layer(x)
    assert y[2].isnan().all() and torch.isfinite(y[[0, 1, 3]]).all()


def test_fold_counter_counts_blocks_outside_the_window(gen):
    layer = MXFP6Linear(256, 64).bfloat16()
    x = torch.randn(8, 256, generator=gen)
    x[:, :32] *= 2.0**20  # one block 20 binades above the rest of its row
    layer(x.bfloat16())
    assert int(layer.blocks_outside_window) == 8 * 7  # the 7 other blocks of each row


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match=r"in_features=100 .*not a multiple"):
        MXFP6Linear(100, 64)
    with pytest.raises(ValueError, match=r"out_features=40 not a multiple"):
        MXFP6Linear(64, 40)
    layer = MXFP6Linear(64, 32)
    with pytest.raises(ValueError, match="input's last dimension is 48, expected 64"):
        layer(torch.randn(4, 48))
    with pytest.raises(ValueError, match="mx_gemm: expected one of"):
        MXFP6Linear(64, 32, mx_gemm="tensorwise")


@pytest.mark.parametrize("mx_gemm", ["rowwise", "blockwise", "exact"])
def test_six_bit_saved_operands_give_bit_identical_outputs_and_gradients(mx_gemm, gen):
    """saved_operands="e2m3" only changes how Xᵀ and Wᵀ wait for backward: y, dX, dW and db equal
    the e4m3 ones bit for bit (fp32 master weights, a token count that is not a multiple of 32, rows
    2^±12 apart so that the row-wise wgrad operand has blocks outside the fold window)."""
    x = (torch.randn(200, 256, generator=gen) * torch.exp2(torch.randint(-12, 12, (200, 1), generator=gen))).bfloat16()
    dy = torch.randn(200, 128, generator=gen).bfloat16()
    out = {}
    for saved in ("e4m3", "e2m3"):
        torch.manual_seed(0)
        layer = MXFP6Linear(256, 128, mx_gemm=mx_gemm, saved_operands=saved)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        out[saved] = [y, xi.grad, layer.weight.grad, layer.bias.grad]
    for name, a, b in zip(("y", "dX", "dW", "db"), out["e4m3"], out["e2m3"]):
        assert torch.equal(a, b), name


def test_saved_operands_rejects_other_values():
    with pytest.raises(ValueError, match="saved_operands"):
        MXFP6Linear(64, 32, saved_operands="e3m2")
