"""The CPU fast path of the MX operand packer: one compiled pass per orientation, bit-identical to
`mxflux.mx.operands.mx_operands_reference`.

The reference is ~45 whole-tensor PyTorch ops per orientation; on a small CPU that is most of a
training step of the demo model. This kernel does the same arithmetic (docs/design.md, "Element
formats and E8M0 scales" and "The exact FP8 fold and its window") in one pass compiled by numba,
16 rows at a time so that every step vectorizes: rotate (butterflies h = 1..16, then × fp32
1/√32), E8M0 exponent from the fp32 bits of the block amax, E2M3 codes by the same integer
round-half-even on the fp32 bits, then the FP8 fold per group (row or 1×g) and the E4M3 byte of
every element, written directly. Prologues and column sums stay in PyTorch (they are single ops
there, and their exact torch rounding is part of the reference).

numba is optional: `cpu_kernel_available()` says whether this path can run; the custom ops
(`mxflux.ops`) fall back to the reference otherwise.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..mx.constants import MX_BLOCK
from ..mx.formats import FORMATS, code_table, get_format
from ..mx.granularity import FoldGranularity
from ..mx.hadamard import HADAMARD_SCALE
from ..mx.operands import MXOperands, apply_prologue, padded_rows
from ..mx.quantize import max_code

try:  # numba is a declared dependency, but the package must import without it
    from numba import njit, prange

    from .cpu_bits import bits_f32, f32_bits

    HAS_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAS_NUMBA = False

__all__ = ["HAS_NUMBA", "cpu_kernel_available", "mx_operands_cpu", "numpy_view"]

_E4M3 = FORMATS["e4m3"]
_E4M3_NAN = 0x7F  # the byte torch writes for a (positive) NaN in float8_e4m3fn


def cpu_kernel_available() -> bool:
    """True when numba is importable, so `mx_operands_cpu` can run."""
    return HAS_NUMBA


# Rows quantized together by one kernel iteration: the vector lanes. Element i of the 16 rows' blocks
# is one contiguous run of the tile, so each step of the per-block arithmetic (butterflies, amax,
# rounding) is one loop over contiguous fp32 values that LLVM vectorizes (AVX2/AVX-512), instead of
# a scalar pass per block.
LANES = 16
_TILE = MX_BLOCK * LANES

if HAS_NUMBA:

    @njit(cache=True, inline="always")
    def _code(y, sh, half, code_off, min_normal_bits, sub_mul, max_code):
        """`mxflux.mx.quantize.round_to_format`'s magnitude code of fp32 `y` (the sign is added by
        the caller): integer round-half-even on the bits for normals, counted subnormal steps below."""
        magbits = f32_bits(y) & np.int32(0x7FFFFFFF)
        # |y| * sub_mul < 2^22 here, where adding and subtracting 2^23 rounds half to even (= np.rint)
        # with plain fp32 adds, which vectorize where np.rint's call does not
        sub = np.int32((abs(y) * sub_mul + np.float32(8388608.0)) - np.float32(8388608.0))
        nrm = ((magbits + half + ((magbits >> sh) & 1)) >> sh) - code_off
        return min(sub if magbits < min_normal_bits else nrm, max_code)

    @njit(cache=True, inline="always")
    def _widen(x, bf16_bits):
        """An element of `v` as fp32: bf16 bits (int16) are the high half of their fp32."""
        return bits_f32(np.int32(np.int32(x) << 16)) if bf16_bits else np.float32(x)

    @njit(cache=True, inline="always")
    def _butterflies(src, dst, h):
        """One Hadamard stage over a tile: dst = a + b, a - b for the elements h apart in groups of
        2h (numba freezes the globals MX_BLOCK and LANES as constants)."""
        for g in range(0, MX_BLOCK, 2 * h):
            lo = g * LANES
            hi = (g + h) * LANES
            for t in range(h * LANES):
                a = src[lo + t]
                c = src[hi + t]
                dst[lo + t] = a + c
                dst[hi + t] = a - c

    @njit(cache=True, parallel=True)
    def _pack_rows(v, transposed, bf16_bits, group, hadamard, hscale, ebits, mbits, bias, emax, min_normal_bits, sub_mul,
                   max_code, table, shift, window, in_window_bytes, out, out_scale, outside):
        """Quantize every row of `v` [R, C_v] along its columns in blocks of MX_BLOCK and fold it:
        E4M3 bytes into `out` [R, C] (uint8), fp32 group scales into `out_scale` [R, C/group],
        per-row count of live blocks outside the fold window into `outside` [R].
        `in_window_bytes` [window + 1, codes]: the E4M3 byte of code q in a block d = e_blk − e_ref
        binades below its group's reference, for the blocks the fold keeps exact (a table lookup
        instead of scaling and rounding each element; the others are rounded here).

        `v` is C-contiguous, fp32 or (`bf16_bits`) the int16 bits of bf16 values, widened here as
        they are read, so that no fp32 copy of a bf16 input is made. With `transposed` the rows
        quantized are those of vᵀ (the col orientation, read in place). The quantized rows may be
        shorter than `out`'s: columns past them read as zeros (the col orientation's padded rows).

        Rows are quantized LANES at a time (a tile, element i of every row's block contiguous);
        then each row of the tile is folded and written."""
        R, C = out.shape
        c_valid = v.shape[0] if transposed else v.shape[1]
        nb = C // MX_BLOCK
        bpg = group // MX_BLOCK
        sign_mask = np.int32(1 << (ebits + mbits))
        sh = 23 - mbits
        half = np.int32((1 << (sh - 1)) - 1)
        code_off = np.int32((127 - bias) << mbits)
        min_normal_bits = np.int32(min_normal_bits)
        max_code = np.int32(max_code)
        e4_min_normal_bits = np.int32(121 << 23)  # 2^-6
        e4_sub_mul = np.float32(512.0)  # 2^9
        half_tile = (MX_BLOCK // 2) * LANES
        for t in prange((R + LANES - 1) // LANES):
            r0 = t * LANES
            rows = min(LANES, R - r0)
            buf = np.empty(_TILE, np.float32)
            nxt = np.empty(_TILE, np.float32)
            red = np.empty(half_tile, np.int32)
            scale = np.empty(LANES, np.float32)  # 2^-e_blk per row of the tile
            codes = np.empty(C * LANES, np.uint8)  # [block, element, lane]
            eblk = np.empty((nb, LANES), np.int32)
            live = np.empty((nb, LANES), np.bool_)
            bad = np.empty((nb, LANES), np.bool_)
            for b in range(nb):
                # load the tile (rows past R and columns past C_v read as 0)
                j0 = b * MX_BLOCK
                n_valid = min(max(c_valid - j0, 0), MX_BLOCK)
                if rows < LANES or n_valid < MX_BLOCK:
                    buf[:] = 0.0
                # (here and in the fold below the loops run over 1-D slices: LLVM vectorizes those,
                # and not the same loops over 2-D indexing)
                if not transposed:  # each row's block is contiguous in v: read along the row
                    for k in range(rows):
                        src = v[r0 + k, j0:j0 + n_valid]
                        for i in range(n_valid):
                            buf[i * LANES + k] = _widen(src[i], bf16_bits)
                else:  # element i of the tile's rows is one contiguous run of v: vector loads
                    for i in range(n_valid):
                        src = v[j0 + i, r0:r0 + rows]
                        dst = buf[i * LANES:i * LANES + rows]
                        for k in range(rows):
                            dst[k] = _widen(src[k], bf16_bits)
                if hadamard:  # butterflies h = 1..16, then x 1/sqrt(32): two roundings, as the reference
                    _butterflies(buf, nxt, 1)
                    _butterflies(nxt, buf, 2)
                    _butterflies(buf, nxt, 4)
                    _butterflies(nxt, buf, 8)
                    for u in range(half_tile):
                        a = buf[u]
                        c = buf[u + half_tile]
                        nxt[u] = (a + c) * hscale
                        nxt[u + half_tile] = (a - c) * hscale
                    buf, nxt = nxt, buf
                # Block amax as the largest magnitude bit pattern (for non-negative floats integer
                # order is float order), a tree over contiguous runs; inf and NaN bits lie above
                # every finite one, so the same maximum flags a non-finite block.
                for u in range(half_tile):
                    a = f32_bits(buf[u]) & np.int32(0x7FFFFFFF)
                    c = f32_bits(buf[u + half_tile]) & np.int32(0x7FFFFFFF)
                    red[u] = a if a > c else c
                w = half_tile // 2
                while w >= LANES:
                    for u in range(w):
                        a = red[u]
                        c = red[u + w]
                        red[u] = a if a > c else c
                    w //= 2
                for k in range(LANES):
                    amax_bits = red[k]
                    e = min(max(((amax_bits >> 23) & 0xFF) - 127 - emax, -127), 127)
                    # 2^-e, exact (0 only for e = 127, which no finite amax reaches)
                    scale[k] = bits_f32(np.int32((127 - e) << 23))
                    bad[b, k] = amax_bits >= np.int32(0x7F800000)
                    # rounding is monotonic: a block has a nonzero code iff its amax has one
                    live[b, k] = not bad[b, k] and _code(bits_f32(amax_bits) * scale[k], sh, half, code_off,
                                                         min_normal_bits, sub_mul, max_code) != 0
                    eblk[b, k] = 128 if bad[b, k] else e
                cb = b * _TILE
                for i in range(MX_BLOCK):
                    base = i * LANES
                    for k in range(LANES):
                        y = buf[base + k] * scale[k]
                        code = _code(y, sh, half, code_off, min_normal_bits, sub_mul, max_code)
                        codes[cb + base + k] = code | (sign_mask if f32_bits(y) < 0 else 0)
            for k in range(rows):
                r = r0 + k
                n_out = 0
                for gi in range(C // group):
                    e_ref = -(1 << 20)
                    for b in range(gi * bpg, (gi + 1) * bpg):
                        if live[b, k] and eblk[b, k] > e_ref:
                            e_ref = eblk[b, k]
                    if e_ref == -(1 << 20):
                        e_ref = 0  # an empty group: any scale is exact
                    s = e_ref - shift  # the group's fp32 scale 2^s, subnormal below 2^-126
                    out_scale[r, gi] = bits_f32(np.int32((s + 127) << 23 if s >= -126 else 1 << (s + 149)))
                    for b in range(gi * bpg, (gi + 1) * bpg):
                        cb = b * _TILE + k
                        ob = b * MX_BLOCK
                        if bad[b, k]:
                            for i in range(MX_BLOCK):
                                out[r, ob + i] = _E4M3_NAN
                            continue
                        d = eblk[b, k] - e_ref
                        if -window <= d <= 0:  # exact in E4M3: the byte is a function of (code, d)
                            lut = in_window_bytes[d + window]
                            o = out[r, ob:ob + MX_BLOCK]
                            # element i of lane k's block (sliced in each branch: hoisted above the
                            # branches, the kernel measured ~15 % slower)
                            cc = codes[cb:cb + MX_BLOCK * LANES:LANES]
                            for i in range(MX_BLOCK):
                                o[i] = lut[cc[i]]
                            continue
                        if live[b, k] and d < -window:
                            n_out += 1
                        p = bits_f32(np.int32((max(d + shift, -126) + 127) << 23))
                        o = out[r, ob:ob + MX_BLOCK]
                        cc = codes[cb:cb + MX_BLOCK * LANES:LANES]
                        for i in range(MX_BLOCK):
                            y = table[cc[i]] * p
                            code = _code(y, 20, np.int32((1 << 19) - 1), np.int32(120 << 3), e4_min_normal_bits,
                                         e4_sub_mul, np.int32(0x7E))
                            o[i] = code | (0x80 if f32_bits(y) < 0 else 0)
                outside[r] = n_out


@lru_cache(maxsize=None)
def _format_args(name: str) -> tuple:
    """The kernel's per-format arguments, in `_pack_rows`'s order (computed once per format)."""
    f = FORMATS[name]
    table = code_table(f)
    # q · 2^(d + shift) is an E4M3 value for every d in [-window, 0] (the fold's window), so any
    # correct rounding gives its byte: torch's float8 conversion here.
    in_window = torch.stack([(table * 2.0 ** (d + f.fold_shift)).to(torch.float8_e4m3fn).view(torch.uint8)
                             for d in range(-f.fold_window, 1)])
    return (f.ebits, f.mbits, f.bias, f.emax, int(np.float32(f.min_normal).view(np.int32)),
            np.float32(2.0 ** (f.mbits - f.emin)), max_code(f), table.numpy(), f.fold_shift,
            f.fold_window, in_window.numpy())


class _Borrowed:
    """A tensor's memory as numpy sees it, through the array interface (kept alive with it)."""

    def __init__(self, t: torch.Tensor, typestr: str):
        self.tensor = t
        self.__array_interface__ = {"version": 3, "shape": tuple(t.shape), "typestr": typestr,
                                    "data": (t.data_ptr(), False),
                                    "strides": tuple(s * t.element_size() for s in t.stride())}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array over the memory of CPU tensor `t` (any strides), for a kernel to read.

    Not `t.numpy()`: that marks the tensor's storage as never resizable again, and FSDP2 resizes
    the storage of the parameters it all-gathers (their bf16 copies are what the packer reads)."""
    typestr = {torch.int16: "<i2", torch.uint8: "|u1", torch.float32: "<f4"}[t.dtype]
    if t.numel() == 0:
        return np.empty(tuple(t.shape), np.dtype(typestr))
    return np.asarray(_Borrowed(t, typestr))


def _kernel_view(v: torch.Tensor) -> tuple[np.ndarray, bool]:
    """`v` as the kernel reads it, C-contiguous (without a copy where it is): the int16 bits of a
    bf16 tensor, or fp32 values."""
    v = v.contiguous()
    if v.dtype == torch.bfloat16:
        return numpy_view(v.view(torch.int16)), True
    return numpy_view(v.float()), False


def _fold_rows(v: torch.Tensor, fmt: str, granularity: FoldGranularity, hadamard: bool, poison: bool,
               transposed: bool = False, c: int | None = None):
    """(E4M3 data, fp32 scales, blocks outside the window) of the rows of `v` (of vᵀ with
    `transposed`) quantized along their length C_v, zero-padded to `c` (default C_v).
    `v` is bf16 or fp32, any strides."""
    f = get_format(fmt)
    if f.fold_shift is None:
        raise ValueError(f"fmt: elements of format {f.name!r} are not exactly representable in E4M3")
    if not isinstance(granularity, FoldGranularity):
        raise ValueError(f"granularity: expected a FoldGranularity, got {granularity!r}")
    r, c_v = (v.shape[1], v.shape[0]) if transposed else v.shape
    c = c_v if c is None else c
    if c % granularity.row_multiple:
        raise ValueError(f"x: {c} columns do not split into blocks of {MX_BLOCK} and {granularity.value} "
                         f"groups (a multiple of {granularity.row_multiple})")
    group = granularity.group_size(c) if c else MX_BLOCK
    vn, bf16_bits = _kernel_view(v)
    # Poisoned (0xFF: NaN in E4M3 and fp32) for tests: an element the kernel missed fails them.
    # Otherwise left uninitialised: the kernel writes every element.
    if poison:
        out = np.full((r, c), 0xFF, np.uint8)
        out_scale = np.full((r, c // group), np.nan, np.float32)
        outside = np.full(r, -(1 << 40), np.int64)
    else:
        out, out_scale, outside = np.empty((r, c), np.uint8), np.empty((r, c // group), np.float32), np.empty(r, np.int64)
    if r and c:
        _pack_rows(vn, transposed, bf16_bits, group, hadamard, np.float32(HADAMARD_SCALE), *_format_args(f.name), out,
                   out_scale, outside)
    else:
        outside[:] = 0
    data = torch.from_numpy(out).view(torch.float8_e4m3fn)
    return data, torch.from_numpy(out_scale), torch.tensor(int(outside.sum()), dtype=torch.int64)


def mx_operands_cpu(
    x: torch.Tensor,
    *,
    row: bool = True,
    col: bool = True,
    granularity: FoldGranularity = FoldGranularity.ROWWISE,
    hadamard: bool = True,
    fmt: str = "e2m3",
    prologue: str = "none",
    aux: torch.Tensor | None = None,
    colsum: bool = False,
    _poison: bool = False,
) -> MXOperands:
    """`mx_operands_reference` on the CPU, bit for bit (same arguments, same `MXOperands` result)."""
    if not HAS_NUMBA:
        raise RuntimeError("mx_operands_cpu needs numba (pip install numba); use mx_operands_reference instead")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"x: mx_operands_cpu runs on CPU tensors, got device {x.device}")
    v = apply_prologue(x, prologue, aux).contiguous()  # once for both orientations' kernel views
    row_data = row_scale = col_data = col_scale = sums = None
    outside = torch.zeros((), dtype=torch.int64)
    if row:
        row_data, row_scale, n = _fold_rows(v, fmt, granularity, hadamard, _poison)
        outside = outside + n
    if col:  # the transpose, read in place, its rows zero-padded by the kernel
        col_data, col_scale, n = _fold_rows(v, fmt, granularity, hadamard, _poison, transposed=True,
                                            c=padded_rows(v.shape[0], granularity))
        outside = outside + n
    if colsum:
        sums = v.float().sum(dim=0)
    return MXOperands(row_data, row_scale, col_data, col_scale, sums, outside)
