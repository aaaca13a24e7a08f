"""torch.library custom ops for every MX/FP8 step, with fake (meta) implementations.

Being opaque custom ops with fake impls is what lets `torch.compile` trace MX linears with no
graph breaks (DESIGN.md §4). They are defined with the low-level `torch.library.Library` API
(a schema string and one Python kernel for every backend) rather than the `custom_op`
decorator: the decorator's Python wrapper cost ~100 us of host time per call (measured with an
empty body: 120 us vs 28 us), and a training step of Flux-12B makes thousands of these calls, so
the step became host-bound (benchmarks/RESULTS.md). The ops are only ever called inside our
autograd Functions, so they need no autograd formula of their own.

Each op dispatches on the device: CUDA runs the Triton packers and cuBLAS FP8 GEMMs of
`mxflux.kernels`; on the CPU the packer is the compiled, bit-identical `kernels.pack_cpu`
(numba) and the GEMM the reference; everything else runs the pure-PyTorch reference, which is
also the definition the kernels are tested against. `MXFLUX_REFERENCE=1` forces the reference
everywhere (for A/B numerics checks).
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


_LIB = torch.library.Library("mxflux", "DEF")  # kept alive for the process: it owns the registrations
_LIB.define("mx_pack(Tensor x, Tensor? aux, Tensor(a!) counter, bool row, bool col, int granularity, "
            "bool hadamard, str prologue, bool colsum) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("scaled_gemm(Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, Tensor? bias, "
            "ScalarType out_dtype) -> Tensor")
_LIB.define("fp8_pack(Tensor x, bool row, bool col, str fmt, bool colsum) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _register(name: str, kernel, fake):
    """One Python kernel for every backend (it dispatches on the device itself), and the fake."""
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"mxflux::{name}", fake, lib=_LIB)
    return getattr(torch.ops.mxflux, name)


def _mx_pack(
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


def _mx_pack_fake(x, aux, counter, row, col, granularity, hadamard, prologue, colsum):
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


mx_pack = _register("mx_pack", _mx_pack, _mx_pack_fake)


def _scaled_gemm(
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


def _scaled_gemm_fake(a_data, a_scale, b_data, b_scale, bias, out_dtype):
    return a_data.new_empty(a_data.shape[0], b_data.shape[0], dtype=out_dtype)


scaled_gemm = _register("scaled_gemm", _scaled_gemm, _scaled_gemm_fake)


# --- FP8 baseline (DESIGN.md: the MLPerf FP8 recipe): row-wise current scaling -------------


def _fp8_pack(
    x: torch.Tensor, row: bool, col: bool, fmt: str, colsum: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both orientations of a row-wise-scaled FP8 operand (fp8_pack_reference); unrequested outputs empty."""
    if use_kernels(x) and x.dtype == torch.bfloat16 and x.numel() > 0:
        from ..kernels import fp8_pack_cuda

        outs = fp8_pack_cuda(x, row=row, col=col, fmt=fmt, colsum=colsum)
    else:
        outs = fp8_pack_reference(x, row=row, col=col, fmt=fmt, colsum=colsum)
    return tuple(_empty(x.device) if t is None else t for t in outs)


def _fp8_pack_fake(x, row, col, fmt, colsum):
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


fp8_pack = _register("fp8_pack", _fp8_pack, _fp8_pack_fake)
