"""Triton kernels that compact a folded E4M3 operand into 6-bit E2M3 codes plus per-block shifts
and expand it back: `compact_operand_cuda`, `expand_operand_cuda`, bit-identical to
`mxflux.mx.compact` (the format and why it is exact are there, and in docs/design.md, "Saved
operands in six bits").

Both are pure streaming (1 B in, 25/32 B out, and back), so the design is about bytes moved and
instructions per byte:

- The operand is handled as a flat run of 32-byte blocks (rows of [C, Rp] hold whole blocks). A
  block is 8 int32 words, each 4 elements; everything stays in that [blocks, 8] shape, so no
  reshape, split or re-layout between threads is needed. Loads and stores are whole words.
- The conversions run on the hardware: E4M3 → f16 (exact), a multiply by a power of two (exact in
  f16 here), f16 → E4M3 (exact for every representable element). An E2M3 code c is the E4M3 byte
  of its value times 2^-6 (E4M3's subnormal step 2^-9 lines up with E2M3's 2^-3), so compacting
  is "scale the element by 2^(3 − S) and read the E4M3 byte", expanding is the reverse. Compact
  checks exactness by converting back; a block that is not exact becomes a NaN block, as in the
  reference. Under Triton's CPU interpreter the conversions are emulated in integer arithmetic
  (`triton_common`), as in the packers.
- Codes are written as a 16-bit word of four low nibbles and one byte of four high 2-bit pieces
  per four elements: the reference's row layout, 16 + 8 bytes per block.

Without Triton (or CUDA) this module imports and the entry points raise a RuntimeError that says why.
"""

from __future__ import annotations

import torch

from ..mx.compact import SHIFT_NAN, _check_data, check_compacted, compacted_shapes
from ..mx.constants import MX_BLOCK
from .triton_common import HAS_TRITON, compiled_launch, interpreting, launch_options

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import e4m3_byte_to_f32, f16_pow2_bits, f32_to_e4m3, pow2_f32

__all__ = ["compact_operand_cuda", "expand_operand_cuda"]

_BB = 512  # blocks per program: 4 per thread at 4 warps (each thread holds 16-byte halves of blocks)
_WARPS = 4

if HAS_TRITON:
    _SNAN = tl.constexpr(SHIFT_NAN)

    @triton.jit
    def _rescale_byte(b, k):
        """Integer emulation (interpreter): E4M3 byte of (E4M3 byte b) · 2^k, nearest even; NaN
        where k > 12."""
        f = tl.where(k > 12, float("nan"), pow2_f32(k))
        return f32_to_e4m3(e4m3_byte_to_f32(b) * f, False).to(tl.int32)

    @triton.jit
    def _rescale_word(w, k, HW: tl.constexpr):
        """Each E4M3 byte of the int32 word w times 2^k (k per block, [BB, 1], in [-12, 12]; NaN
        where k > 12), nearest even, as a word. On the GPU: E4M3 pairs to f16x2 and back with one
        f16x2 multiply in between, 7 instructions for 4 elements (exact: f16 holds every product)."""
        if HW:
            fb = tl.where(k > 12, 0x7E00, f16_pow2_bits(k))
            f = fb | (fb << 16)
            return tl.inline_asm_elementwise(
                "{ .reg .b16 l, h, ol, oh; .reg .b32 xl, xh; mov.b32 {l, h}, $1; "
                "cvt.rn.f16x2.e4m3x2 xl, l; cvt.rn.f16x2.e4m3x2 xh, h; "
                "mul.rn.f16x2 xl, xl, $2; mul.rn.f16x2 xh, xh, $2; "
                "cvt.rn.satfinite.e4m3x2.f16x2 ol, xl; cvt.rn.satfinite.e4m3x2.f16x2 oh, xh; "
                "mov.b32 $0, {ol, oh}; }",
                "=r,r,r", [w, f], dtype=tl.int32, is_pure=True, pack=1)
        else:
            out = tl.zeros_like(w)
            for i in tl.static_range(4):
                out = out | (_rescale_byte((w >> (8 * i)) & 0xFF, k) << (8 * i))
            return out

    @triton.jit
    def _top_magnitude(w, HW: tl.constexpr):
        """The largest magnitude byte (b & 0x7F) of each int32 word's four E4M3 bytes."""
        m = w & 0x7F7F7F7F
        if HW:  # two u16 lanes: bytes 0, 2 against bytes 1, 3 (sm_90 has max.u16x2)
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 a, b; and.b32 a, $1, 0x00FF00FF; shr.b32 b, $1, 8; and.b32 b, b, 0x00FF00FF; "
                "max.u16x2 $0, a, b; }", "=r,r", [m], dtype=tl.int32, is_pure=True, pack=1)
            return tl.maximum(r & 0xFFFF, r >> 16)
        else:
            return tl.maximum(tl.maximum(m & 0xFF, (m >> 8) & 0xFF), tl.maximum((m >> 16) & 0xFF, m >> 24))

    @triton.jit
    def _block_offsets(n_blocks, BB: tl.constexpr):
        """This program's BB blocks, which exist, the 8 words of a block, and where each block's
        codes live: block i owns bytes [24i, 24i + 24) of the packed buffer, 16 of nibbles
        (offsets in int16 units) then 8 of crumbs (in bytes)."""
        blk = tl.program_id(0) * BB + tl.arange(0, BB)
        g = tl.arange(0, 8)
        o_nib = (blk * 12)[:, None] + g[None, :]
        o_crumb = (blk * 24 + 16)[:, None] + g[None, :]
        return blk, blk < n_blocks, g, o_nib, o_crumb

    @triton.jit
    def _compact_kernel(data_ptr, nib_ptr, crumb_ptr, shift_ptr, n_blocks,
                        BB: tl.constexpr, HW: tl.constexpr):
        blk, live, g, o_nib, o_crumb = _block_offsets(n_blocks, BB)
        w = tl.load(data_ptr + blk[:, None] * 8 + g[None, :], mask=live[:, None], other=0)  # [BB, 8] int32
        # E4M3 magnitudes order like their bytes, NaN (0x7F) on top
        top = tl.max(_top_magnitude(w, HW), axis=1)
        s = tl.maximum(top >> 3, 1)
        k = (3 - s)[:, None]
        # the E2M3 code of x · 2^(9 - S) is the E4M3 byte of x · 2^(3 - S): 4 codes per word
        c = _rescale_word(w, k, HW)
        # exact iff scaling back gives the element again
        bad = _rescale_word(c, -k, HW) != w
        keep = (tl.max(bad.to(tl.int32), axis=1) == 0) & (top != 0x7F)
        # 6-bit codes: the E2M3 magnitude (5 bits) and the sign moved from bit 7 to bit 5
        c = tl.where(keep[:, None], (c & 0x1F1F1F1F) | ((c >> 2) & 0x20202020), 0)
        n = c & 0x0F0F0F0F
        n = n | (n >> 4)  # bytes 0 and 2: code0 | code1 << 4, code2 | code3 << 4
        nib = (n & 0xFF) | ((n >> 8) & 0xFF00)
        h = (c >> 4) & 0x03030303
        h = h | (h >> 6)  # bits 0-3: hi0 | hi1 << 2; bits 16-19: hi2 | hi3 << 2
        crumb = (h & 0xF) | ((h >> 12) & 0xF0)
        tl.store(nib_ptr + o_nib, nib.to(tl.int16), mask=live[:, None])
        tl.store(crumb_ptr + o_crumb, crumb.to(tl.uint8), mask=live[:, None])
        tl.store(shift_ptr + blk, tl.where(keep, s, _SNAN).to(tl.uint8), mask=live)

    @triton.jit
    def _expand_kernel(nib_ptr, crumb_ptr, shift_ptr, out_ptr, n_blocks,
                       BB: tl.constexpr, HW: tl.constexpr):
        blk, live, g, o_nib, o_crumb = _block_offsets(n_blocks, BB)
        n = tl.load(nib_ptr + o_nib, mask=live[:, None], other=0).to(tl.int32) & 0xFFFF
        h = tl.load(crumb_ptr + o_crumb, mask=live[:, None], other=0).to(tl.int32)
        s = tl.load(shift_ptr + blk, mask=live, other=0).to(tl.int32)
        k = tl.where(s > 15, 13, s - 3)[:, None]  # 13: NaN
        # spread 4 nibbles / 4 two-bit pieces to the 4 bytes of a word
        n = (n | (n << 8)) & 0x00FF00FF
        n = (n | (n << 4)) & 0x0F0F0F0F
        h = (h | (h << 12)) & 0x000F000F
        h = (h | (h << 6)) & 0x03030303
        code = n | (h << 4)
        c8 = (code & 0x1F1F1F1F) | ((code & 0x20202020) << 2)  # E4M3 bytes of the codes' values · 2^-6
        tl.store(out_ptr + blk[:, None] * 8 + g[None, :], _rescale_word(c8, k, HW), mask=live[:, None])


def _available(name: str) -> bool:
    if not HAS_TRITON:
        raise RuntimeError(f"{name}: Triton is not installed; use mxflux.mx.compact on this machine")
    if not (torch.cuda.is_available() or interpreting()):
        raise RuntimeError(f"{name}: no CUDA device; use mxflux.mx.compact on this machine")
    return True


def _check_device(t: torch.Tensor, name: str, fn: str) -> None:
    if not (t.is_cuda or interpreting()):
        raise ValueError(f"{name}: {fn} needs a CUDA tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: {fn} needs a contiguous tensor (strides {t.stride()})")


# ------------------------------------------------------------------ launching
# One plan per (kernel, shapes, device, alignment, emulation): the grid, and after the first
# launch the compiled kernel's direct launcher (host time per call, as the packers).
_PLANS: dict[tuple, list] = {}


def _launch(kernel, runtime_names, tensors: tuple, n_blocks: int, hw: bool) -> None:
    if n_blocks == 0:
        return
    dev = tensors[0].device
    key = (kernel, n_blocks, dev, hw, tuple(t.data_ptr() % 16 == 0 for t in tensors))
    plan = _PLANS.get(key)
    grid = (-(-n_blocks // _BB), 1)
    if plan is not None and plan[0] and plan[0].usable():
        plan[0](grid, (*(t.data_ptr() for t in tensors), n_blocks))
        return
    consts = dict(BB=_BB, HW=hw)
    compiled = kernel[grid[:1]](*tensors, n_blocks, **consts, **launch_options(_WARPS))
    if plan is None:
        fast = None
        if dev.type == "cuda" and dev.index == torch.cuda.current_device():
            fast = compiled_launch(compiled, runtime_names, (*tensors, n_blocks), consts, dev.index)
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = [fast]


def compact_operand_cuda(data: torch.Tensor, *, _hw: bool | None = None,
                         _poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `mxflux.mx.compact.compact_operand` (same outputs, bit for bit)."""
    _available("compact_operand_cuda")
    _check_data(data)
    _check_device(data, "data", "compact_operand_cuda")
    c, rp = data.shape
    pshape, sshape = compacted_shapes(c, rp)
    packed = torch.empty(pshape, dtype=torch.uint8, device=data.device)
    shifts = torch.empty(sshape, dtype=torch.uint8, device=data.device)
    if _poison:  # tests: a byte the kernel missed shows
        packed.fill_(0xA5)
        shifts.fill_(0xA5)
    hw = (not interpreting()) if _hw is None else bool(_hw)
    _launch(_compact_kernel, ("data_ptr", "nib_ptr", "crumb_ptr", "shift_ptr", "n_blocks"),
            (data.view(torch.int32), packed.view(torch.int16), packed, shifts), c * rp // MX_BLOCK, hw)
    return packed, shifts


def expand_operand_cuda(packed: torch.Tensor, shifts: torch.Tensor, *, _hw: bool | None = None,
                        _poison: bool = False) -> torch.Tensor:
    """Triton twin of `mxflux.mx.compact.expand_operand` (same output, bit for bit)."""
    _available("expand_operand_cuda")
    rp = check_compacted(packed, shifts)
    _check_device(packed, "packed", "expand_operand_cuda")
    _check_device(shifts, "shifts", "expand_operand_cuda")
    c = shifts.shape[0]
    out = torch.empty((c, rp), dtype=torch.float8_e4m3fn, device=packed.device)
    if _poison:
        out.view(torch.uint8).fill_(0xA5)
    hw = (not interpreting()) if _hw is None else bool(_hw)
    _launch(_expand_kernel, ("nib_ptr", "crumb_ptr", "shift_ptr", "out_ptr", "n_blocks"),
            (packed.view(torch.int16), packed, shifts, out.view(torch.int32)), c * rp // MX_BLOCK, hw)
    return out
