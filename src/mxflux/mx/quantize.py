"""Reference MX quantization: the definition every kernel must match bit for bit
(docs/design.md, "Element formats and E8M0 scales").

Pure PyTorch, vectorised, device-agnostic. Scales are E8M0 codes (stored uint8, value
2^(code-127), 0xFF = NaN); elements are codes of an `ElementFormat` (one per byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import E8M0_BIAS, E8M0_NAN, MX_BLOCK
from .formats import ElementFormat, code_table, get_format
from .hadamard import hadamard32

__all__ = ["MXTensor", "block_exponents", "dequantize", "e8m0_to_float", "max_code", "pow2", "quantize",
           "round_to_format"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer k in the normal range [-126, 127], built from the bits."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 codes: 2^(code-127) (2^-127 is an fp32 subnormal), NaN for 0xFF."""
    c = scales.to(torch.int32)
    normal = (c.clamp(min=1) << 23).view(torch.float32)  # code c → exponent bits c
    sub = torch.tensor(2.0**-127, dtype=torch.float32, device=scales.device)
    out = torch.where(c == 0, sub, normal)
    return torch.where(c == E8M0_NAN, torch.full_like(out, float("nan")), out)


@dataclass
class MXTensor:
    """A tensor quantized in blocks of `block` consecutive elements along `axis`.

    `codes` has the shape of the source tensor (one element code per byte, in the rotated basis
    when `hadamard` is set); `scales` has that shape with the `axis` dimension divided by `block`.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str
    axis: int
    hadamard: bool
    block: int = MX_BLOCK

    @property
    def format(self) -> ElementFormat:
        return get_format(self.fmt)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> "MXTensor":
        return MXTensor(self.codes.to(device), self.scales.to(device), self.fmt, self.axis,
                        self.hadamard, self.block)

    def element_values(self) -> torch.Tensor:
        """fp32 values of the element codes, before scaling."""
        return code_table(self.format, self.codes.device)[self.codes.long()]

    def scale_values(self) -> torch.Tensor:
        """fp32 block scales broadcast to the shape of `codes`."""
        s = e8m0_to_float(self.scales)
        return s.repeat_interleave(self.block, dim=self.axis)

    def dequantize(self, dtype: torch.dtype = torch.float32, unrotate: bool = True) -> torch.Tensor:
        """Exact fp32 values (element × 2^scale), rotated back unless `unrotate=False`."""
        v = self.element_values() * self.scale_values()
        if self.hadamard and unrotate:
            v = hadamard32(v, axis=self.axis)
        return v.to(dtype)


def _check_input(x: torch.Tensor, axis: int, block: int, hadamard: bool) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension, got a scalar")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis: {axis} is out of range for a {x.dim()}-D tensor")
    axis %= x.dim()
    if block <= 0:
        raise ValueError(f"block: expected a positive block size, got {block}")
    if hadamard and block != MX_BLOCK:
        raise ValueError(f"block: the Hadamard rotation is {MX_BLOCK}-point, so block must be {MX_BLOCK}, "
                         f"got {block}")
    if x.shape[axis] % block:
        raise ValueError(
            f"x: length {x.shape[axis]} along axis {axis} is not a multiple of the block size {block}"
        )
    return axis


def block_exponents(amax: torch.Tensor, f: ElementFormat) -> torch.Tensor:
    """Shared exponent e = floor(log2(amax)) - emax from the fp32 exponent bits, clamped to ±127."""
    ebits = (amax.contiguous().view(torch.int32) >> 23) & 0xFF
    return (ebits - E8M0_BIAS - f.emax).clamp(-127, 127)


def round_to_format(y: torch.Tensor, f: ElementFormat) -> torch.Tensor:
    """Codes of fp32 `y` rounded to the nearest `f` value, ties to even, saturating at ±max.

    Works on the fp32 bit pattern: in `f`'s normal range, rounding the fp32 mantissa to `mbits`
    bits (round-half-even on the integer, carries ripple into the exponent) yields the code
    directly; in `f`'s subnormal range the code is the value counted in subnormal steps.
    """
    mag = y.abs()
    bits = mag.view(torch.int32)
    shift = 23 - f.mbits
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal_code = rounded - ((127 - f.bias) << f.mbits)
    # mag·2^(mbits-emin) is exact (power-of-two scaling); torch.round is half-to-even.
    sub_code = torch.round(mag * 2.0 ** (f.mbits - f.emin)).to(torch.int32)
    code = torch.where(mag < f.min_normal, sub_code, normal_code).clamp_(max=max_code(f))
    sign = (y.view(torch.int32) < 0).to(torch.int32) << (f.ebits + f.mbits)
    return (code | sign).to(torch.uint8)


def max_code(f: ElementFormat) -> int:
    """Code of the largest finite magnitude (saturation target)."""
    table = code_table(f)
    mags = torch.where(table[: f.sign_mask].isnan(), -1.0, table[: f.sign_mask])
    return int(torch.argmax(mags))


def quantize(
    x: torch.Tensor,
    fmt: str | ElementFormat = "e2m3",
    *,
    axis: int = -1,
    block: int = MX_BLOCK,
    hadamard: bool = True,
) -> MXTensor:
    """Quantize `x` to MX: blocks of `block` elements along `axis`, E8M0 scales, `fmt` elements.

    With `hadamard=True` each block is first rotated by the 32-point Walsh–Hadamard transform.
    A block holding NaN or Inf gets the NaN scale (0xFF) and zero element codes, so it
    dequantizes to NaN: NaN propagates, it is never clamped away.
    """
    f = get_format(fmt)
    axis = _check_input(x, axis, block, hadamard)
    v = hadamard32(x, axis=axis) if hadamard else x.float()
    vt = v.movedim(axis, -1)
    lead, n = vt.shape[:-1], vt.shape[-1]
    blocks = vt.reshape(*lead, n // block, block)

    amax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    e = block_exponents(amax, f)
    y = blocks * pow2(-e).unsqueeze(-1)
    codes = round_to_format(y, f)
    codes = codes.masked_fill(bad.unsqueeze(-1), 0)
    scales = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)

    codes = codes.reshape(*lead, n).movedim(-1, axis).contiguous()
    scales = scales.movedim(-1, axis).contiguous()
    return MXTensor(codes, scales, f.name, axis, hadamard, block)


def dequantize(mx: MXTensor, dtype: torch.dtype = torch.float32, unrotate: bool = True) -> torch.Tensor:
    """Function form of `MXTensor.dequantize`."""
    return mx.dequantize(dtype=dtype, unrotate=unrotate)
