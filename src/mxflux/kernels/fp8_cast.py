"""Triton row-wise FP8 casts for FP8Linear: `fp8_pack_cuda`, bit-identical to the eager reference.

The FP8 baseline (the MLPerf "hybrid" recipe: E4M3 forward operands, E5M2 gradients) scales every
row of a GEMM operand by amax/max(format). A GEMM operand x [R, C] is needed in both orientations:
the row one (scale per row of x, amax over C) and the column one (x transposed, zero-padded to
Rp rows, scale per column of x, amax over R). No byte of either can be written before its whole
row or column has been seen, so this is two passes over x, the same structure as the MX packer's
granularity "row" (kernels/pack.py), without rotation or blocks:

- pass 1 reads x once and takes both abs-maxima (and the optional column sums) with one atomic
  per row and column per program: the maxima are taken on the bf16 bit patterns, which order
  like the magnitudes (NaN above Inf, so a NaN row gives a NaN scale, as torch's amax does);
- pass 2 reads x again, computes the scales with the reference's expression
  (amax > 0 ? amax / fmax : 1, IEEE division), divides, saturates and converts with the
  hardware's round-to-nearest-even, and writes the row bytes and the transposed column bytes.

6 bytes move per element (2 + 2 read, 1 + 1 written) against the eager reference's ~20 passes.
Under the CPU interpreter the FP8 conversions are emulated in integer arithmetic (its own casts
round half-up).
"""

from __future__ import annotations

import torch

from .pack import HAS_TRITON, _check_input, _interpreting, _launch_opts, _num_sms

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .pack import _bf16_to_f32, _f32_to_e4m3, _f32_to_fp8_bits

__all__ = ["fp8_pack_cuda"]

_BR, _BC = 64, 128  # tile: rows x columns of x


if HAS_TRITON:

    @triton.jit
    def _f32_to_e5m2(x, HW: tl.constexpr):
        """E5M2 byte of fp32 x (|x| <= 57344 or NaN): nearest even, NaN -> 0x7F (torch's byte)."""
        if HW:
            return x.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:  # 2 mantissa bits, bias 15; subnormals below 2^-14 in steps of 2^-16 (the fp32 quantum at 2^7)
            return _f32_to_fp8_bits(x, 21, 448, 6.103515625e-05, 128.0, 65536.0, 0x7B)

    @triton.jit
    def _to_fp8(v, FMT: tl.constexpr, HW: tl.constexpr):
        if FMT == 0:
            return _f32_to_e4m3(v, HW)
        else:
            return _f32_to_e5m2(v, HW)

    @triton.jit
    def _abs_bits(x):
        """|x| of a bf16 tile as int32 bit patterns (monotone in the magnitude; NaN above Inf)."""
        return x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF

    @triton.jit
    def _fp8_amax_kernel(x_ptr, sx, R, C, row_amax, col_amax, sums, n_rt,
                     DO_ROW: tl.constexpr, DO_COL: tl.constexpr, DO_COLSUM: tl.constexpr,
                     HW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """Pass 1: per-row and per-column max of |x| (bf16 bits) and column sums, by atomics."""
        pc = tl.program_id(0)
        cols = pc * BC + tl.arange(0, BC)
        cmask = cols < C
        col_max = tl.zeros([BC], dtype=tl.int32)
        col_sum = tl.zeros([BC], dtype=tl.float32)
        for t in range(tl.program_id(1), n_rt, tl.num_programs(1)):
            rows = t * BR + tl.arange(0, BR)
            rmask = rows < R
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + cols[None, :], mask=m, other=0.0)
            b = _abs_bits(x)
            if DO_ROW:
                tl.atomic_max(row_amax + rows, tl.max(b, axis=1), mask=rmask, sem="relaxed")
            if DO_COL:
                col_max = tl.maximum(col_max, tl.max(b, axis=0))
            if DO_COLSUM:
                col_sum += tl.sum(_bf16_to_f32(x, HW), axis=0)
        if DO_COL:
            tl.atomic_max(col_amax + cols, col_max, mask=cmask, sem="relaxed")
        if DO_COLSUM:
            tl.atomic_add(sums + cols, col_sum, mask=cmask, sem="relaxed")

    @triton.jit
    def _saturate(v, FMAX: tl.constexpr):
        """clamp(v, -fmax, fmax) keeping NaN (the hardware's max/min would return the other operand)."""
        v = tl.maximum(v, -FMAX, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(v, FMAX, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _scale_of(amax_bits, FMAX: tl.constexpr):
        """The reference's scale: amax > 0 ? amax / fmax : 1 (IEEE division, NaN stays NaN)."""
        amax = (amax_bits << 16).to(tl.float32, bitcast=True)  # bf16 bits -> fp32, exact
        return tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), 1.0)

    @triton.jit
    def _fp8_cast_kernel(x_ptr, sx, R, C, Rp, row_amax, col_amax, row_data, row_scale, col_data, col_scale,
                     DO_ROW: tl.constexpr, DO_COL: tl.constexpr, FMT: tl.constexpr, FMAX: tl.constexpr,
                     HW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """Pass 2: x / scale, saturated, to FP8, in both orientations (the column one transposed)."""
        pc = tl.program_id(0)
        pr = tl.program_id(1)
        rows = pr * BR + tl.arange(0, BR)
        cols = pc * BC + tl.arange(0, BC)
        rmask = rows < R
        cmask = cols < C
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + cols[None, :], mask=m, other=0.0)
        xf = _bf16_to_f32(x, HW)
        if DO_ROW:
            rs = _scale_of(tl.load(row_amax + rows, mask=rmask, other=0), FMAX)
            v = tl.div_rn(xf, tl.broadcast_to(rs[:, None], xf.shape))
            v = _saturate(v, FMAX)
            q = _to_fp8(v, FMT, HW)
            tl.store(row_data + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=m)
            tl.store(row_scale + rows, rs, mask=rmask & (pc == 0))
        if DO_COL:
            cs = _scale_of(tl.load(col_amax + cols, mask=cmask, other=0), FMAX)
            v = tl.div_rn(xf, tl.broadcast_to(cs[None, :], xf.shape))
            v = _saturate(v, FMAX)
            qt = tl.trans(_to_fp8(v, FMT, HW))  # [BC, BR]: contiguous along the column orientation's rows
            pmask = cmask[:, None] & (rows < Rp)[None, :]  # rows R..Rp are x's zero padding: 0 bytes
            tl.store(col_data + cols[:, None].to(tl.int64) * Rp + rows[None, :], qt, mask=pmask)
            tl.store(col_scale + cols, cs, mask=cmask & (pr == 0))


def fp8_pack_cuda(x: torch.Tensor, *, row: bool = True, col: bool = True, fmt: str = "e4m3",
                  colsum: bool = False, _hw: bool | None = None, _poison: bool = False):
    """Triton twin of `mxflux.ops.pack_reference.fp8_pack_reference` (same outputs, bit for bit).

    x: bfloat16 [R, C] on CUDA. Returns (row_data [R, C], row_scale [R, 1], col_data [C, Rp],
    col_scale [C, 1], colsum [C]) with None for what was not asked for; data in the torch FP8
    dtype of fmt, scales fp32. colsum equals the reference up to fp32 summation order.
    """
    from ..ops.pack_reference import FP8_DTYPES, padded_rows  # lazy: ops imports kernels

    if not HAS_TRITON:
        raise RuntimeError("fp8_pack_cuda: Triton is not installed; use the reference fp8_pack on this machine")
    if not (torch.cuda.is_available() or _interpreting()):
        raise RuntimeError("fp8_pack_cuda: no CUDA device; use the reference fp8_pack on this machine")
    _check_input(x, "x")
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt: expected one of {sorted(FP8_DTYPES)}, got {fmt!r}")
    for name, flag in (("row", row), ("col", col), ("colsum", colsum)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    dtype = FP8_DTYPES[fmt]
    fmax = torch.finfo(dtype).max
    R, C = x.shape
    if R == 0 or C == 0:  # the reference's amax has nothing to reduce either
        raise ValueError(f"x: expected a non-empty [rows, cols] tensor, got shape {tuple(x.shape)}")
    Rp = padded_rows(R)
    dev = x.device
    row_data = torch.empty((R, C), dtype=torch.uint8, device=dev) if row else None
    row_scale = torch.empty((R, 1), dtype=torch.float32, device=dev) if row else None
    col_data = torch.empty((C, Rp), dtype=torch.uint8, device=dev) if col else None
    col_scale = torch.empty((C, 1), dtype=torch.float32, device=dev) if col else None
    if _poison:  # tests: 0xFF is NaN in fp32 and in both FP8 formats, so an unwritten element shows
        for t in (row_data, row_scale, col_data, col_scale):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)
    # one zero-filled workspace: row amax bits [R] | col amax bits [C] | colsum fp32 [C]
    ws = torch.zeros(R + 2 * C, dtype=torch.int32, device=dev)
    row_amax, col_amax, sums = ws[:R], ws[R:R + C], ws[R + C:].view(torch.float32)

    if x.stride(1) != 1:
        x = x.contiguous()
    if row or col or colsum:
        hw = (not _interpreting()) if _hw is None else bool(_hw)
        opts = _launch_opts(8)  # IEEE subnormals in libdevice's division, as torch's kernels
        n_ct, n_rt = -(-C // _BC), -(-R // _BR)
        slots = max(1, min(n_rt, (4 * _num_sms(dev.index or 0) if dev.type == "cuda" else 4) // n_ct))
        _fp8_amax_kernel[(n_ct, slots)](x, x.stride(0), R, C, row_amax, col_amax, sums, n_rt,
                                    DO_ROW=row, DO_COL=col, DO_COLSUM=colsum, HW=hw, BR=_BR, BC=_BC, **opts)
        if row or col:
            dummy = ws
            _fp8_cast_kernel[(n_ct, -(-Rp // _BR))](
                x, x.stride(0), R, C, Rp, row_amax, col_amax,
                row_data if row else dummy, row_scale if row else dummy,
                col_data if col else dummy, col_scale if col else dummy,
                DO_ROW=row, DO_COL=col, FMT=0 if fmt == "e4m3" else 1, FMAX=fmax, HW=hw,
                BR=_BR, BC=_BC, **opts)
    return (
        row_data.view(dtype) if row else None,
        row_scale,
        col_data.view(dtype) if col else None,
        col_scale,
        sums if colsum else None,
    )
