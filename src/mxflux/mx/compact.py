"""Saved-operand compaction: a folded E4M3 GEMM operand stored as 6-bit E2M3 codes plus one
power-of-two shift per 32-element block, 25/32 byte per element instead of 1 (docs/design.md,
"Saved operands in six bits").

The format, for data [C, Rp] float8_e4m3fn with Rp a multiple of 32 (blocks of 32 run along the
last axis, as in the col orientation of `mxflux.mx.operands`):

- shifts [C, Rp/32] uint8: per block S in 1..15, meaning every element equals c · 2^(S − 9) for
  a 6-bit E2M3 code c (sign bit 0x20, magnitude ee·8 + mmm); or `SHIFT_NAN` (0xFF): the block is
  NaN (every element expands to the E4M3 NaN byte 0x7F) and its codes are 0.
- packed [C, 3Rp/4] uint8: 24 bytes per block, in the blocks' order: 16 bytes of low nibbles
  (byte k = code[2k] & 15 | (code[2k+1] & 15) << 4) then 8 bytes of the high two bits (byte k =
  Σ_i (code[4k+i] >> 4) << 2i). Not `bitpack.pack_bits6`'s 3-byte groups: whole power-of-two
  pieces at an address that is a function of the block index alone are what the Triton kernels
  load and store with vector instructions and no index arithmetic.

S is a function of the block alone: the E4M3 exponent field of its largest magnitude byte, at
least 1. The largest element then lies below 2^(S − 6), so its code is below 8 (≤ 7.5 with 4
significant bits), and an element is representable exactly when it is a multiple of 2^(S − 12).

Why every block the packers write is representable (the fold, docs/design.md, "The exact FP8 fold
and its window", writes q · 2^(d + 5) for E2M3 values q, d = e_blk − e_ref ≤ 0):

- in-window live blocks (d ≥ −11): every element is a multiple of 2^(d+2), the largest is
  |q|max · 2^(d+5) with |q|max in [4, 7.5] (below 4 only at E8M0's clamp), so S ≤ d + 14 and
  2^(S − 12) divides 2^(d + 2): with the usual |q|max ≥ 4, S = d + 14, i.e. the shift is
  t = S − 9 = d + 5 and the codes are the MX codes themselves;
- out-of-window blocks (d < −11) were rounded to E4M3: every element is a multiple of 2^−9 and
  the largest is ≤ 7.5 · 2^−7 < 2^−4, so S ≤ 3 and 2^(S − 12) ≤ 2^−9 divides every element;
- zero blocks (±0 only) have S = 1 and codes that are just the sign bits;
- NaN blocks are 32 bytes 0x7F (the packers write torch's NaN byte) and take SHIFT_NAN.

Any other block (arbitrary bytes: finer bits than 2^(S − 12), or a NaN byte among numbers) is not
representable, and compaction does not round it: it becomes a NaN block. The format is thereby
total and never silently corrupts; a poisoned block shows as NaN in the GEMM that reads it.
`compactable_blocks` says which blocks survive, for tests and debugging. `expand_operand` inverts
`compact_operand` on every block that is representable or all 0x7F, byte for byte; it is defined
on what `compact_operand` produces.
"""

from __future__ import annotations

import torch

from .constants import MX_BLOCK
from .formats import code_table, get_format

__all__ = ["SHIFT_NAN", "compact_operand", "compactable_blocks", "compacted_shapes", "expand_operand"]

SHIFT_NAN = 0xFF  # the shift byte of a NaN (or poisoned) block
_E4M3_NAN = 0x7F  # the byte torch (and every packer) writes for NaN in float8_e4m3fn
_E2M3 = get_format("e2m3")


def compacted_shapes(c: int, rp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed shape, shifts shape) of an operand [c, rp]."""
    return (c, 3 * rp // 4), (c, rp // MX_BLOCK)


def _check_data(data) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"data: expected a float8_e4m3fn tensor, got {getattr(data, 'dtype', type(data))}")
    if data.dim() != 2 or data.shape[1] % MX_BLOCK:
        raise ValueError(f"data: expected a 2-D [C, Rp] tensor with Rp a multiple of {MX_BLOCK}, "
                         f"got shape {tuple(data.shape)}")


def check_compacted(packed, shifts) -> int:
    """Validate (packed, shifts) as `expand_operand` takes them; returns Rp."""
    for name, t in (("packed", packed), ("shifts", shifts)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D uint8 tensor, got "
                             f"{getattr(t, 'dtype', type(t))} of shape {tuple(getattr(t, 'shape', ()))}")
    c, nb = shifts.shape
    if tuple(packed.shape) != (c, 24 * nb):
        raise ValueError(f"packed: expected shape {(c, 24 * nb)} for shifts of shape {(c, nb)}, "
                         f"got {tuple(packed.shape)}")
    if packed.device != shifts.device:
        raise ValueError(f"shifts: on {shifts.device}, packed on {packed.device}")
    return nb * MX_BLOCK


def _code_lut(device) -> torch.Tensor:
    """8·|value| (an integer 0..60) → the E2M3 magnitude code, −1 off the E2M3 grid."""
    vals = code_table(_E2M3)[:32]  # magnitudes of codes 0..31
    lut = torch.full((61,), -1, dtype=torch.int32)
    lut[(vals * 8).to(torch.int64)] = torch.arange(32, dtype=torch.int32)
    return lut.to(device)


def _analyse(data: torch.Tensor):
    """(shift S per block, magnitude codes, representable per element, NaN per block)."""
    c, rp = data.shape
    b = data.view(torch.uint8).reshape(c, rp // MX_BLOCK, MX_BLOCK).to(torch.int32)
    top = (b & 0x7F).amax(dim=-1)  # E4M3 magnitudes order like their bytes; NaN (0x7F) is the top
    nan = top == _E4M3_NAN
    s = (top >> 3).clamp(min=1)
    x = data.float().abs().reshape(b.shape)
    q8 = x * torch.exp2((12 - s).float()).unsqueeze(-1)  # 8·|x| / 2^(S−9): exact, a power of two
    q8 = torch.where(torch.isnan(q8), torch.full_like(q8, 0.5), q8)
    whole = (q8 == q8.floor()) & (q8 <= 60)
    idx = torch.where(whole, q8, torch.zeros_like(q8)).to(torch.int64)
    mag = _code_lut(data.device)[idx]
    ok = whole & (mag >= 0)
    return s, torch.where(ok, mag, 0), ok, nan, b


def compactable_blocks(data: torch.Tensor) -> torch.Tensor:
    """bool [C, Rp/32]: the blocks `compact_operand` keeps exactly (representable, or all 0x7F)."""
    _check_data(data)
    s, _, ok, nan, b = _analyse(data)
    return torch.where(nan, (b == _E4M3_NAN).all(dim=-1), ok.all(dim=-1))


def compact_operand(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn [C, Rp] → (packed uint8 [C, 3Rp/4], shifts uint8 [C, Rp/32]); see the module
    docstring for the format. Blocks that are not representable become NaN blocks."""
    _check_data(data)
    c, rp = data.shape
    s, mag, ok, nan, b = _analyse(data)
    keep = ok.all(dim=-1) & ~nan
    codes = torch.where(keep.unsqueeze(-1), mag | ((b & 0x80) >> 2), 0).reshape(c, rp)
    shifts = torch.where(keep, s, SHIFT_NAN).to(torch.uint8)
    blocks = codes.reshape(c, rp // MX_BLOCK, MX_BLOCK)
    pairs = blocks.reshape(c, rp // MX_BLOCK, 16, 2)
    nibbles = (pairs[..., 0] & 15) | ((pairs[..., 1] & 15) << 4)
    quads = (blocks >> 4).reshape(c, rp // MX_BLOCK, 8, 4)
    crumbs = quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)
    return torch.cat([nibbles, crumbs], dim=-1).reshape(c, 3 * rp // 4).to(torch.uint8), shifts


def expand_operand(packed: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Inverse of `compact_operand`: (packed [C, 3Rp/4], shifts [C, Rp/32]) → float8_e4m3fn [C, Rp].
    Shift bytes above 15 (SHIFT_NAN) expand to NaN blocks."""
    rp = check_compacted(packed, shifts)
    c = shifts.shape[0]
    p = packed.to(torch.int32).reshape(c, rp // MX_BLOCK, 24)
    nib, crumbs = p[..., :16], p[..., 16:]
    lo = torch.stack([nib & 15, nib >> 4], dim=-1).reshape(c, rp)
    hi = torch.stack([(crumbs >> (2 * i)) & 3 for i in range(4)], dim=-1).reshape(c, rp)
    codes = (lo | (hi << 4)).long()
    s = shifts.to(torch.int32)
    scale = torch.exp2((s - 9).clamp(max=6).float())
    scale = torch.where(s > 15, torch.full_like(scale, float("nan")), scale)
    vals = code_table(_E2M3, packed.device)[codes].reshape(c, rp // MX_BLOCK, MX_BLOCK) * scale.unsqueeze(-1)
    return vals.reshape(c, rp).to(torch.float8_e4m3fn)
