"""The reference MX GEMM: C = A·Bᵀ, both operands quantized along K (docs/design.md, "Kernels,
backends and the reference")."""

from __future__ import annotations

import contextlib

import torch

from .quantize import MXTensor

__all__ = ["mx_matmul", "true_fp32"]


@contextlib.contextmanager
def true_fp32(device_type: str):
    """Run the enclosed matmuls in true fp32.

    The references accumulate in true fp32: not TF32 (which drops 13 mantissa bits), and not
    in the bf16 of an enclosing autocast region (a training step's), which would run the matmul
    in bf16 and round its result once more before the bias is added."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def mx_matmul(
    a: MXTensor,
    b: MXTensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """C[..., n] = Σ_k A[..., k]·B[n, k] (+ bias[n]) from the exact dequantized operands.

    `a` is [..., K] and `b` is [N, K], both quantized along K (their last axis) with the same
    rotation setting, so a Hadamard rotation cancels and is never undone. Products are
    accumulated in fp32, the bias is added in fp32, and the result is rounded once to
    `out_dtype` (pass torch.float32 for the unrounded result).
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, MXTensor):
            raise ValueError(f"{name}: expected an MXTensor, got {type(t).__name__}")
        if t.axis != t.codes.dim() - 1:
            raise ValueError(f"{name}: must be quantized along its last (contraction) axis, got axis {t.axis}")
    if b.codes.dim() != 2:
        raise ValueError(f"b: expected a 2-D [N, K] operand, got shape {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a, b: contraction lengths differ ({a.shape[-1]} vs {b.shape[-1]})")
    if a.hadamard != b.hadamard:
        raise ValueError(
            f"a, b: both operands must share the rotation setting (a.hadamard={a.hadamard}, "
            f"b.hadamard={b.hadamard}); otherwise it does not cancel"
        )
    if a.block != b.block:
        raise ValueError(f"a, b: block sizes differ ({a.block} vs {b.block})")
    n = b.shape[0]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,)):
        raise ValueError(f"bias: expected a tensor of shape ({n},), got {getattr(bias, 'shape', bias)}")
    av = a.dequantize(torch.float32, unrotate=False)
    bv = b.dequantize(torch.float32, unrotate=False)
    with true_fp32(av.device.type):
        c = av @ bv.t()
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype)
