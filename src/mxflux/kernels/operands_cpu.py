"""The CPU fast path of the MX operand packer: one compiled pass per orientation, bit-identical to
`mxflux.mx.operands.mx_operands_reference`.

The reference is ~45 whole-tensor PyTorch ops per orientation; on a small CPU that is most of a
training step of the demo model. This kernel does the same arithmetic (docs/design.md, "Element
formats and E8M0 scales" and "The exact FP8 fold and its window") per MX block in registers,
compiled by numba: rotate (butterflies h = 1..16,
then × fp32 1/√32), E8M0 exponent from the fp32 bits of the block amax, E2M3 codes by the
same integer round-half-even on the fp32 bits, then the FP8 fold per group (row or 1×g) and
the E4M3 byte of every element, written directly. Prologues and column sums stay in PyTorch
(they are single ops there, and their exact torch rounding is part of the reference).

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

    HAS_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAS_NUMBA = False

__all__ = ["HAS_NUMBA", "cpu_kernel_available", "mx_operands_cpu", "numpy_view"]

_E4M3 = FORMATS["e4m3"]
_E4M3_NAN = 0x7F  # the byte torch writes for a (positive) NaN in float8_e4m3fn


def cpu_kernel_available() -> bool:
    """True when numba is importable, so `mx_operands_cpu` can run."""
    return HAS_NUMBA


if HAS_NUMBA:

    @njit(cache=True, inline="always")
    def _round_code(ybits, ebits, mbits, bias, min_normal_bits, sub_mul, max_code, y):
        """`mxflux.mx.quantize.round_to_format` for one fp32 value (its bits and its value)."""
        magbits = ybits & 0x7FFFFFFF
        sh = 23 - mbits
        if magbits < min_normal_bits:  # the format's subnormal range: count subnormal steps
            code = np.int32(np.rint(np.float32(abs(y)) * sub_mul))
        else:
            rounded = (magbits + ((1 << (sh - 1)) - 1) + ((magbits >> sh) & 1)) >> sh
            code = rounded - ((127 - bias) << mbits)
        if code > max_code:
            code = max_code
        if ybits < 0:
            code |= 1 << (ebits + mbits)
        return code

    @njit(cache=True, inline="always")
    def _butterflies(src, dst, h):
        """One Hadamard stage over one block (numba freezes the global MX_BLOCK as a constant): dst[j] = a + b, dst[j + h] = a - b in groups of 2h."""
        for g in range(0, MX_BLOCK, 2 * h):
            for j in range(h):
                a = src[g + j]
                c = src[g + h + j]
                dst[g + j] = a + c
                dst[g + h + j] = a - c

    @njit(cache=True, parallel=True)
    def _pack_rows(v, bf16_bits, group, hadamard, hscale, ebits, mbits, bias, emax, min_normal_bits, sub_mul,
                   max_code, table, shift, window, in_window_bytes, out, out_scale, outside):
        """Quantize every row of `v` [R, C_v] along its columns in blocks of MX_BLOCK and fold it:
        E4M3 bytes into `out` [R, C] (uint8), fp32 group scales into `out_scale` [R, C/group],
        per-row count of live blocks outside the fold window into `outside` [R].
        `in_window_bytes` [window + 1, codes]: the E4M3 byte of code q in a block d = e_blk − e_ref
        binades below its group's reference, for the blocks the fold keeps exact (a table lookup
        instead of scaling and rounding each element; the others are rounded here).

        `v` is fp32, or (`bf16_bits`) the int16 bits of bf16 values, widened here as they are
        read, so that no fp32 copy of a bf16 input is made. It may be a strided view (the col
        orientation reads the transpose of the input in place), and it may be narrower than
        `out`: columns C_v..C-1 read as zeros (the col orientation's padded rows)."""
        R, C = out.shape
        c_valid = v.shape[1]
        nb = C // MX_BLOCK
        bpg = group // MX_BLOCK
        sign_mask = 1 << (ebits + mbits)
        e4_min_normal_bits = np.int32(121 << 23)  # 2^-6
        e4_sub_mul = np.float32(512.0)  # 2^9
        for r in prange(R):
            buf = np.empty(MX_BLOCK, np.float32)
            nxt = np.empty(MX_BLOCK, np.float32)
            bufi = buf.view(np.int32)  # the fp32 bits of buf
            one = np.empty(1, np.float32)
            codes = np.empty(C, np.int32)
            eblk = np.empty(nb, np.int32)
            live = np.empty(nb, np.bool_)
            bad = np.empty(nb, np.bool_)
            for b in range(nb):
                for i in range(MX_BLOCK):
                    j = b * MX_BLOCK + i
                    if j >= c_valid:
                        buf[i] = 0.0
                    elif bf16_bits:
                        bufi[i] = np.int32(v[r, j]) << 16  # a bf16 is the high half of its fp32
                    else:
                        buf[i] = v[r, j]
                if hadamard:
                    _butterflies(buf, nxt, 1)
                    _butterflies(nxt, buf, 2)
                    _butterflies(buf, nxt, 4)
                    _butterflies(nxt, buf, 8)
                    _butterflies(buf, nxt, 16)
                    for i in range(MX_BLOCK):
                        buf[i] = nxt[i] * hscale
                amax = np.float32(0.0)
                finite = True
                for i in range(MX_BLOCK):
                    x = buf[i]
                    if not np.isfinite(x):
                        finite = False
                    ax = abs(x)
                    if ax > amax:
                        amax = ax
                bad[b] = not finite
                if not finite:
                    for i in range(MX_BLOCK):
                        codes[b * MX_BLOCK + i] = 0
                    eblk[b] = 128
                    live[b] = False
                    continue
                one[0] = amax
                abits = one.view(np.int32)[0]
                e = ((abits >> 23) & 0xFF) - 127 - emax
                e = min(max(e, -127), 127)
                eblk[b] = e
                one[0] = 0.0
                one.view(np.int32)[0] = (127 - e) << 23
                p = one[0]  # 2^-e, exact (0 only for e = 127, which no finite amax reaches)
                for i in range(MX_BLOCK):
                    buf[i] = buf[i] * p
                nz = False
                for i in range(MX_BLOCK):
                    code = _round_code(bufi[i], ebits, mbits, bias, min_normal_bits, sub_mul, max_code, buf[i])
                    codes[b * MX_BLOCK + i] = code
                    if (code & (sign_mask - 1)) != 0:
                        nz = True
                live[b] = nz
            n_out = 0
            for gi in range(C // group):
                e_ref = -(1 << 20)
                for b in range(gi * bpg, (gi + 1) * bpg):
                    if live[b] and eblk[b] > e_ref:
                        e_ref = eblk[b]
                if e_ref == -(1 << 20):
                    e_ref = 0  # an empty group: any scale is exact
                k = e_ref - shift  # the group's fp32 scale 2^k, subnormal below 2^-126
                if k >= -126:
                    one.view(np.int32)[0] = (k + 127) << 23
                else:
                    one.view(np.int32)[0] = 1 << (k + 149)
                out_scale[r, gi] = one[0]
                for b in range(gi * bpg, (gi + 1) * bpg):
                    if bad[b]:
                        for i in range(MX_BLOCK):
                            out[r, b * MX_BLOCK + i] = _E4M3_NAN
                        continue
                    d = eblk[b] - e_ref
                    if -window <= d <= 0:  # exact in E4M3: the byte is a function of (code, d)
                        for i in range(MX_BLOCK):
                            out[r, b * MX_BLOCK + i] = in_window_bytes[d + window, codes[b * MX_BLOCK + i]]
                        continue
                    if live[b] and d < -window:
                        n_out += 1
                    m = max(d + shift, -126)
                    one.view(np.int32)[0] = (m + 127) << 23
                    p = one[0]
                    for i in range(MX_BLOCK):
                        buf[i] = table[codes[b * MX_BLOCK + i]] * p
                    for i in range(MX_BLOCK):
                        out[r, b * MX_BLOCK + i] = _round_code(bufi[i], 4, 3, 7, e4_min_normal_bits, e4_sub_mul,
                                                         0x7E, buf[i])
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
    """`v` as the kernel reads it, without a copy where possible: the int16 bits of a bf16 tensor
    (any strides), or fp32 values."""
    if v.dtype == torch.bfloat16:
        return numpy_view(v.view(torch.int16)), True
    return numpy_view(v.float()), False


def _fold_rows(v: torch.Tensor, fmt: str, granularity: FoldGranularity, hadamard: bool, poison: bool,
               c: int | None = None):
    """(E4M3 data, fp32 scales, blocks outside the window) of [R, C_v] `v` quantized along its
    columns, zero-padded to `c` columns (default C_v). `v` is bf16 or fp32, any strides."""
    f = get_format(fmt)
    if f.fold_shift is None:
        raise ValueError(f"fmt: elements of format {f.name!r} are not exactly representable in E4M3")
    if not isinstance(granularity, FoldGranularity):
        raise ValueError(f"granularity: expected a FoldGranularity, got {granularity!r}")
    r = v.shape[0]
    c = v.shape[1] if c is None else c
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
        _pack_rows(vn, bf16_bits, group, hadamard, np.float32(HADAMARD_SCALE), *_format_args(f.name), out,
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
    v = apply_prologue(x, prologue, aux)
    row_data = row_scale = col_data = col_scale = sums = None
    outside = torch.zeros((), dtype=torch.int64)
    if row:
        row_data, row_scale, n = _fold_rows(v, fmt, granularity, hadamard, _poison)
        outside = outside + n
    if col:  # the transpose, read in place, its rows zero-padded by the kernel
        col_data, col_scale, n = _fold_rows(v.t(), fmt, granularity, hadamard, _poison,
                                            c=padded_rows(v.shape[0], granularity))
        outside = outside + n
    if colsum:
        sums = v.float().sum(dim=0)
    return MXOperands(row_data, row_scale, col_data, col_scale, sums, outside)
