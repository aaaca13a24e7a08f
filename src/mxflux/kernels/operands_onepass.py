"""The one-pass row-granularity packer: both operands of a bf16 activation from one read of it
(docs/design.md, "The one-pass packer"), bit-identical to `mx_operands_reference(...,
col_held=, col_headroom=)`.

The two-pass packer (`operands_cuda`) reads x twice because two reductions stand between the
values and the first byte: a row's e_ref (its largest block exponent over all C) and a column's
(over all R). Its kernels are bound by instruction issue, not by memory (benchmarks/NOTES.md), and
pass 1 is half of pass 2's instructions again. Here:

- **Rows.** A stripe of 32 rows is cut into pieces of PIECE_TILES tiles of 32 x NB·32, which the
  programs take in rounds. Walk 1 encodes each row block of its piece against its own exponent (d = 0:
  q·2^5, exact in E4M3 whatever the row's e_ref), stores it in place, keeps its exponent in a byte per
  block, and publishes the piece's row maxima (e + 129 per row: 0, what the buffer starts as, is "not yet").
  A round later the program re-scales that piece's bytes by 2^(e_block − e_ref) (walk 2: decode, one f16x2
  multiply, encode: the fold's own last steps, so the same bytes as encoding against e_ref at once), the
  stripe's e_ref from every piece's published maxima, and from x for each piece not yet published (no
  program waits on another; each published value is final, so no ordering is needed to read it). Walk 2
  reads bytes written a round before (all programs' together a few MB, which L2 can hold; whole stripes
  were more than it holds) and issues a seventh of the instructions of a second pass.
- **Columns.** Every column block lies inside one stripe; only the column's e_ref is global. It
  is taken from the caller's prediction `held` (the last step's maxima, raised by `headroom`
  binades), and the pass records each column's block exponent per stripe (a byte), which a small
  kernel reduces to the columns' true maxima. A column
  the prediction does not hold (none given, or a block above it) is encoded again by the fix-up
  kernel against its own maximum, which reads only the column strips that have such a column
  (all return at once otherwise).

The operands differ from the two-pass packer's only in the window of the held columns (placed at
the prediction instead of the column's maximum): the same values inside it, blocks below it
rounded and counted (`fold_to_e4m3`'s `held`). Everything that touches Triton is guarded as in
`operands_cuda`.
"""

from __future__ import annotations

import torch

from ..mx.constants import MX_BLOCK
from ..mx.fold import pow2_any, predicted_erefs
from ..mx.formats import get_format
from ..mx.operands import MXOperands, padded_rows
from .operands_plan import check_input, counts_in_place, resident_programs
from .triton_common import HAS_TRITON, PAIR_SHUFFLE_ASM, interpreting, lane_pair_shuffles_hold, launch_options, \
    num_sms

if MX_BLOCK != 32:
    raise ImportError(f"operands_onepass: the kernels' register layout is written for MX_BLOCK = 32, got {MX_BLOCK}")

__all__ = ["ONEPASS_MAXNREG", "ONEPASS_PIECE_TILES", "ONEPASS_WARPS", "mx_operands_onepass_cuda", "onepass_constexprs",
           "onepass_options"]

# Tiles of 32 x 128, one row block and one column block per thread, on 4 warps held to 128 registers
# (ptxas picks 152; at 128 it spills a few once per stripe, none in the walks): four programs per SM
# (tiles of 32 x 256 on 8 warps took 168 registers: one program per SM)
_NB = 4
ONEPASS_WARPS = 4
ONEPASS_MAXNREG = 128
# A program walks a piece of a stripe, PIECE_TILES tiles wide, and re-scales its row bytes a round later: the
# bytes in flight between the two walks are programs x 32 x 256 (~9 MB on an H100) where whole stripes of 32 x C
# were 50 MB (C = 3072) to 350 MB, more than L2 holds: Nsight counted every row byte written out to DRAM and
# read back (benchmarks/NOTES.md, "Nsight Compute on the one-pass packer")
ONEPASS_PIECE_TILES = 2
_FIX_BR, _FIX_NB, _FIX_WARPS = 128, 2, 8  # the fix-up kernel's tiles and warps: the two-pass packer's
_FIX_PROGRAMS = 32
# a [128, 32] tile of the records per trip: 8 trips at 32768 rows (32 trips of [32, 64] took 23-104 µs)
_COLUMNS_STRIPES, _COLUMNS_BLOCK, _COLUMNS_WARPS = 128, 32, 4
_SHIFT_E2M3 = get_format("e2m3").fold_shift

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .operands_device import (
        _BLOCK,
        _SHIFT,
        _WINDOW,
        _amax_only,
        _as_words,
        _block_info,
        _blocks_of_rows,
        _encode_words,
        _load_rows,
        _rotate_amax,
        _store_blocks,
        _word_halves,
        _word_stride,
    )
    from .triton_common import bf16_to_f32, e4m3_byte_to_f32, f16_pow2_bits, f32_to_e4m3, pow2_f32, unzip

    _DEAD = tl.constexpr(-128)  # the exponent byte of a block without a non-zero code: no e_ref, no count

    # Four stored E4M3 bytes ($1, one word) times F = 2^d as f16x2 ($2), back to E4M3: the fold's last
    # steps (`_ENCODE4`) on bytes that hold q·2^5. Exact up to the one rounding of the final
    # conversion: q·2^(d+5) has at most 4 significant bits, all above f16's smallest subnormal for
    # d >= -20, and every d below that rounds to zero in E4M3 either way.
    _RESCALE4 = tl.constexpr(
        "{ .reg .b16 p0, p1; .reg .b32 h0, h1; mov.b32 {p0, p1}, $1;"
        " cvt.rn.f16x2.e4m3x2 h0, p0; cvt.rn.f16x2.e4m3x2 h1, p1;"
        " mul.rn.f16x2 h0, h0, $2; mul.rn.f16x2 h1, h1, $2;"
        " cvt.rn.satfinite.e4m3x2.f16x2 p0, h0; cvt.rn.satfinite.e4m3x2.f16x2 p1, h1;"
        " mov.b32 $0, {p0, p1}; }")

    @triton.jit
    def _rescale_words(w, d, HW: tl.constexpr):
        """int32 words of four E4M3 bytes q·2^5 each -> the bytes of q·2^(d+5) (d <= 0, per word)."""
        dc = tl.maximum(d, -20)
        if HW:
            fb = f16_pow2_bits(dc)
            return tl.inline_asm_elementwise(_RESCALE4, "=r,r,r", [w, fb | (fb << 16)], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            f = pow2_f32(dc)
            out = tl.zeros_like(w)
            for k in tl.static_range(4):
                b = (w >> (8 * k)) & 0xFF
                nan = (b & 0x7F) == 0x7F
                v = f32_to_e4m3(e4m3_byte_to_f32(tl.where(nan, 0, b)) * f, False).to(tl.int32)
                out = out | (tl.where(nan, b, v) << (8 * k))
            return out

    @triton.jit
    def _col_blocks(t, RB: tl.constexpr, BC: tl.constexpr, HW: tl.constexpr):
        """[RB·32, BC] bf16 tile -> 32-tuple of [RB, BC] fp32: element j of each column block (the
        transpose, through shared memory)."""
        tc = unzip(tl.reshape(tl.permute(tl.reshape(t, (RB, _BLOCK, BC)), (0, 2, 1)), (RB, BC, 2, 2, 2, 2, 2)), 5)
        xc = ()
        for j in tl.static_range(_BLOCK):
            xc = xc + (bf16_to_f32(tc[j], HW),)
        return xc

    @triton.jit
    def _predicted(held_ptr, cols, C, HEADROOM: tl.constexpr):
        """[1, BC]: the held e_ref of each column (0 where none is held) and whether one is. Only e + 128
        in [1, 255] is an e_ref; the headroom stops at E8M0's largest exponent, which holds any column."""
        v = tl.load(held_ptr + cols, mask=cols < C, other=0)[None, :]
        has = (v > 0) & (v < 256)
        return tl.where(has, tl.minimum(v - 128 + HEADROOM, 127), 0), has

    @triton.jit
    def _piece_span(piece, n_chunks, PIECE_TILES: tl.constexpr):
        """The first tile of a piece of a stripe and the one past its last (the last piece may be narrower)."""
        return piece * PIECE_TILES, tl.minimum((piece + 1) * PIECE_TILES, n_chunks)

    @triton.jit
    def _piece_row_maxima(x_ptr, stride_x, R, C, row0, piece, n_chunks, r2, c2,
                          HADAMARD: tl.constexpr, HW: tl.constexpr, NB: tl.constexpr, PIECE_TILES: tl.constexpr):
        """[BR]: e + 128 of each row's largest live block in one piece of a stripe (0 for none), from x (what
        walk 1 of that piece publishes; read when its program has not published it yet)."""
        BR: tl.constexpr = _BLOCK
        BC: tl.constexpr = NB * _BLOCK
        rmax = tl.zeros([NB, BR], dtype=tl.int32)
        ch0, ch_end = _piece_span(piece, n_chunks, PIECE_TILES)
        for ch in range(ch0, ch_end):
            t = _load_rows(x_ptr, row0, stride_x, R, C, ch * BC, r2, c2)
            e, _, live = _block_info(_amax_only(_blocks_of_rows(t, BR, NB, HW), HADAMARD))
            rmax = tl.maximum(rmax, tl.where(live, e + 128, 0))
        return tl.max(rmax, axis=0)

    @triton.jit(do_not_specialize=["R", "n_stripes", "n_prog"])
    def _onepass_kernel(
        x_ptr, stride_x, R, C, Rp,
        row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, colsum_ptr, outside_ptr,
        held_ptr, cmax_ptr, rexp_ptr, pmax_ptr, helped_ptr, n_stripes, n_prog,
        HEADROOM: tl.constexpr, DO_COLSUM: tl.constexpr, HADAMARD: tl.constexpr, HW: tl.constexpr,
        NB: tl.constexpr, PAIRS: tl.constexpr, PIECE_TILES: tl.constexpr,
    ):
        BR: tl.constexpr = _BLOCK  # one column block high
        BC: tl.constexpr = NB * _BLOCK
        KB = C // _BLOCK  # row blocks per row
        n_chunks = tl.cdiv(C, BC)
        n_pieces = tl.cdiv(n_chunks, PIECE_TILES)  # of a stripe, PIECE_TILES tiles wide
        n_items = n_stripes * n_pieces
        rr = tl.arange(0, BR)
        r2 = rr[:, None]
        c2 = tl.arange(0, BC)[None, :]
        r3 = rr[:, None, None]
        nb2 = tl.arange(0, NB)[:, None]
        rest = (tl.arange(0, NB) * (_BLOCK // 4))[None, :, None] + tl.arange(0, 4)[None, None, :]
        w2 = tl.arange(0, BC // 4)[None, :]
        nb_row = tl.arange(0, NB)[None, :]
        row_words = _as_words(row_data_ptr)
        row_cnt = tl.zeros([BR, NB], dtype=tl.int32)
        col_cnt = tl.zeros([1, BC], dtype=tl.int32)

        # Item it = (stripe it // n_pieces, piece it % n_pieces); the programs take them in rounds, so the pieces of a
        # stripe are walked side by side. Each round: walk 1 of this round's item, then walk 2 of the last round's,
        # whose stripe's other pieces have most likely published their row maxima by then.
        prev = -1
        for it in range(tl.program_id(0), n_items + n_prog, n_prog):
            if it < n_items:
                s = it // n_pieces
                piece = it % n_pieces
                row0 = s * BR
                rows = row0 + rr
                rmax = tl.zeros([NB, BR], dtype=tl.int32)
                ch0, ch_end = _piece_span(piece, n_chunks, PIECE_TILES)
                tn = _load_rows(x_ptr, row0, stride_x, R, C, ch0 * BC, r2, c2)
                # ------------ walk 1: read x once; rows against their own blocks, columns against `held`
                for ch in range(ch0, ch_end):
                    col0 = ch * BC
                    t = tn
                    # the next tile, masked off past the piece's end by its rows (a bound on the columns that is
                    # not C took 16-byte loads away: walk 1 spilled)
                    tn = _load_rows(x_ptr, row0, stride_x, tl.where(ch + 1 < ch_end, R, 0), C, col0 + BC, r2, c2)
                    ys, ab = _rotate_amax(_blocks_of_rows(t, BR, NB, HW), HADAMARD)  # [NB, BR] per block
                    e, bad, live = _block_info(ab)
                    rmax = tl.maximum(rmax, tl.where(live, e + 128, 0))
                    zl, zh = _word_halves(_encode_words(ys, e, e, bad, HW))
                    cblk3 = col0 + (tl.arange(0, NB) * _BLOCK)[None, :, None]
                    _store_blocks(row_words + col0 // 4, row0 + r3, _word_stride(C, s), R, rest,
                                  tl.permute(zl, (1, 0, 2)), tl.permute(zh, (1, 0, 2)), cblk3 < C, PAIRS, HW)
                    kb = col0 // _BLOCK + nb2
                    tl.store(rexp_ptr + rows[None, :].to(tl.int64) * KB + kb,
                             tl.where(live, e, _DEAD).to(tl.int8), mask=(rows[None, :] < R) & (kb < KB))

                    cols = col0 + tl.arange(0, BC)
                    xc = _col_blocks(t, 1, BC, HW)
                    if DO_COLSUM:  # the stripe's sum per column, added up in order by `_columns_kernel`
                        csum = xc[0]
                        for j in tl.static_range(1, _BLOCK):
                            csum += xc[j]
                        tl.store(colsum_ptr + s * C + cols[None, :], csum, mask=cols[None, :] < C)
                    ys, ab = _rotate_amax(xc, HADAMARD)  # [1, BC] per block
                    e, bad, live = _block_info(ab)
                    # the stripe's block exponent per column (its one block there) as e + 128, 0 for none,
                    # unsigned: `_columns_kernel` takes the maxima (Triton 3.6 reduced int8 loads widened to
                    # int32 as unsigned on the H100, e = -1 above e = 0; the interpreter did not)
                    tl.store(cmax_ptr + s * C + cols[None, :], tl.where(live, e + 128, 0).to(tl.uint8),
                             mask=cols[None, :] < C)
                    e_ref, _ = _predicted(held_ptr, cols, C, HEADROOM)
                    col_cnt += (live & ((e - e_ref) < -_WINDOW)).to(tl.int32)
                    zl, zh = _word_halves(_encode_words(ys, e, e_ref, bad, HW))
                    ct = col0 + tl.arange(0, BC)[:, None, None]
                    rt3 = row0 + tl.arange(0, 1)[None, :, None] * _BLOCK
                    _store_blocks(_as_words(col_data_ptr), ct, _word_stride(Rp, s), C,
                                  rt3 // 4 + tl.arange(0, 4)[None, None, :], tl.permute(zl, (1, 0, 2)),
                                  tl.permute(zh, (1, 0, 2)), rt3 < Rp, PAIRS, HW)
                    if s == 0:
                        tl.store(col_scale_ptr + cols[None, :], pow2_f32(e_ref - _SHIFT), mask=cols[None, :] < C)
                # publish the piece's row maxima as e + 129 (≥ 1; 0 is "not yet"): each row's value is written once,
                # whole, so a reader sees either 0 or the final value and needs no ordering to trust it
                tl.store(pmax_ptr + it * BR + rr, (tl.max(rmax, axis=0) + 1).to(tl.int16))  # (n_items · 32 < 2^31)

            if prev >= 0:
                # ------------ walk 2 of the last round's item: its stripe's row e_ref from every piece's
                # maxima, as published, and from x for each piece whose program has not published them yet (no
                # program waits on another: none is sure to be running). Only the missing pieces are read: reading
                # the whole stripe whenever one was missing made the walks 3-12x slower than two passes (H100)
                s = prev // n_pieces
                piece = prev % n_pieces
                row0 = s * BR
                rows = row0 + rr
                rm = tl.zeros([BR], dtype=tl.int32)
                base = pmax_ptr + s * n_pieces * BR
                p8 = tl.arange(0, 8)
                for p0 in range(0, n_pieces, 8):
                    live8 = p0 + p8 < n_pieces
                    m = tl.load(base + (p0 + p8[:, None]) * BR + rr[None, :], mask=live8[:, None], other=1,
                                volatile=True).to(tl.int32)  # [8, BR], published as e + 129
                    missing = live8 & (tl.min(m, axis=1) == 0)  # a piece with a row not yet published
                    rm = tl.maximum(rm, tl.max(tl.where(missing[:, None], 0, m - 1), axis=0))
                    n_missing = tl.sum(missing.to(tl.int32), axis=0)
                    if n_missing > 0:
                        tl.atomic_add(helped_ptr, n_missing, sem="relaxed")
                        for j in range(0, 8):  # (not unrolled: one copy of the read from x)
                            if tl.sum(tl.where(p8 == j, missing.to(tl.int32), 0), axis=0) > 0:
                                rm = tl.maximum(rm, _piece_row_maxima(x_ptr, stride_x, R, C, row0, p0 + j, n_chunks,
                                                                      r2, c2, HADAMARD, HW, NB, PIECE_TILES))
                e_row = tl.where(rm > 0, rm - 128, 0)
                if piece == 0:
                    tl.store(row_scale_ptr + rows, pow2_f32(e_row - _SHIFT), mask=rows < R)
                tl.debug_barrier()  # walk 1's stores, by other threads of this program, are visible here
                stripe_words = row_words + row0.to(tl.int64) * (C // 4)
                stripe_exps = rexp_ptr + row0.to(tl.int64) * KB
                rmask = row0 + r2 < R
                ch0, ch_end = _piece_span(piece, n_chunks, PIECE_TILES)
                for j in range(0, ch_end - ch0):  # from the tile walk 1 wrote last back to the first
                    col0 = (ch_end - 1 - j) * BC
                    wm = rmask & (col0 + 4 * w2 < C)
                    wo = r2 * (C // 4) + col0 // 4 + w2
                    w = tl.load(stripe_words + wo, mask=wm, other=0)  # [BR, BC/4]
                    kb = col0 // _BLOCK + nb_row
                    eb = tl.load(stripe_exps + r2 * KB + kb, mask=rmask & (kb < KB), other=_DEAD).to(tl.int32)
                    d = eb - e_row[:, None]
                    row_cnt += ((eb != _DEAD) & (d < -_WINDOW)).to(tl.int32)
                    dw = tl.reshape(tl.broadcast_to(d[:, :, None], (BR, NB, _BLOCK // 4)), (BR, BC // 4))
                    tl.store(stripe_words + wo, _rescale_words(w, dw, HW), mask=wm)
            prev = tl.where(it < n_items, it, -1)

        total = tl.sum(tl.sum(row_cnt, axis=1), axis=0) + tl.sum(tl.sum(col_cnt, axis=1), axis=0)
        tl.atomic_add(outside_ptr, total.to(tl.int64), sem="relaxed")

    @triton.jit(do_not_specialize=["n_stripes"])
    def _columns_kernel(cmax_ptr, new_ptr, part_ptr, colsum_ptr, n_stripes, C, DO_COLSUM: tl.constexpr,
                        BS: tl.constexpr, BLOCK: tl.constexpr):
        """Per column, over the stripes' records: the largest live block exponent (e + 128, 0 for none) and,
        with DO_COLSUM, the sum of the stripes' sums in a fixed order (the same bits every run). A read of
        1/32 of x's elements (1/8 with the sums), BS stripes at a time, where atomics from every stripe on
        the same columns serialised."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[None, :]
        ss = tl.arange(0, BS)[:, None]
        m = tl.zeros([BLOCK], dtype=tl.int32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s0 in range(0, n_stripes, BS):
            mask = (s0 + ss < n_stripes) & (cols < C)
            off = (s0 + ss) * C + cols
            m = tl.maximum(m, tl.max(tl.load(cmax_ptr + off, mask=mask, other=0).to(tl.int32), axis=0))
            if DO_COLSUM:
                acc += tl.sum(tl.load(part_ptr + off, mask=mask, other=0.0), axis=0)
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(new_ptr + c, m, mask=c < C)
        if DO_COLSUM:
            tl.store(colsum_ptr + c, acc, mask=c < C)

    @triton.jit(do_not_specialize=["R", "n_row_tiles", "n_prog_r"])
    def _fixup_kernel(
        x_ptr, stride_x, R, C, Rp, col_data_ptr, col_scale_ptr, outside_ptr, fixed_ptr, held_ptr, new_ptr,
        n_row_tiles, n_prog_r,
        HEADROOM: tl.constexpr, HADAMARD: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr,
    ):
        """The columns of one strip that `held` did not hold, encoded against their own maxima
        (`new`), their scales written, and the blocks outside the window counted again: those
        against the column's own e_ref in, those the one-pass kernel counted against the held one
        out. A strip without such a column returns after reading its e_ref."""
        RB: tl.constexpr = BR // _BLOCK
        BC: tl.constexpr = NB * _BLOCK
        pid_c = tl.program_id(0)
        pid_r = tl.program_id(1)
        col0 = pid_c * BC
        cols = col0 + tl.arange(0, BC)
        e_pred, has = _predicted(held_ptr, cols, C, HEADROOM)
        v = tl.load(new_ptr + cols, mask=cols < C, other=0)[None, :]
        e_own = v - 128
        fix = (v > 0) & ((~has) | (e_own > e_pred))  # [1, BC]
        n_fix = tl.sum(tl.sum(fix.to(tl.int32), axis=1), axis=0)
        if n_fix > 0:
            if pid_r == 0:
                tl.store(col_scale_ptr + cols[None, :], pow2_f32(e_own - _SHIFT), mask=fix)
                tl.atomic_add(fixed_ptr, n_fix, sem="relaxed")
            r2 = tl.arange(0, BR)[:, None]
            c2 = tl.arange(0, BC)[None, :]
            cnt = tl.zeros([RB, BC], dtype=tl.int32)
            for rt in range(pid_r, n_row_tiles, n_prog_r):
                row0 = rt * BR
                t = _load_rows(x_ptr, row0, stride_x, R, C, col0, r2, c2)
                ys, ab = _rotate_amax(_col_blocks(t, RB, BC, HW), HADAMARD)
                e, bad, live = _block_info(ab)
                cnt += (fix & live & ((e - e_own) < -_WINDOW)).to(tl.int32)
                cnt -= (fix & live & ((e - e_pred) < -_WINDOW)).to(tl.int32)
                zl, zh = _word_halves(_encode_words(ys, e, e_own, bad, HW))
                ct = col0 + tl.arange(0, BC)[:, None, None]
                rt3 = row0 + tl.arange(0, RB)[None, :, None] * _BLOCK
                fix3 = tl.permute(fix, (1, 0))[:, :, None]  # [BC, 1, 1]
                _store_blocks(_as_words(col_data_ptr), ct, _word_stride(Rp, pid_r), C,
                              rt3 // 4 + tl.arange(0, 4)[None, None, :], tl.permute(zl, (1, 0, 2)),
                              tl.permute(zh, (1, 0, 2)), (rt3 < Rp) & fix3, False, HW)
            tl.atomic_add(outside_ptr, tl.sum(tl.sum(cnt, axis=1), axis=0).to(tl.int64), sem="relaxed")


def onepass_constexprs() -> dict:
    """The one-pass kernel's compile-time tile (what the ahead-of-time compile tests build)."""
    return dict(NB=_NB, PAIRS=True, PIECE_TILES=ONEPASS_PIECE_TILES)


def onepass_options() -> dict:
    """The one-pass kernel's compile options (none under the interpreter)."""
    opts = launch_options(ONEPASS_WARPS)
    return {**opts, "maxnreg": ONEPASS_MAXNREG} if opts else opts


_SHAPE_BY_META: dict[tuple, tuple[bool, int]] = {}  # `_launch_shape`'s answer per constexprs


def mx_operands_onepass_cuda(
    x: torch.Tensor,
    held: torch.Tensor,
    *,
    headroom: int = 0,
    hadamard: bool = True,
    colsum: bool = False,
    counter: torch.Tensor | None = None,
    _hw: bool | None = None,
    _poison: bool = False,
    _piece_tiles: int = ONEPASS_PIECE_TILES,
    _helped: torch.Tensor | None = None,
) -> tuple[MXOperands, torch.Tensor, torch.Tensor]:
    """Both row-granularity operands of x (CUDA bf16 [R, C], C a multiple of 32) from one read of it,
    the column orientation against the predicted e_ref `held` (int32 [C] on x's device, e_ref + 128
    per column or 0 for none; raised by `headroom` binades).

    Returns (the operands, bit-identical to `mx_operands_reference(x, hadamard=hadamard,
    colsum=colsum, col_held=held, col_headroom=headroom)` but for the summation order of colsum;
    x's own column maxima, int32 [C] in `held`'s form: the next call's prediction; the number of
    columns the prediction did not hold and the fix-up re-encoded, int32 [1]). No host
    synchronisation. With `counter` (one int64 element on x's device) the blocks outside the window
    are added into it and it is the operands' count.

    For tests and benchmarks: `_piece_tiles`, the width of a program's piece of a stripe in tiles of 128
    columns; `_helped` (int32 [1]), where the pieces whose row maxima a walk found unpublished and read from x
    are counted."""
    hw = (not interpreting()) if _hw is None else bool(_hw)
    if not HAS_TRITON or not (torch.cuda.is_available() or interpreting()):
        raise RuntimeError("mx_operands_onepass_cuda: needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
    check_input(x, "x")
    R, C = x.shape
    if C % MX_BLOCK:
        raise ValueError(f"x: {C} columns is not a multiple of the block size {MX_BLOCK}")
    if not isinstance(held, torch.Tensor) or held.dtype != torch.int32 or tuple(held.shape) != (C,) \
            or held.device != x.device:
        raise ValueError(f"held: expected int32 [{C}] on {x.device} (e_ref + 128 per column, 0 for none), got "
                         f"{getattr(held, 'dtype', type(held).__name__)} {tuple(getattr(held, 'shape', ()))}")
    if isinstance(headroom, bool) or not isinstance(headroom, int) or not 0 <= headroom <= 8:
        raise ValueError(f"headroom: expected an int of binades in [0, 8], got {headroom!r}")
    for name, flag in (("hadamard", hadamard), ("colsum", colsum)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if counter is not None and not counts_in_place(counter, x.device):
        raise ValueError(f"counter: expected one int64 element on {x.device}")
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16:
        x = x.contiguous()  # 16-byte pieces of rows

    dev = x.device
    Rp = padded_rows(R)
    f8 = torch.float8_e4m3fn
    row_data = torch.empty((R, C), dtype=f8, device=dev)
    row_scale = torch.empty((R, 1), dtype=torch.float32, device=dev)
    col_data = torch.empty((C, Rp), dtype=f8, device=dev)
    col_scale = torch.empty((C, 1), dtype=torch.float32, device=dev)
    if _poison:  # tests: 0xFF bytes are NaN in fp32 and E4M3, so an unwritten element shows
        for t in (row_data, row_scale, col_data, col_scale):
            t.view(torch.uint8).fill_(0xFF)
    new = (torch.empty if Rp else torch.zeros)(C, dtype=torch.int32, device=dev)  # (`_columns_kernel` writes it)
    fixed = torch.zeros(1, dtype=torch.int32, device=dev)
    sums = (torch.empty if Rp else torch.zeros)(C, dtype=torch.float32, device=dev) if colsum else None
    outside = counter if counter is not None else torch.zeros((), dtype=torch.int64, device=dev)
    if Rp == 0:  # no block anywhere: every column's e_ref is the held one, or 0
        col_scale.copy_(pow2_any(predicted_erefs(held, headroom)[0] - _SHIFT_E2M3)[:, None])
        return MXOperands(row_data, row_scale, col_data, col_scale, sums, outside), new, fixed
    n_stripes = Rp // MX_BLOCK
    n_pieces = -(-C // (_NB * MX_BLOCK * _piece_tiles))
    rexp = torch.empty((R, C // MX_BLOCK), dtype=torch.int8, device=dev)
    cmax = torch.empty((n_stripes, C), dtype=torch.uint8, device=dev)
    parts = torch.empty((n_stripes, C), dtype=torch.float32, device=dev) if colsum else None
    # each piece's row maxima, e + 129 once published (0: not yet)
    pmax = torch.zeros((n_stripes, n_pieces, MX_BLOCK), dtype=torch.int16, device=dev)
    helped = _helped if _helped is not None else torch.zeros(1, dtype=torch.int32, device=dev)

    sms = num_sms(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 4
    args = (x, x.stride(0), R, C, Rp, row_data, row_scale, col_data, col_scale,
            parts if colsum else new, outside, held, cmax, rexp, pmax, helped)
    meta = dict(HEADROOM=headroom, DO_COLSUM=colsum, HADAMARD=hadamard, HW=hw, NB=_NB, PIECE_TILES=_piece_tiles)
    n_items = n_stripes * n_pieces
    pairs, resident = _launch_shape(args + (n_stripes, n_items), (n_items,), meta) if hw else (True, 2)
    # a whole number of stripes per round: a stripe split over two rounds would have its later pieces walked
    # while its earlier pieces' programs look for their maxima, and those would read x again
    grid = (min(n_items, max(n_pieces, resident * sms // n_pieces * n_pieces)),)
    _onepass_kernel[grid](*args, n_stripes, grid[0], PAIRS=pairs, **meta, **onepass_options())
    _columns_kernel[(-(-C // _COLUMNS_BLOCK),)](cmax, new, parts if colsum else new, sums if colsum else new,
                                                n_stripes, C, DO_COLSUM=colsum, BS=_COLUMNS_STRIPES,
                                                BLOCK=_COLUMNS_BLOCK, **launch_options(_COLUMNS_WARPS))

    n_strips = -(-C // (_FIX_NB * MX_BLOCK))
    n_rt = -(-Rp // _FIX_BR)
    # Programs per strip: most strips return at once, so what counts is how fast a strip that has a column to
    # fix is walked: by up to _FIX_PROGRAMS programs (one per strip walked all 256 row tiles of X [32768, 12288]
    # alone: 333 µs to fix up two columns, on an H100)
    n_prog_r = min(n_rt, _FIX_PROGRAMS)
    _fixup_kernel[(n_strips, n_prog_r)](
        x, x.stride(0), R, C, Rp, col_data, col_scale, outside, fixed, held, new, n_rt, n_prog_r,
        HEADROOM=headroom, HADAMARD=hadamard, HW=hw, BR=_FIX_BR, NB=_FIX_NB, **launch_options(_FIX_WARPS))
    return MXOperands(row_data, row_scale, col_data, col_scale, sums, outside), new, fixed


def _launch_shape(args, grid, meta) -> tuple[bool, int]:
    """(whether the compiled one-pass kernel may store blocks by lane pairs, programs of it one SM
    holds), once per constexprs. Lane pairs: `operands_cuda`'s `_paired_stores_hold` (the layout is the
    compiler's choice, read from its TTGIR). Programs per SM: from its registers and shared memory
    (`resident_programs`), so that the persistent grid is one full wave (at 8 warps and 168 registers an
    SM held one program, and a grid of two per SM ran in two waves)."""
    if interpreting():
        return True, 2
    key = tuple(sorted(meta.items()))  # (pointers and row lengths are 16-byte aligned at every launch)
    if key in _SHAPE_BY_META:
        return _SHAPE_BY_META[key]
    compiled = _onepass_kernel.warmup(*args, grid=grid, PAIRS=True, **meta, **onepass_options())
    found = lane_pair_shuffles_hold(compiled.asm["ttgir"], PAIR_SHUFFLE_ASM)
    try:
        compiled._init_handles()
        resident = resident_programs(compiled.n_regs, ONEPASS_WARPS, compiled.metadata.shared)
    except (AttributeError, RuntimeError):  # another Triton: two, as the two-pass packer's pass 2
        resident = 2
    _SHAPE_BY_META[key] = shape = (len(found) == 2 and all(found), resident)
    return shape
