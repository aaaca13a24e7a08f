"""The frozen MXFP6 layer of LoRA runs on CUDA: the kernels' path (the compiled transposition of the
weight's operand for dgrad, the packers, cuBLAS, the rotation of dX as a GEMM) against the same layer on the CPU reference path, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from mxflux.nn import MXFP6Linear
from mxflux.nn.frozen import FrozenMXFP6Linear
from mxflux.ops import custom_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def pinned(monkeypatch):
    monkeypatch.setattr(custom_ops, "FORCE_REFERENCE", False)


def _frozen(n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = MXFP6Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return FrozenMXFP6Linear.from_mx_linear(lin.to(device), torch.float32)


def _run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("n, k, m", [(384, 256, 200), (3072, 3072, 512), (9216, 3072, 64)])
def test_the_frozen_weight_and_its_transposition_for_dgrad_are_the_references(n, k, m):
    cuda, cpu = _frozen(n, k, "cuda"), _frozen(n, k, "cpu")
    assert torch.equal(cuda.w_data.cpu().view(torch.uint8), cpu.w_data.view(torch.uint8))  # the packer's bytes
    assert torch.equal(cuda.w_scale.cpu(), cpu.w_scale)
    col_cuda = custom_ops.frozen_weight_col(cuda.w_data, cuda.w_scale, cuda.w_column_scale, "rowwise")
    col_cpu = custom_ops.frozen_weight_col(cpu.w_data, cpu.w_scale, cpu.w_column_scale, "rowwise")
    assert col_cuda[0].is_contiguous()
    assert torch.equal(col_cuda[0].cpu().view(torch.uint8), col_cpu[0].view(torch.uint8))  # compiled transposition
    assert torch.equal(col_cuda[1].cpu(), col_cpu[1])
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(m, k, generator=g).bfloat16(), torch.randn(m, n, generator=g).bfloat16()
    y_cuda, dx_cuda = _run(cuda, x.cuda(), dy.cuda())
    y_cpu, dx_cpu = _run(cpu, x, dy)
    # the GEMMs: cuBLAS against the reference's fp32 sums, within summation order
    torch.testing.assert_close(y_cuda.cpu().float(), y_cpu.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dx_cuda.cpu().float(), dx_cpu.float(), rtol=1e-2, atol=1e-2)


def test_a_compiled_frozen_layer_is_the_eager_one_bit_for_bit():
    layer = _frozen(3072, 3072, "cuda")
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(1024, 3072, generator=g).bfloat16().cuda(), torch.randn(1024, 3072, generator=g).bfloat16().cuda()
    eager = _run(layer, x, dy)
    compiled = _run(torch.compile(layer), x, dy)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
