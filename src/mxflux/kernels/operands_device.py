"""The device code of the MX operand packers (`operands_cuda`): the Triton helpers a packer kernel is
built of, and the constants they compile in (docs/design.md, "Kernels, backends and the reference").

Every thread holds one whole row block and one whole column block in registers (a tuple of
MX_BLOCK tensors): the Walsh–Hadamard butterflies, the amax, the E2M3 rounding and the FP8 fold are
register code; `tile_exponent_maxima` (the row granularity's pass 1 on a tile) and `tile_operands`
(its pass 2) are shared with the AdamW step that writes the weights' operands (`adamw_cuda`). The
register layout (5 butterfly stages, 5 binary splits of a block, 16-byte quarters) is written for
the OCP MX block of 32 elements. Imported only where Triton is.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..mx.constants import MX_BLOCK
from ..mx.formats import get_format
from ..mx.hadamard import HADAMARD_SCALE
from .triton_common import (
    PAIR_SHUFFLE_ASM,
    bf16_to_f32,
    e4m3_byte_to_f32,
    f16_pow2_bits,
    f32_to_e4m3,
    pow2_f32,
    prologue_f32,
    unzip,
    widen_bf16,
    zip_tuple,
)

if MX_BLOCK != 32:
    raise ImportError(f"operands_device: the kernels' register layout is written for MX_BLOCK = 32, got {MX_BLOCK}")

_E2M3 = get_format("e2m3")  # the one element format with kernels

_BLOCK = tl.constexpr(MX_BLOCK)
_HSCALE = tl.constexpr(HADAMARD_SCALE)
# fp32 exponent bias + emax: floor(log2 amax) - emax from the fp32 exponent bits
_EXP_OFFSET = tl.constexpr(127 + _E2M3.emax)
_SHIFT = tl.constexpr(_E2M3.fold_shift)  # a group's fp32 scale is 2^(e_ref - shift)
_WINDOW = tl.constexpr(_E2M3.fold_window)  # binades below e_ref that still fold exactly
_SHUFFLE_LANE_PAIRS = tl.constexpr(PAIR_SHUFFLE_ASM)
# Four folded bytes (one int32 word) from four fp32 values y·2^-e ($1..$4, in byte order) and
# F = 2^(d+11) as f16x2 ($5): the E2M3 rounding (cvt to E4M3: its first source lands in the high
# byte), E4M3 -> f16x2 (exact), E2M3 saturation at ±7.5·2^-6 and the re-scale by F in f16x2
# (Triton would widen f16 arithmetic to f32), the second conversion to E4M3, the two byte pairs
# merged. The interpreter runs `f32_to_e4m3` and `_refold` instead; the GPU tests check both.
_ENCODE4 = tl.constexpr(
    "{ .reg .b16 p0, p1; .reg .b32 h0, h1, lo, hi; mov.b32 lo, 0xAF80AF80; mov.b32 hi, 0x2F802F80;"
    " cvt.rn.satfinite.e4m3x2.f32 p0, $2, $1; cvt.rn.satfinite.e4m3x2.f32 p1, $4, $3;"
    " cvt.rn.f16x2.e4m3x2 h0, p0; cvt.rn.f16x2.e4m3x2 h1, p1;"
    " max.f16x2 h0, h0, lo; min.f16x2 h0, h0, hi; mul.rn.f16x2 h0, h0, $5;"
    " max.f16x2 h1, h1, lo; min.f16x2 h1, h1, hi; mul.rn.f16x2 h1, h1, $5;"
    " cvt.rn.satfinite.e4m3x2.f16x2 p0, h0; cvt.rn.satfinite.e4m3x2.f16x2 p1, h1;"
    " mov.b32 $0, {p0, p1}; }")

# ---------------------------------------------------------------- tuples of tensors
@triton.jit
def _fwht32(xs, STAGES: tl.constexpr = 5):
    """Butterflies h = 1, 2, 4, 8, 16 in that order (the add order is the definition); the
    first STAGES of them."""
    for s in tl.static_range(STAGES):
        out = ()
        for j in tl.static_range(_BLOCK):
            if ((j >> s) & 1) == 0:
                out = out + (xs[j] + xs[j + (1 << s)],)
            else:
                out = out + (xs[j - (1 << s)] - xs[j],)
        xs = out
    return xs

# ---------------------------------------------------------------- exact helpers
@triton.jit
def _refold(b1, f16bits):
    """E4M3 byte of sat(b1)·F in integer arithmetic (the interpreter's emulation of the fold
    half of `_ENCODE4`): b1 = E4M3 byte of q·2^-6 (unsaturated), F = f16 2^(d+11) or NaN."""
    v = e4m3_byte_to_f32(b1.to(tl.int32))
    v = tl.minimum(tl.maximum(v, -0.1171875), 0.1171875)
    f = f16bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return f32_to_e4m3(v * f, False)

@triton.jit
def _prologue_kernel(x_ptr, aux_ptr, out_ptr, n, PROLOGUE: tl.constexpr, HW: tl.constexpr,
                     BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = bf16_to_f32(tl.load(x_ptr + o, mask=m, other=0.0), HW)
    if PROLOGUE == 2:
        aux = bf16_to_f32(tl.load(aux_ptr + o, mask=m, other=0.0), HW)
    else:
        aux = x
    v = prologue_f32(x, aux, PROLOGUE, HW).to(tl.int32, bitcast=True) >> 16
    tl.store(out_ptr + o, v.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=m)

# ---------------------------------------------------------------- MX blocks
@triton.jit
def _rotate_amax(xs, HADAMARD: tl.constexpr):
    """32-tuple of fp32 -> (rotated 32-tuple, amax bits: NaN if any element is NaN)."""
    if HADAMARD:
        hs = _fwht32(xs)
        ys = ()
        for j in tl.static_range(_BLOCK):
            ys = ys + (hs[j] * _HSCALE,)
    else:
        ys = xs
    amax = tl.abs(ys[0])
    for j in tl.static_range(1, _BLOCK):
        amax = tl.maximum(amax, tl.abs(ys[j]), propagate_nan=tl.PropagateNan.ALL)
    return ys, amax.to(tl.int32, bitcast=True)

@triton.jit
def _amax_only(xs, HADAMARD: tl.constexpr):
    """amax bits of the rotated block without rotating every element: rounding is monotone,
    so max_j RN(h_j·c) == RN(max_j |h_j| · c) (NaN included). Pass 1 needs nothing else.

    Nor does it need the last butterfly: of its pair RN(a + b), RN(a − b) one sum has the
    magnitude |a| + |b| (the one whose signs agree) and the other at most that, so the larger
    rounded magnitude is RN(|a| + |b|), a NaN wherever either is. The one difference, ±inf
    meeting ∓inf (NaN there, inf here), is a non-finite block either way (`_block_info`: the
    same e, `bad`). Per block 16 adds and 15 maxima instead of 32 and 31 (621 -> 557 instructions
    per tile and thread; pass 1 7-11 % faster on the H200, benchmarks/RESULTS.md)."""
    if HADAMARD:
        gs = _fwht32(xs, 4)
        amax = tl.abs(gs[0]) + tl.abs(gs[_BLOCK // 2])
        for j in tl.static_range(1, _BLOCK // 2):
            amax = tl.maximum(amax, tl.abs(gs[j]) + tl.abs(gs[j + _BLOCK // 2]),
                              propagate_nan=tl.PropagateNan.ALL)
    else:
        amax = tl.abs(xs[0])
        for j in tl.static_range(1, _BLOCK):
            amax = tl.maximum(amax, tl.abs(xs[j]), propagate_nan=tl.PropagateNan.ALL)
    if HADAMARD:
        amax = amax * _HSCALE
    return amax.to(tl.int32, bitcast=True)

@triton.jit
def _block_info(ab):
    """From amax bits: (e, bad, live) exactly as block_exponents / fold_to_e4m3 decide."""
    e = tl.minimum(tl.maximum((ab >> 23) - _EXP_OFFSET, -127), 127)  # floor(log2 amax) - emax
    bad = ab >= 0x7F800000  # NaN or Inf in the block -> scale 0xFF, data NaN
    # some code is non-zero iff amax·2^-e > 1/16: always when e is unclamped, else amax > 2^-131
    live = (ab > 0x40000) & (ab < 0x7F800000)
    return e, bad, live

@triton.jit
def _encode_words(ys, e, e_ref, bad, HW: tl.constexpr):
    """32-tuple of rotated fp32 -> 8-tuple of int32 words, word w holding the block's folded
    E4M3 bytes 4w .. 4w + 3 (little-endian, as they lie in memory). On the GPU each word is one
    inline-asm sequence (`_ENCODE4`): the E2M3 rounding of four values y·2^-e (`cvt` to E4M3 at
    the shift where the grids coincide), the fold (saturate, re-scale by F = 2^(d+11), convert
    again) in f16x2, and the two byte pairs merged into one register. Built from Triton's byte
    tensors instead, every byte sat in a register of its own and was masked, shifted, selected
    and permuted into place: a quarter of pass 2's instructions, most on the integer pipe
    (benchmarks/NOTES.md)."""
    s = pow2_f32(-e - 6)
    fb = tl.where(bad, 0x7E00, f16_pow2_bits(e - e_ref + 11))
    out = ()
    if HW:
        f2 = fb | (fb << 16)  # F as f16x2
        for w in tl.static_range(8):
            out = out + (tl.inline_asm_elementwise(
                _ENCODE4, "=r,r,r,r,r,r",
                [ys[4 * w] * s, ys[4 * w + 1] * s, ys[4 * w + 2] * s, ys[4 * w + 3] * s, f2],
                dtype=tl.int32, is_pure=True, pack=1),)
    else:
        fb2 = tl.join(fb, fb)
        for w in tl.static_range(8):
            word = tl.zeros_like(fb)
            for h in tl.static_range(2):  # E2M3 rounding of y·2^-e, two values at a time
                b1 = f32_to_e4m3(tl.join(ys[4 * w + 2 * h] * s, ys[4 * w + 2 * h + 1] * s), HW)
                lo, hi = tl.split(_refold(b1, fb2))
                word = word | ((lo.to(tl.int32) | (hi.to(tl.int32) << 8)) << (16 * h))
            out = out + (word,)
    return out

@triton.jit
def _word_halves(words):
    """8-tuple of [A, B] int32 words -> two [A, B, 4] tensors (bytes 0-15, 16-31 of each
    block): 16 B per thread, stored by one vector instruction."""
    lo = ()
    hi = ()
    for i in tl.static_range(4):
        lo = lo + (words[i],)
        hi = hi + (words[i + 4],)
    zl = zip_tuple(lo, 2)  # [A, B, i1, i0]: word 2·i1 + i0
    zh = zip_tuple(hi, 2)
    return (tl.reshape(zl, (zl.shape[0], zl.shape[1], 4)), tl.reshape(zh, (zh.shape[0], zh.shape[1], 4)))

@triton.jit
def _swap_lane_pairs(t, HW: tl.constexpr):
    """[D0, D1, 4] int32 -> the same tensor with dim-0 neighbours (d0 ^ 1) exchanged. On the
    GPU one warp shuffle per word: the block stores' layout puts d0 on the lanes, d0 bit 0
    on lane bit 0 (checked on each compiled kernel before its first launch:
    `_paired_stores_hold`), so lane ^ 1 holds the neighbour's words in the same registers.
    The interpreter swaps by reshaping (it has no lanes)."""
    if HW:
        return tl.inline_asm_elementwise(
            _SHUFFLE_LANE_PAIRS, "=r,r", [t], dtype=tl.int32, is_pure=True, pack=1)
    else:
        D0: tl.constexpr = t.shape[0]
        D1: tl.constexpr = t.shape[1]
        p = tl.permute(tl.reshape(t, (D0 // 2, 2, D1, 4)), (0, 2, 3, 1))
        even, odd = tl.split(p)
        return tl.reshape(tl.permute(tl.join(odd, even), (0, 3, 1, 2)), (D0, D1, 4))

@triton.jit
def _store_block_pairs(ptr, d0, stride, n_d0, rest, zl, zh, mask_rest, HW: tl.constexpr):
    """Store 32-byte blocks held as two 16-byte halves per thread (zl, zh: [D0, D1, 4] int32
    words, block of (d0, d1) at word ptr + d0·stride + rest) so that each store instruction
    writes whole 32-byte sectors: the lanes of a pair (d0 = 2k, 2k + 1) first write block 2k
    (the even lane its low half, the odd lane its high half), then block 2k + 1. One 16-byte
    half per lane crosses between them. Written as one half per store, every sector took two
    partial writes (the packer's limiter, benchmarks/NOTES.md). Blocks exist where d0 < n_d0
    and mask_rest; d0 is [D0, 1, 1] (D0 even, tiles start at even d0), rest and mask_rest
    [1, D1, 4]."""
    odd = (d0 & 1) == 1
    recv = _swap_lane_pairs(tl.where(odd, zl, zh), HW)  # even lanes send high halves, odd lanes low
    half = tl.where(odd, 4, 0)
    first = d0 - (d0 & 1)  # the even block of the pair
    tl.store(ptr + first.to(tl.int64) * stride + half + rest, tl.where(odd, recv, zl),
             mask=(first < n_d0) & mask_rest)
    tl.store(ptr + (first + 1).to(tl.int64) * stride + half + rest, tl.where(odd, zh, recv),
             mask=(first + 1 < n_d0) & mask_rest)


@triton.jit
def _as_words(ptr):
    """An operand's data pointer as int32 words, which the packers store: the operand may come as
    E4M3 bytes (the inlined packer allocates them so, and needs no view of them afterwards) or as
    their int32 view; the cast is free (the same machine code either way)."""
    return ptr.to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def _word_stride(n, runtime):
    """n // 4, a row of n E4M3 bytes in int32 words, hinted as a multiple of 8 (n is a multiple of
    32), kept a runtime value by `runtime` (any runtime integer, weighted by 0, folded away by the
    compiler): torch 2.11's inductor analyses which arguments a kernel writes with the ones that are
    multiples of 16 bound as constants, on which tl.multiple_of fails, and then copies them all."""
    return tl.multiple_of((n + 0 * runtime) // 4, 8)


@triton.jit
def _store_blocks(ptr, d0, stride, n_d0, rest, zl, zh, mask_rest, PAIRS: tl.constexpr, HW: tl.constexpr):
    """Blocks by lane pairs (`_store_block_pairs`) or each thread its own block's two halves
    (where the compiled layout does not carry the pair swap: `_paired_stores_hold`)."""
    if PAIRS:
        _store_block_pairs(ptr, d0, stride, n_d0, rest, zl, zh, mask_rest, HW)
    else:
        o = ptr + d0.to(tl.int64) * stride + rest
        m = (d0 < n_d0) & mask_rest
        tl.store(o, zl, mask=m)
        tl.store(o + 4, zh, mask=m)

@triton.jit
def _blocks_of_rows(t, BR: tl.constexpr, NB: tl.constexpr, HW: tl.constexpr):
    """[BR, BC] bf16 tile (lanes along columns) -> 32-tuple of [NB, BR] fp32, element j of each
    row block. The first split is on a lane bit (b4), so Triton re-lays the whole tile out once
    (shared memory) into whole-blocks-per-thread instead of piecemeal."""
    # [NB, BR, b3..b0, b4]: lanes then run along rows, as in the block stores (no second re-layout)
    t = tl.permute(tl.reshape(t, (BR, NB, 2, 2, 2, 2, 2)), (1, 0, 3, 4, 5, 6, 2))
    lv = unzip(t, 5)  # index p = b4 + 2·(j mod 16)
    xs = ()
    for j in tl.static_range(_BLOCK):
        xs = xs + (bf16_to_f32(lv[((j >> 4) & 1) | ((j & 15) << 1)], HW),)
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
    return (unzip(tl.reshape(widen_bf16(v0, HW), (BR, NB, 2, 2, 2)), 3)
            + unzip(tl.reshape(widen_bf16(v1, HW), (BR, NB, 2, 2, 2)), 3)
            + unzip(tl.reshape(widen_bf16(v2, HW), (BR, NB, 2, 2, 2)), 3)
            + unzip(tl.reshape(widen_bf16(v3, HW), (BR, NB, 2, 2, 2)), 3))

@triton.jit
def _nb_major(xs):
    """32-tuple of [BR, NB] -> [NB, BR] (a relabelling of registers, no data movement)."""
    out = ()
    for j in tl.static_range(_BLOCK):
        out = out + (tl.permute(xs[j], (1, 0)),)
    return out

@triton.jit
def tile_exponent_maxima(t, row0, R, row_eref_ptr, HADAMARD: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
                         HW: tl.constexpr):
    """Pass 1 of the row granularity on one [BR, NB·MX_BLOCK] bf16 tile in the coalesced layout,
    its row 0 being row `row0` of x (rows from R on all zero): the tile's per-row maxima of the
    block exponents go into row_eref_ptr by atomic max, its per-column maxima ([BC] int32) are
    returned; both as e + 128 where a block is live, 0 where none is. The same steps as
    `_pack_kernel`'s pass 1 on a coalesced tile without prologue, for kernels that produce the
    tile themselves (the AdamW step of `mxflux.train.adamw_cuda`)."""
    RB: tl.constexpr = BR // _BLOCK
    BC: tl.constexpr = NB * _BLOCK
    rows = row0 + tl.arange(0, BR)
    e, bad, live = _block_info(_amax_only(_blocks_of_rows(t, BR, NB, HW), HADAMARD))
    rmax = tl.max(tl.where(live, e + 128, 0), axis=0)
    tl.atomic_max(row_eref_ptr + rows, rmax, mask=(rows < R) & (rmax > 0), sem="relaxed")
    tc = unzip(tl.reshape(tl.permute(tl.reshape(t, (RB, _BLOCK, BC)), (0, 2, 1)), (RB, BC, 2, 2, 2, 2, 2)), 5)
    xc = ()
    for j in tl.static_range(_BLOCK):
        xc = xc + (bf16_to_f32(tc[j], HW),)
    e, bad, live = _block_info(_amax_only(xc, HADAMARD))
    return tl.max(tl.where(live, e + 128, 0), axis=0)

@triton.jit
def _max_into(e, live, idx, n, new_ptr):
    """Pass 1 of one orientation from its block exponents e [A, G] (groups along axis 0, group g being x's row or
    column idx[g] of n): each group's largest live block exponent, as e + 128 (0: none live), atomically maxed
    into new_ptr."""
    m = tl.max(tl.where(live, e + 128, 0), axis=0)
    tl.atomic_max(new_ptr + idx, m, mask=(idx < n) & (m > 0), sem="relaxed")

@triton.jit
def _against_held(e, live, idx, n, held_ptr, new_ptr, NEW: tl.constexpr, HEADROOM: tl.constexpr):
    """One orientation of `tile_operands`: blocks [A, G] whose groups run along axis 0 (group g
    is x's row or column idx[g] of n). Returns the e_ref to encode against ([1, G]: the stored
    maximum at held_ptr, e + 128 or 0 for none, raised by HEADROOM binades), the blocks it does
    not hold and the blocks outside the window; with NEW, each group's own maximum is atomically
    maxed into new_ptr first."""
    if NEW:
        _max_into(e, live, idx, n, new_ptr)
    v = tl.load(held_ptr + idx, mask=idx < n, other=0)[None, :]
    e_ref = tl.where(v > 0, v - 128 + HEADROOM, 0)
    d = e - e_ref
    unheld = tl.sum(tl.sum((live & ((v == 0) | (d > 0) | (d < -_WINDOW))).to(tl.int32), axis=1), axis=0)
    outside = tl.sum(tl.sum((live & (d < -_WINDOW)).to(tl.int32), axis=1), axis=0)
    return e_ref, unheld, outside

@triton.jit
def tile_operands(t, row0, col0, R, C, Rp, row_eref_ptr, col_eref_ptr, row_new_ptr, col_new_ptr,
                  row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
                  NEW: tl.constexpr, HEADROOM: tl.constexpr, HADAMARD: tl.constexpr, BR: tl.constexpr,
                  NB: tl.constexpr, HW: tl.constexpr, COL: tl.constexpr = True):
    """Pass 2 of the row granularity on one [BR, NB·MX_BLOCK] bf16 tile in the coalesced layout
    (row 0 = row `row0` of x [R, C], column 0 = column `col0`; rows from R all zero), for kernels
    that produce the tile themselves: both orientations encoded and stored as `_pack_kernel`'s
    pass 2 stores them (data as int32 words, one fp32 scale per row of each orientation, written by
    the tiles at col0 == 0 / row0 == 0).

    The group e_ref is the stored maximum (row_eref_ptr / col_eref_ptr, e + 128 or 0) raised by
    HEADROOM binades: any e_ref at or above a group's largest live block exponent gives the same
    MX values as the group's own, as long as every live block stays within the window below it.
    Returns (blocks the e_ref does not hold: above it, more than the window below it, or live in a
    group stored as empty; blocks outside the window), summed over both orientations. With NEW the
    tile's own per-row and per-column maxima are also atomically maxed into row_new_ptr / col_new_ptr
    (pass 1 of the same values, from the same block exponents). Without COL the column orientation is
    not encoded (nothing is written at col_data_ptr / col_scale_ptr, nor counted): only its maxima
    go into col_new_ptr, with NEW, for whoever packs that orientation later from the e_ref."""
    RB: tl.constexpr = BR // _BLOCK
    BC: tl.constexpr = NB * _BLOCK
    rows = row0 + tl.arange(0, BR)
    cols = col0 + tl.arange(0, BC)
    # ---------------- row orientation: [NB, BR] blocks
    ys, ab = _rotate_amax(_blocks_of_rows(t, BR, NB, HW), HADAMARD)
    e, bad, live = _block_info(ab)
    e_ref, unheld, outside = _against_held(e, live, rows, R, row_eref_ptr, row_new_ptr, NEW, HEADROOM)
    zl, zh = _word_halves(_encode_words(ys, e, e_ref, bad, HW))
    r3 = tl.arange(0, BR)[:, None, None]
    rest = (tl.arange(0, NB) * (_BLOCK // 4))[None, :, None] + tl.arange(0, 4)[None, None, :]
    cblk3 = col0 + (tl.arange(0, NB) * _BLOCK)[None, :, None]
    _store_blocks(row_data_ptr + col0 // 4, row0 + r3, tl.multiple_of(C // 4, 8), R, rest,
                  tl.permute(zl, (1, 0, 2)), tl.permute(zh, (1, 0, 2)), cblk3 < C, False, HW)
    if col0 == 0:
        tl.store(row_scale_ptr + rows[None, :], pow2_f32(e_ref - _SHIFT), mask=rows[None, :] < R)
    # ---------------- column orientation: [RB, BC] blocks (the transpose, through shared memory)
    tc = unzip(tl.reshape(tl.permute(tl.reshape(t, (RB, _BLOCK, BC)), (0, 2, 1)), (RB, BC, 2, 2, 2, 2, 2)), 5)
    xc = ()
    for j in tl.static_range(_BLOCK):
        xc = xc + (bf16_to_f32(tc[j], HW),)
    if COL:
        ys, ab = _rotate_amax(xc, HADAMARD)
        e, bad, live = _block_info(ab)
        e_ref, col_unheld, col_outside = _against_held(e, live, cols, C, col_eref_ptr, col_new_ptr, NEW, HEADROOM)
        zl, zh = _word_halves(_encode_words(ys, e, e_ref, bad, HW))
        ct = col0 + tl.arange(0, BC)[:, None, None]
        rt3 = row0 + tl.arange(0, RB)[None, :, None] * _BLOCK
        _store_blocks(col_data_ptr, ct, tl.multiple_of(Rp // 4, 8), C, rt3 // 4 + tl.arange(0, 4)[None, None, :],
                      tl.permute(zl, (1, 0, 2)), tl.permute(zh, (1, 0, 2)), rt3 < Rp, False, HW)
        if row0 == 0:
            tl.store(col_scale_ptr + cols[None, :], pow2_f32(e_ref - _SHIFT), mask=cols[None, :] < C)
        unheld += col_unheld
        outside += col_outside
    elif NEW:  # the column maxima alone (pass 1 of that orientation)
        e, bad, live = _block_info(_amax_only(xc, HADAMARD))
        _max_into(e, live, cols, C, col_new_ptr)
    return unheld, outside

# R and the loop bounds vary per call: no value specialisation, one compiled kernel per variant
