"""torch.library custom ops for every MX/FP8 step, with fake (meta) implementations.

Being opaque custom ops with fake impls is what lets `torch.compile` trace MX linears with no
graph breaks (DESIGN.md §4). Each op dispatches on the device: CUDA runs the Triton packers
and cuBLAS FP8 GEMMs of `mxflux.kernels`; on the CPU the packer is the compiled, bit-identical
`kernels.pack_cpu` (numba) and the GEMM the reference; everything else runs the pure-PyTorch
reference, which is also the definition the kernels are tested against. `MXFLUX_REFERENCE=1`
forces the reference everywhere (for A/B numerics checks).
"""

from __future__ import annotations

import os

import torch

from .gemm_reference import scaled_gemm_reference
from .pack_reference import FP8_DTYPES, fp8_pack_reference, pack_reference, padded_rows

__all__ = ["mx_pack", "scaled_gemm", "fp8_pack", "use_kernels"]

_EMPTY_DTYPE = torch.float32


def use_kernels(t: torch.Tensor) -> bool:
    """Fast kernels run on CUDA unless MXFLUX_REFERENCE=1 asks for the reference there."""
    return t.is_cuda and os.environ.get("MXFLUX_REFERENCE", "0") != "1"


def _granularity(g: int) -> str | int:
    return "row" if g == 0 else g


def _empty(device) -> torch.Tensor:
    return torch.empty(0, dtype=_EMPTY_DTYPE, device=device)


@torch.library.custom_op("mxflux::mx_pack", mutates_args=("counter",))
def mx_pack(
    x: torch.Tensor,
    aux: torch.Tensor | None,
    counter: torch.Tensor,
    row: bool,
    col: bool,
    granularity: int,
    hadamard: bool,
    prologue: str,
    colsum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to E2M3 and fold it to FP8 GEMM operands (see pack_reference).

    granularity 0 means one scale per row. Blocks outside the fold window are added to
    `counter` (int64, one element) on the device: no host sync. Unrequested outputs are empty.
    """
    if use_kernels(x):
        from ..kernels import pack_cuda

        p = pack_cuda(x, row=row, col=col, granularity=_granularity(granularity), hadamard=hadamard,
                      prologue=prologue, aux=aux, colsum=colsum)
    else:
        from ..kernels.pack_numba import cpu_kernel_available, pack_cpu

        pack = pack_cpu if x.device.type == "cpu" and cpu_kernel_available() else pack_reference
        p = pack(x, row=row, col=col, granularity=_granularity(granularity), hadamard=hadamard,
                 prologue=prologue, aux=aux, colsum=colsum)
    counter.add_(p.n_inexact.reshape(counter.shape))
    outs = (p.row_data, p.row_scale, p.col_data, p.col_scale, p.colsum)
    return tuple(_empty(x.device) if t is None else t for t in outs)


@mx_pack.register_fake
def _(x, aux, counter, row, col, granularity, hadamard, prologue, colsum):
    r, c = x.shape
    rp = padded_rows(r, _granularity(granularity))
    e = x.new_empty(0, dtype=_EMPTY_DTYPE)
    groups_row = 1 if granularity == 0 else c // granularity
    groups_col = 1 if granularity == 0 else rp // granularity
    fp8 = torch.float8_e4m3fn
    return (
        x.new_empty(r, c, dtype=fp8) if row else e.clone(),
        x.new_empty(r, groups_row, dtype=torch.float32) if row else e.clone(),
        x.new_empty(c, rp, dtype=fp8) if col else e.clone(),
        x.new_empty(c, groups_col, dtype=torch.float32) if col else e.clone(),
        x.new_empty(c, dtype=torch.float32) if colsum else e.clone(),
    )


@torch.library.custom_op("mxflux::scaled_gemm", mutates_args=())
def scaled_gemm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(A ⊙ scale_a)(B ⊙ scale_b)ᵀ + bias with fp32 accumulation and one rounding (gemm_reference)."""
    if use_kernels(a_data):
        from ..kernels import scaled_gemm_cuda

        return scaled_gemm_cuda(a_data, a_scale, b_data, b_scale, bias, out_dtype)
    return scaled_gemm_reference(a_data, a_scale, b_data, b_scale, bias, out_dtype)


@scaled_gemm.register_fake
def _(a_data, a_scale, b_data, b_scale, bias, out_dtype):
    return a_data.new_empty(a_data.shape[0], b_data.shape[0], dtype=out_dtype)


# --- FP8 baseline (DESIGN.md: the MLPerf FP8 recipe): row-wise current scaling -------------


@torch.library.custom_op("mxflux::fp8_pack", mutates_args=())
def fp8_pack(
    x: torch.Tensor, row: bool, col: bool, fmt: str, colsum: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both orientations of a row-wise-scaled FP8 operand (fp8_pack_reference); unrequested outputs empty."""
    if use_kernels(x) and x.dtype == torch.bfloat16 and x.numel() > 0:
        from ..kernels import fp8_pack_cuda

        outs = fp8_pack_cuda(x, row=row, col=col, fmt=fmt, colsum=colsum)
    else:
        outs = fp8_pack_reference(x, row=row, col=col, fmt=fmt, colsum=colsum)
    return tuple(_empty(x.device) if t is None else t for t in outs)


@fp8_pack.register_fake
def _(x, row, col, fmt, colsum):
    r, c = x.shape
    rp = padded_rows(r)
    dtype = FP8_DTYPES[fmt]
    e = x.new_empty(0, dtype=_EMPTY_DTYPE)
    return (
        x.new_empty(r, c, dtype=dtype) if row else e.clone(),
        x.new_empty(r, 1, dtype=torch.float32) if row else e.clone(),
        x.new_empty(c, rp, dtype=dtype) if col else e.clone(),
        x.new_empty(c, 1, dtype=torch.float32) if col else e.clone(),
        x.new_empty(c, dtype=torch.float32) if colsum else e.clone(),
    )
