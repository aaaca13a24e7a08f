"""Triton MX packers for Hopper: `pack_cuda`, bit-identical to `mxflux.ops.pack_reference`.

One bf16 matrix x [R, C] goes in; out come the FP8 operands of the MX-exact fold (DESIGN.md §2–§3):
the row orientation (blocks of 32 along C) and the column orientation (the transposed copy,
blocks of 32 along R, R zero-padded to Rp), each as E4M3 data plus fp32 group scales, optional
column sums of the prologue output and a device-side count of blocks outside the fold window.

Design (numbers and measurements in benchmarks/NOTES.md and RESULTS.md):

- Persistent programs walk a column strip in tiles of 128 rows x 64 columns (x 128 columns and
  16 warps for 1x128 groups), prefetching the next tile while computing this one. Each tile is
  read from DRAM once. Every thread then holds one whole 32-element row block and one whole
  32-row column block in registers (a 32-tuple of tensors): the butterflies, the amax and the
  encoding are register code with no shuffles. Getting there costs one re-layout of the bf16 tile
  through shared memory per orientation (the column one is the transpose). Prologues (tanh-GELU,
  its gradient) run once per element, in registers, before both orientations.
- granularity 32 and 128 need nothing outside the tile: one pass, 2 B read + 2 B written per
  element (+ scales). granularity "row" needs the largest block exponent of a whole row (C long)
  and of a whole column (R long) before any byte can be written, so it runs two passes over x:
  pass 1 only rotates and takes block exponents (per-row / per-column maxima by atomic max),
  pass 2 is the one-pass kernel reading those maxima (6 B/element in all).
- Encoding: y·2^(-e-6) is converted to E4M3 with the hardware's round-to-nearest-even. That is
  exactly E2M3 rounding (E4M3's subnormal step 2^-9 lines up with E2M3's 2^-3 at this shift,
  and both have 3 mantissa bits above it). The byte is decoded to f16 (exact), clamped to
  ±7.5·2^-6 (E2M3 saturation), multiplied by 2^(d+11) (d = e_block - e_ref; NaN for NaN blocks)
  and converted to E4M3 again: q·2^(d+5), the folded element, rounded to nearest even when the
  block lies below the exact window, as `fold_to_e4m3` does. Under the CPU interpreter the
  conversions are emulated bit for bit in integer arithmetic (the interpreter's own FP8 and bf16
  casts do not round to nearest even and mangle subnormals).

Everything that touches Triton is guarded: without Triton (or without CUDA) this module imports
and `pack_cuda` raises a RuntimeError that says why.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..mx.hadamard import HADAMARD_SCALE

try:  # Triton is optional: CPU-only installs have none.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except Exception:  # ImportError, or a Triton that cannot initialise on this machine
    triton = tl = libdevice = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "pack_cuda", "prologue_cuda", "kernel_available"]

_PROLOGUE_IDS = {"none": 0, "gelu_tanh": 1, "gelu_tanh_grad": 2}
_GRAN_IDS = {"row": 0, 32: 32, 128: 128}
_BR = 128  # rows per tile (4 column blocks: one 1x128 group of the column orientation)
# (32-column blocks per tile, warps): one row block and one column block per thread in both.
# 1x128 groups need 4 blocks along C in the tile; the others take half as wide a tile so that
# two CTAs fit on an SM.
_TILE = {0: (2, 8), 32: (2, 8), 128: (4, 16)}

# torch's CUDA tanh-GELU constants (ActivationGeluKernel.cu): double expressions rounded to fp32.
_K_BETA = float(torch.tensor(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5, dtype=torch.float32))
_K_KAPPA = float(torch.tensor(0.044715, dtype=torch.float32))
_K_3KAPPA = float(torch.tensor(3.0, dtype=torch.float32) * torch.tensor(_K_KAPPA, dtype=torch.float32))


@functools.cache
def _interpreting() -> bool:
    """Triton's CPU interpreter. Read once, as Triton itself reads it when the kernels are defined
    (an environment lookup per call was a measurable part of the launch path's host time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available() -> bool:
    """True when pack_cuda can run here: Triton importable and a CUDA device (or the interpreter)."""
    return HAS_TRITON and (torch.cuda.is_available() or _interpreting())


if HAS_TRITON:
    _HSCALE = tl.constexpr(HADAMARD_SCALE)
    _KB = tl.constexpr(_K_BETA)
    _KK = tl.constexpr(_K_KAPPA)
    _K3K = tl.constexpr(_K_3KAPPA)

    # ---------------------------------------------------------------- tuples of tensors
    @triton.jit
    def _unzip(t, LOGN: tl.constexpr):
        """[..., 2, ..., 2] (LOGN trailing 2s) -> tuple of 2^LOGN tensors, index = those bits."""
        level = (t,)
        for lev in tl.static_range(LOGN):
            lo = ()
            hi = ()
            for i in tl.static_range(1 << lev):
                a, b = tl.split(level[i])
                lo = lo + (a,)
                hi = hi + (b,)
            level = lo + hi
        return level

    @triton.jit
    def _zip(xs, LOGN: tl.constexpr):
        """Inverse of _unzip: tuple of 2^LOGN tensors -> [..., 2, ..., 2]."""
        level = xs
        for lev in tl.static_range(LOGN):
            nxt = ()
            for i in tl.static_range(1 << (LOGN - 1 - lev)):
                nxt = nxt + (tl.join(level[i], level[i + (1 << (LOGN - 1 - lev))]),)
            level = nxt
        return level[0]

    @triton.jit
    def _fwht32(xs):
        """Butterflies h = 1, 2, 4, 8, 16 in that order (the add order is the definition)."""
        for s in tl.static_range(5):
            out = ()
            for j in tl.static_range(32):
                if ((j >> s) & 1) == 0:
                    out = out + (xs[j] + xs[j + (1 << s)],)
                else:
                    out = out + (xs[j - (1 << s)] - xs[j],)
            xs = out
        return xs

    # ---------------------------------------------------------------- exact helpers
    @triton.jit
    def _pow2_f32(k):
        """Exact fp32 2^k for integer k in [-149, 127] (subnormals included)."""
        bits = tl.where(k >= -126, (k + 127) << 23, 1 << tl.minimum(tl.maximum(k + 149, 0), 22))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _f16_pow2_bits(k):
        """Bits of the f16 2^k (k <= 15), 0 below f16's smallest subnormal."""
        sub = tl.where(k >= -24, 1 << tl.minimum(tl.maximum(k + 24, 0), 9), 0)
        return tl.where(k >= -14, (k + 15) << 10, sub)

    @triton.jit
    def _f32_to_fp8_bits(x, SHIFT: tl.constexpr, BIAS_OFF: tl.constexpr, MIN_NORMAL: tl.constexpr,
                         SUB_Q: tl.constexpr, SUB_R: tl.constexpr, MAX_CODE: tl.constexpr):
        """FP8 byte of fp32 x in integer arithmetic (the interpreter's own casts round half-up):
        nearest even, saturating at MAX_CODE, NaN -> 0x7F. SHIFT = 23 - mantissa bits, BIAS_OFF =
        (127 - bias) << mantissa bits; below MIN_NORMAL the fp32 quantum at SUB_Q is the format's
        subnormal step and SUB_R its reciprocal."""
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        # normal range: round the fp32 mantissa, ties to even (carries bump the exponent)
        normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - BIAS_OFF
        sub = (((a + SUB_Q) - SUB_Q) * SUB_R).to(tl.int32)
        code = tl.where(a < MIN_NORMAL, sub, tl.minimum(normal, MAX_CODE)) | sign
        code = tl.where(mag > 0x7F800000, 0x7F, code)
        return code.to(tl.uint8)

    @triton.jit
    def _f32_to_e4m3(x, HW: tl.constexpr):
        """E4M3 byte of fp32 x: nearest even, saturating at ±448, NaN -> 0x7F."""
        if HW:
            return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:  # 3 mantissa bits, bias 7; subnormals below 2^-6 in steps of 2^-9 (the fp32 quantum at 2^14)
            return _f32_to_fp8_bits(x, 20, 960, 0.015625, 16384.0, 512.0, 0x7E)

    @triton.jit
    def _refold(b1, f16bits, HW: tl.constexpr):
        """E4M3 byte of sat(b1)·F: b1 = E4M3 byte of q·2^-6 (unsaturated), F = f16 2^(d+11) or NaN."""
        if HW:
            h = b1.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            f = f16bits.to(tl.int16).to(tl.float16, bitcast=True)
            # f16x2: clamp to ±7.5·2^-6 (E2M3 saturation), then scale; Triton would widen to f32.
            h = tl.inline_asm_elementwise(
                "{ .reg .b32 lo, hi; mov.b32 lo, 0xAF80AF80; mov.b32 hi, 0x2F802F80; "
                "max.f16x2 $0, $1, lo; min.f16x2 $0, $0, hi; mul.rn.f16x2 $0, $0, $2; }",
                "=r,r,r",
                [h, f],
                dtype=tl.float16,
                is_pure=True,
                pack=2,
            )
            return h.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            m = b1.to(tl.int32)
            ex = (m >> 3) & 15
            mant = m & 7
            mag = tl.where(ex == 0, mant.to(tl.float32) * 0.001953125,
                           (mant + 8).to(tl.float32) * _pow2_f32(ex - 10))
            # sign by bit (Triton's unary minus is 0 - x, which loses the sign of zero)
            v = (mag.to(tl.int32, bitcast=True) | ((m & 0x80) << 24)).to(tl.float32, bitcast=True)
            v = tl.minimum(tl.maximum(v, -0.1171875), 0.1171875)
            f = f16bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            return _f32_to_e4m3(v * f, False)

    @triton.jit
    def _widen(v, HW: tl.constexpr):
        """bf16 tensor (even element count per thread) -> fp32: one shift or mask per element."""
        if HW:
            return tl.inline_asm_elementwise(
                "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [v],
                dtype=tl.float32, is_pure=True, pack=2)
        else:
            return _bf16_to_f32(v, False)

    @triton.jit
    def _bf16_to_f32(v, HW: tl.constexpr):
        if HW:
            return v.to(tl.float32)
        else:  # the interpreter's bf16 cast mangles subnormals: widen by bits
            return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)

    # ---------------------------------------------------------------- prologues
    @triton.jit
    def _tanh(x, HW: tl.constexpr):
        if HW:
            return libdevice.tanh(x)
        else:
            # the interpreter maps libdevice calls to numpy; spelled out to stay version-proof
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            return tl.where(x < 0, -t, t)

    @triton.jit
    def _round_bf16(x, HW: tl.constexpr):
        """fp32 -> the fp32 value of its bf16 rounding (nearest even)."""
        if HW:
            return x.to(tl.bfloat16).to(tl.float32)
        else:
            b = x.to(tl.int32, bitcast=True)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, b | 0x400000, r)
            return (r & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _prologue(x, aux, PROLOGUE: tl.constexpr, HW: tl.constexpr):
        """fp32 values of bf16 inputs -> fp32 value of the bf16 result torch's CUDA kernel computes
        (fp32 math, FMAs exactly where nvcc contracts, one rounding to bf16)."""
        if PROLOGUE == 0:
            return x
        elif PROLOGUE == 1:
            x_cube = x * x * x
            inner = _KB * tl.fma(_KK, x_cube, x)
            t = _tanh(inner, HW)
            return _round_bf16((0.5 * x) * (1.0 + t), HW)
        else:
            dy = x
            xf = aux
            x_sq = xf * xf
            x_cube = x_sq * xf
            inner = _KB * tl.fma(_KK, x_cube, xf)
            t = _tanh(inner, HW)
            left = 0.5 * xf
            right = 1.0 + t
            left_derivative = 0.5 * right
            tanh_derivative = tl.fma(-t, t, 1.0)
            inner_derivative = _KB * tl.fma(_K3K, x_sq, 1.0)
            derivative = tl.fma(left * tanh_derivative, inner_derivative, left_derivative)
            return _round_bf16(dy * derivative, HW)

    @triton.jit
    def _prologue_kernel(x_ptr, aux_ptr, out_ptr, n, PROLOGUE: tl.constexpr, HW: tl.constexpr,
                         BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        x = _bf16_to_f32(tl.load(x_ptr + o, mask=m, other=0.0), HW)
        if PROLOGUE == 2:
            aux = _bf16_to_f32(tl.load(aux_ptr + o, mask=m, other=0.0), HW)
        else:
            aux = x
        v = _prologue(x, aux, PROLOGUE, HW).to(tl.int32, bitcast=True) >> 16
        tl.store(out_ptr + o, v.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=m)

    # ---------------------------------------------------------------- MX blocks
    @triton.jit
    def _rotate_amax(xs, HADAMARD: tl.constexpr):
        """32-tuple of fp32 -> (rotated 32-tuple, amax bits: NaN if any element is NaN)."""
        if HADAMARD:
            hs = _fwht32(xs)
            ys = ()
            for j in tl.static_range(32):
                ys = ys + (hs[j] * _HSCALE,)
        else:
            ys = xs
        amax = tl.abs(ys[0])
        for j in tl.static_range(1, 32):
            amax = tl.maximum(amax, tl.abs(ys[j]), propagate_nan=tl.PropagateNan.ALL)
        return ys, amax.to(tl.int32, bitcast=True)

    @triton.jit
    def _amax_only(xs, HADAMARD: tl.constexpr):
        """amax bits of the rotated block without rotating every element: rounding is monotone,
        so max_j RN(h_j·c) == RN(max_j |h_j| · c) (NaN included). Pass 1 needs nothing else."""
        if HADAMARD:
            hs = _fwht32(xs)
        else:
            hs = xs
        amax = tl.abs(hs[0])
        for j in tl.static_range(1, 32):
            amax = tl.maximum(amax, tl.abs(hs[j]), propagate_nan=tl.PropagateNan.ALL)
        if HADAMARD:
            amax = amax * _HSCALE
        return amax.to(tl.int32, bitcast=True)

    @triton.jit
    def _block_info(ab):
        """From amax bits: (e, bad, live) exactly as block_exponents / fold_to_e4m3 decide."""
        e = tl.minimum(tl.maximum((ab >> 23) - 129, -127), 127)  # floor(log2 amax) - emax(2)
        bad = ab >= 0x7F800000  # NaN or Inf in the block -> scale 0xFF, data NaN
        # some code is non-zero iff amax·2^-e > 1/16: always when e is unclamped, else amax > 2^-131
        live = (ab > 0x40000) & (ab < 0x7F800000)
        return e, bad, live

    @triton.jit
    def _encode(ys, e, e_ref, bad, HW: tl.constexpr):
        """32-tuple of rotated fp32 -> 16-tuple of [..., 2] folded E4M3 byte pairs (elements 2i,
        2i+1): every cast and the f16x2 asm work on two values per instruction, and the pair is
        already two adjacent bytes of the output."""
        s = _pow2_f32(-e - 6)
        fb = tl.where(bad, 0x7E00, _f16_pow2_bits(e - e_ref + 11))
        fb2 = tl.join(fb, fb)
        out = ()
        for i in tl.static_range(16):
            b1 = _f32_to_e4m3(tl.join(ys[2 * i] * s, ys[2 * i + 1] * s), HW)  # E2M3 rounding of y·2^-e
            out = out + (_refold(b1, fb2, HW),)
        return out

    @triton.jit
    def _halves(pairs):
        """16-tuple of [..., 2] byte pairs -> two [..., 16] tensors (bytes 0-15, 16-31 of each
        block): stored as 16 B per thread, the layout Triton's store coalescing picks, so the bytes
        go straight from registers to memory with no shared-memory round trip."""
        lo = ()
        hi = ()
        for i in tl.static_range(8):
            lo = lo + (pairs[i],)
            hi = hi + (pairs[i + 8],)
        zl = _zip(lo, 3)  # [A, B, 2 (parity), i2, i1, i0]: byte 2i + parity
        zh = _zip(hi, 3)
        zl = tl.reshape(tl.permute(zl, (0, 1, 3, 4, 5, 2)), (zl.shape[0], zl.shape[1], 16))
        zh = tl.reshape(tl.permute(zh, (0, 1, 3, 4, 5, 2)), (zh.shape[0], zh.shape[1], 16))
        return zl, zh

    @triton.jit
    def _blocks_of_rows(t, BR: tl.constexpr, NB: tl.constexpr, HW: tl.constexpr):
        """[BR, BC] bf16 tile (lanes along columns) -> 32-tuple of [NB, BR] fp32, element j of each
        row block. The first split is on a lane bit (b4), so Triton re-lays the whole tile out once
        (shared memory) into whole-blocks-per-thread instead of piecemeal."""
        # [NB, BR, b3..b0, b4]: lanes then run along rows, as in the block stores (no second re-layout)
        t = tl.permute(tl.reshape(t, (BR, NB, 2, 2, 2, 2, 2)), (1, 0, 3, 4, 5, 6, 2))
        lv = _unzip(t, 5)  # index p = b4 + 2·(j mod 16)
        xs = ()
        for j in tl.static_range(32):
            xs = xs + (_bf16_to_f32(lv[((j >> 4) & 1) | ((j & 15) << 1)], HW),)
        return xs

    @triton.jit
    def _load_rows(ptr, row0, stride, R, C, col0, r2, c2):
        """[BR, BC] bf16 tile, coalesced (Triton spreads lanes along the contiguous columns)."""
        m = ((row0 + r2) < R) & ((col0 + c2) < C)
        return tl.load(ptr + row0.to(tl.int64) * stride + col0 + r2 * stride + c2, mask=m, other=0.0)

    @triton.jit
    def _load_tile(ptr, row0, stride, R, C, col0, r3, c3, cblk3):
        """Four [BR, NB, 8] bf16 tensors: the 8-column quarters of each block (16 B per thread)."""
        m = ((row0 + r3) < R) & (cblk3 < C)  # constant over a block: 16-byte loads
        base = ptr + row0.to(tl.int64) * stride + col0
        off = r3 * stride + c3
        v0 = tl.load(base + off, mask=m, other=0.0)
        v1 = tl.load(base + off + 8, mask=m, other=0.0)
        v2 = tl.load(base + off + 16, mask=m, other=0.0)
        v3 = tl.load(base + off + 24, mask=m, other=0.0)
        return v0, v1, v2, v3

    @triton.jit
    def _quarters(v0, v1, v2, v3, BR: tl.constexpr, NB: tl.constexpr, HW: tl.constexpr):
        """The four bf16 quarter tensors -> 32-tuple of [BR, NB] fp32: element j of each row block."""
        return (_unzip(tl.reshape(_widen(v0, HW), (BR, NB, 2, 2, 2)), 3)
                + _unzip(tl.reshape(_widen(v1, HW), (BR, NB, 2, 2, 2)), 3)
                + _unzip(tl.reshape(_widen(v2, HW), (BR, NB, 2, 2, 2)), 3)
                + _unzip(tl.reshape(_widen(v3, HW), (BR, NB, 2, 2, 2)), 3))

    @triton.jit
    def _nb_major(xs):
        """32-tuple of [BR, NB] -> [NB, BR] (a relabelling of registers, no data movement)."""
        out = ()
        for j in tl.static_range(32):
            out = out + (tl.permute(xs[j], (1, 0)),)
        return out

    @triton.jit
    def _to_bf16(x, HW: tl.constexpr):
        """fp32 holding a bf16 value -> that bf16 (exact)."""
        if HW:
            return x.to(tl.bfloat16)
        else:
            return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    # ---------------------------------------------------------------- the packer
    # R and the loop bounds vary per call: no value specialisation, one compiled kernel per variant
    @triton.jit(do_not_specialize=["R", "n_row_tiles", "n_prog_r"])
    def _pack_kernel(
        x_ptr, aux_ptr, stride_x, stride_aux, R, C, Rp,
        row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
        colsum_ptr, ninexact_ptr, row_eref_ptr, col_eref_ptr,
        n_row_tiles, n_prog_r,
        PASS: tl.constexpr,  # 1: block exponents only (granularity "row"); 2: encode
        DO_ROW: tl.constexpr, DO_COL: tl.constexpr, DO_COLSUM: tl.constexpr,
        GRAN: tl.constexpr,  # 0 = row, 32, 128
        HADAMARD: tl.constexpr, PROLOGUE: tl.constexpr, HW: tl.constexpr,
        BR: tl.constexpr, NB: tl.constexpr,
        COAL: tl.constexpr,  # coalesced [BR, BC] tile loads, re-laid out once through shared memory
    ):
        RB: tl.constexpr = BR // 32
        BC: tl.constexpr = NB * 32
        pid_c = tl.program_id(0)
        pid_r = tl.program_id(1)
        col0 = pid_c * BC

        r3 = tl.arange(0, BR)[:, None, None]
        c3 = (tl.arange(0, NB) * 32)[None, :, None] + tl.arange(0, 8)[None, None, :]
        cblk3 = col0 + (tl.arange(0, NB) * 32)[None, :, None]  # first column of each block
        rr = tl.arange(0, BR)
        nb2 = tl.arange(0, NB)[:, None]
        cc = tl.arange(0, BC)
        cmask = (col0 + cc) < C
        rb2 = tl.arange(0, RB)[:, None] * 32
        cc2 = col0 + cc[None, :]
        r2 = tl.arange(0, BR)[:, None]
        c2 = tl.arange(0, BC)[None, :]

        # per-thread accumulators in the block layouts, reduced once after the loop
        row_cnt = tl.zeros([NB, BR], dtype=tl.int32)
        col_cnt = tl.zeros([RB, BC], dtype=tl.int32)
        colmax = tl.zeros([RB, BC], dtype=tl.int32)
        csum = tl.zeros([RB, BC], dtype=tl.float32)

        if PASS == 2 and GRAN == 0 and DO_COL:
            cv = tl.load(col_eref_ptr + cc2, mask=cc2 < C, other=0)
            col_eref = tl.where(cv > 0, cv - 128, 0)  # [1, BC]
            if pid_r == 0:
                tl.store(col_scale_ptr + cc2, _pow2_f32(col_eref - 5), mask=cc2 < C)

        # software pipeline: the next tile's loads are in flight while this one is computed
        if COAL:
            tn = _load_rows(x_ptr, pid_r * BR, stride_x, R, C, col0, r2, c2)
            if PROLOGUE == 2:
                an = _load_rows(aux_ptr, pid_r * BR, stride_aux, R, C, col0, r2, c2)
        else:
            v0, v1, v2, v3 = _load_tile(x_ptr, pid_r * BR, stride_x, R, C, col0, r3, c3, cblk3)
            if PROLOGUE == 2:
                a0, a1, a2, a3 = _load_tile(aux_ptr, pid_r * BR, stride_aux, R, C, col0, r3, c3, cblk3)
        for rt in range(pid_r, n_row_tiles, n_prog_r):
            row0 = rt * BR
            nxt = row0 + n_prog_r * BR
            if COAL:
                t_in = tn
                pv = _blocks_of_rows(t_in, BR, NB, HW)
                if PROLOGUE == 2:
                    pa = _blocks_of_rows(an, BR, NB, HW)
                tn = _load_rows(x_ptr, nxt, stride_x, R, C, col0, r2, c2)
                if PROLOGUE == 2:
                    an = _load_rows(aux_ptr, nxt, stride_aux, R, C, col0, r2, c2)
            else:
                q0 = v0
                q1 = v1
                q2 = v2
                q3 = v3
                pv = _quarters(q0, q1, q2, q3, BR, NB, HW)
                if PROLOGUE == 2:
                    pa = _quarters(a0, a1, a2, a3, BR, NB, HW)
                pv = _nb_major(pv)
                if PROLOGUE == 2:
                    pa = _nb_major(pa)
                v0, v1, v2, v3 = _load_tile(x_ptr, nxt, stride_x, R, C, col0, r3, c3, cblk3)
                if PROLOGUE == 2:
                    a0, a1, a2, a3 = _load_tile(aux_ptr, nxt, stride_aux, R, C, col0, r3, c3, cblk3)

            # 32-tuple of [BR, NB] fp32 values: element j of each row block (after the prologue)
            xs = ()
            for j in tl.static_range(32):
                xj = pv[j]
                if PROLOGUE != 0:
                    if PROLOGUE == 2:
                        aj = pa[j]
                    else:
                        aj = xj
                    # padding rows stay exactly +0 (the reference pads after the prologue)
                    xj = tl.where(((row0 + rr) < R)[None, :], _prologue(xj, aj, PROLOGUE, HW), 0.0)
                xs = xs + (xj,)

            # ---------------- row orientation: blocks along C, a whole block in each thread
            if DO_ROW:
                if PASS == 1:
                    ab = _amax_only(xs, HADAMARD)
                else:
                    ys, ab = _rotate_amax(xs, HADAMARD)  # [NB, BR] per block
                e, bad, live = _block_info(ab)
                rows = row0 + rr
                if PASS == 1:
                    rmax = tl.max(tl.where(live, e + 128, 0), axis=0)
                    tl.atomic_max(row_eref_ptr + rows, rmax, mask=(rows < R) & (rmax > 0), sem="relaxed")
                else:
                    if GRAN == 0:
                        rv = tl.load(row_eref_ptr + rows, mask=rows < R, other=0)
                        e_ref = tl.where(rv > 0, rv - 128, 0)[None, :]
                    elif GRAN == 32:
                        e_ref = tl.where(live, e, 0)
                    else:
                        g = tl.max(tl.reshape(tl.where(live, e, -1024), (NB // 4, 4, BR)), axis=1)
                        g = tl.reshape(tl.broadcast_to(g[:, None, :], (NB // 4, 4, BR)), (NB, BR))
                        e_ref = tl.where(g == -1024, 0, g)
                    b2 = _encode(ys, e, e_ref, bad, HW)
                    row_cnt += (live & ((e - e_ref) < -11)).to(tl.int32)
                    ob = row_data_ptr + row0.to(tl.int64) * C + col0
                    zl, zh = _halves(b2)  # [NB, BR, 16] -> [BR, NB, 16]
                    zl = tl.permute(zl, (1, 0, 2))
                    zh = tl.permute(zh, (1, 0, 2))
                    oo = r3 * C + (tl.arange(0, NB) * 32)[None, :, None] + tl.arange(0, 16)[None, None, :]
                    om = ((row0 + r3) < R) & (cblk3 < C)
                    tl.store(ob + oo, zl, mask=om)
                    tl.store(ob + oo + 16, zh, mask=om)
                    if GRAN == 0:
                        if pid_c == 0:
                            tl.store(row_scale_ptr + rows[None, :], _pow2_f32(e_ref - 5), mask=rows[None, :] < R)
                    else:
                        rows2 = rows[None, :]
                        cblk = col0 + nb2 * 32
                        so = rows2.to(tl.int64) * (C // GRAN) + cblk // GRAN
                        sm = (rows2 < R) & (cblk < C) & ((cblk % GRAN) == 0)
                        tl.store(row_scale_ptr + so, _pow2_f32(e_ref - 5), mask=sm)

            # ---------------- column orientation: blocks along R, a whole block in each thread
            if DO_COL or (DO_COLSUM and PASS == 2):
                # one transpose of the bf16 tile through shared memory
                if PROLOGUE != 0:
                    tb = ()
                    for j in tl.static_range(32):
                        tb = tb + (_to_bf16(xs[j], HW),)
                    t = tl.reshape(tl.permute(_zip(tb, 5), (1, 0, 2, 3, 4, 5, 6)), (BR, BC))
                elif COAL:
                    t = t_in
                else:
                    t = tl.join(tl.join(q0, q2), tl.join(q1, q3))  # [BR, NB, 8, q1, q0]
                    t = tl.reshape(tl.permute(t, (0, 1, 3, 4, 2)), (BR, BC))  # column = 32·nb + 8·q + t
                t = tl.permute(tl.reshape(t, (RB, 32, BC)), (0, 2, 1))  # [RB, BC, 32]: row = 32·rb + j
                tc = _unzip(tl.reshape(t, (RB, BC, 2, 2, 2, 2, 2)), 5)  # re-laid out as bf16 (2 B/element)
                xc = ()
                for j in tl.static_range(32):
                    xc = xc + (_bf16_to_f32(tc[j], HW),)
                if DO_COLSUM and PASS == 2:
                    for j in tl.static_range(32):
                        csum += xc[j]
                if DO_COL:
                    if PASS == 1:
                        ab = _amax_only(xc, HADAMARD)
                    else:
                        ys, ab = _rotate_amax(xc, HADAMARD)  # [RB, BC] per block
                    e, bad, live = _block_info(ab)
                    if PASS == 1:
                        colmax = tl.maximum(colmax, tl.where(live, e + 128, 0))
                    else:
                        if GRAN == 0:
                            e_ref = col_eref
                        elif GRAN == 32:
                            e_ref = tl.where(live, e, 0)
                        else:
                            g = tl.max(tl.reshape(tl.where(live, e, -1024), (RB // 4, 4, BC)), axis=1)
                            g = tl.reshape(tl.broadcast_to(g[:, None, :], (RB // 4, 4, BC)), (RB, BC))
                            e_ref = tl.where(g == -1024, 0, g)
                        b2 = _encode(ys, e, e_ref, bad, HW)
                        col_cnt += (live & ((e - e_ref) < -11)).to(tl.int32)
                        zl, zh = _halves(b2)
                        # [BC, RB, 16] so that lanes run along columns, as in the data layout
                        zl = tl.permute(zl, (1, 0, 2))
                        zh = tl.permute(zh, (1, 0, 2))
                        ct = col0 + tl.arange(0, BC)[:, None, None]
                        rt3 = row0 + tl.arange(0, RB)[None, :, None] * 32
                        oo = ct.to(tl.int64) * Rp + rt3 + tl.arange(0, 16)[None, None, :]
                        om = (ct < C) & (rt3 < Rp)
                        tl.store(col_data_ptr + oo, zl, mask=om)
                        tl.store(col_data_ptr + oo + 16, zh, mask=om)
                        if GRAN != 0:
                            rbg = row0 + rb2
                            so = cc2.to(tl.int64) * (Rp // GRAN) + rbg // GRAN
                            sm = (cc2 < C) & (rbg < Rp) & ((rbg % GRAN) == 0)
                            tl.store(col_scale_ptr + so, _pow2_f32(e_ref - 5), mask=sm)

        if PASS == 1:
            if DO_COL:
                cmax = tl.max(colmax, axis=0)
                tl.atomic_max(col_eref_ptr + col0 + cc, cmax, mask=cmask & (cmax > 0), sem="relaxed")
        else:
            if DO_COLSUM:
                tl.atomic_add(colsum_ptr + col0 + cc, tl.sum(csum, axis=0), mask=cmask, sem="relaxed")
            total = tl.sum(tl.sum(row_cnt, axis=0), axis=0) + tl.sum(tl.sum(col_cnt, axis=1), axis=0)
            tl.atomic_add(ninexact_ptr, total.to(tl.int64), sem="relaxed")


# -------------------------------------------------------------------- host side
def _check_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: pack_cuda reads bfloat16, got {x.dtype}")
    if not (x.is_cuda or _interpreting()):
        raise ValueError(f"{name}: pack_cuda needs a CUDA tensor, got device {x.device}")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(n_col_tiles: int, n_row_tiles: int, device: torch.device, warps: int) -> tuple[int, int]:
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    # persistent along rows (the loop prefetches the next tile); ~2 waves of resident CTAs
    resident = 2 if warps <= 8 else 1
    target = 2 * resident * sms
    p = max(1, min(n_row_tiles, -(-target // n_col_tiles)))
    return (n_col_tiles, p)


def _coalesced(prologue: str) -> bool:
    """How tiles are read. "coalesced": [128, 64] bf16 tile loads, re-laid out once through
    shared memory into whole-blocks-per-thread (8-12 % faster measured without a prologue);
    "blocks": each thread loads its own blocks' 16-byte quarters (faster with a prologue, whose
    col-orientation rebuild adds layout conversions to the coalesced variant). MXFLUX_PACK_IO
    (auto | coalesced | blocks) overrides the choice for A/B runs; both are tested."""
    mode = os.environ.get("MXFLUX_PACK_IO", "auto")
    if mode not in ("auto", "coalesced", "blocks"):
        raise ValueError(f"MXFLUX_PACK_IO: expected auto, coalesced or blocks, got {mode!r}")
    return mode == "coalesced" or (mode == "auto" and prologue == "none")


def _launch_opts(num_warps: int) -> dict:
    if _interpreting():
        return {}
    # No FMA contraction (the FMAs of the prologues are written out) and IEEE subnormals in
    # libdevice, as nvcc builds torch's kernels.
    return {"num_warps": num_warps, "enable_fp_fusion": False, "enable_reflect_ftz": False}


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels read 16-byte pieces of rows: contiguous along C, rows 16-byte aligned."""
    if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
        t = t.contiguous()
    return t


def pack_cuda(
    x: torch.Tensor,
    *,
    row: bool = True,
    col: bool = True,
    granularity: str | int = "row",
    hadamard: bool = True,
    fmt: str = "e2m3",
    prologue: str = "none",
    aux: torch.Tensor | None = None,
    colsum: bool = False,
    _hw: bool | None = None,
    _poison: bool = False,
):
    """Triton twin of `mxflux.ops.pack_reference` (same signature and outputs, bit for bit).

    x is a CUDA bfloat16 [R, C] matrix (C a multiple of 32, R any). Only fmt "e2m3" and
    granularity "row", 128 or 32 have kernels. colsum equals the reference up to fp32
    summation order; n_inexact is a 0-d int64 CUDA tensor (no host synchronisation).
    """
    from ..ops.pack_reference import PROLOGUES, Packed, padded_rows  # lazy: ops may import us

    if not HAS_TRITON:
        raise RuntimeError("pack_cuda: Triton is not installed; use mxflux.ops.pack_reference on this machine")
    if not (torch.cuda.is_available() or _interpreting()):
        raise RuntimeError("pack_cuda: no CUDA device; use mxflux.ops.pack_reference on this machine")
    _check_input(x, "x")
    if fmt != "e2m3":
        raise ValueError(f"fmt: pack_cuda has kernels for 'e2m3' only, got {fmt!r}")
    if isinstance(granularity, bool) or granularity not in _GRAN_IDS:
        raise ValueError(f"granularity: pack_cuda supports 'row', 128 or 32, got {granularity!r}")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue: expected one of {PROLOGUES}, got {prologue!r}")
    if prologue == "gelu_tanh_grad":
        if aux is None:
            raise ValueError(f"aux: the gelu_tanh_grad prologue needs the pre-activation, shape {tuple(x.shape)}")
        _check_input(aux, "aux")
        if aux.shape != x.shape or aux.device != x.device:
            raise ValueError(f"aux: expected shape {tuple(x.shape)} on {x.device}, got {tuple(aux.shape)} on {aux.device}")
    for name, flag in (("row", row), ("col", col), ("hadamard", hadamard), ("colsum", colsum)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    R, C = x.shape
    if C % 32:
        raise ValueError(f"x: {C} columns is not a multiple of the block size 32")
    Rp = padded_rows(R, granularity)  # whole blocks, and whole 1x128 groups for granularity 128
    g = _GRAN_IDS[granularity]
    if g == 128 and row and C % 128:
        raise ValueError(f"granularity: 128 must divide the row length, got C={C}")
    dev = x.device

    ngroups_row = 1 if g == 0 else C // g
    ngroups_col = 1 if g == 0 else max(Rp // g, 0)
    row_data = torch.empty((R, C), dtype=torch.uint8, device=dev) if row else None
    row_scale = torch.empty((R, ngroups_row), dtype=torch.float32, device=dev) if row else None
    col_data = torch.empty((C, Rp), dtype=torch.uint8, device=dev) if col else None
    col_scale = torch.empty((C, ngroups_col), dtype=torch.float32, device=dev) if col else None

    if _poison:  # tests: 0xFF bytes are NaN in fp32 and E4M3, so an unwritten element shows
        for t in (row_data, row_scale, col_data, col_scale):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)

    # One zero-filled workspace (one launch): n_inexact int64 | colsum fp32 [C] | e_ref int32 [R + C]
    # (each part starts on a 16-byte boundary, so pointer alignment never changes the compiled kernel;
    # the e_ref parts hold e + 128 for a live block, 0 where none was seen)
    r4 = -(-R // 4) * 4
    ws = torch.zeros(4 + C + (r4 + C if g == 0 else 0), dtype=torch.int32, device=dev)
    ninexact = ws[:2].view(torch.int64)
    sums = ws[4:4 + C].view(torch.float32)
    row_eref = ws[4 + C:4 + C + r4] if g == 0 else ws
    col_eref = ws[4 + C + r4:] if g == 0 else ws

    hw = (not _interpreting()) if _hw is None else bool(_hw)
    if R > 0 and (row or col or colsum):
        dummy = ws
        xw = _rows_contiguous(x)
        aw = _rows_contiguous(aux) if prologue == "gelu_tanh_grad" else xw
        nb, warps = _TILE[g]
        n_rt = -(-Rp // _BR)
        grid = _grid(-(-C // (nb * 32)), n_rt, dev, warps)
        args = (
            xw, aw, xw.stride(0), aw.stride(0), R, C, Rp,
            row_data if row else dummy, row_scale if row else dummy,
            col_data if col else dummy, col_scale if col else dummy,
            sums, ninexact, row_eref, col_eref, n_rt, grid[1],
        )
        meta = dict(
            DO_ROW=row, DO_COL=col, DO_COLSUM=colsum, GRAN=g, HADAMARD=hadamard,
            PROLOGUE=_PROLOGUE_IDS[prologue], HW=hw, BR=_BR, NB=nb, COAL=_coalesced(prologue),
            **_launch_opts(warps),
        )
        if g == 0 and (row or col):
            _pack_kernel[grid](*args, PASS=1, **meta)
        _pack_kernel[grid](*args, PASS=2, **meta)

    f8 = torch.float8_e4m3fn
    return Packed(
        row_data.view(f8) if row else None,
        row_scale,
        col_data.view(f8) if col else None,
        col_scale,
        sums if colsum else None,
        ninexact.view(()),
    )


def prologue_cuda(x: torch.Tensor, prologue: str, aux: torch.Tensor | None = None, *, _hw: bool | None = None):
    """The packer's in-register prologue as a standalone bf16 -> bf16 map (tests, numerics reports)."""
    if not HAS_TRITON:
        raise RuntimeError("prologue_cuda: Triton is not installed")
    _check_input(x, "x")
    if prologue not in _PROLOGUE_IDS:
        raise ValueError(f"prologue: expected one of {tuple(_PROLOGUE_IDS)}, got {prologue!r}")
    if prologue == "gelu_tanh_grad":
        if aux is None or aux.shape != x.shape:
            raise ValueError(f"aux: the gelu_tanh_grad prologue needs the pre-activation, shape {tuple(x.shape)}")
        aux = aux.contiguous()
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    hw = (not _interpreting()) if _hw is None else bool(_hw)
    block = 1024
    opts = {} if _interpreting() else {"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False}
    _prologue_kernel[(max(1, -(-n // block)),)](
        x, aux if aux is not None else x, out, n, PROLOGUE=_PROLOGUE_IDS[prologue], HW=hw, BLOCK=block, **opts
    )
    return out
