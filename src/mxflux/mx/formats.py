"""Element formats of the OCP MX spec, as data.

Every format is described by its bit layout; the value grid, the largest value and the
shared-exponent offset (`emax`) all follow from it, so adding a format is adding a row,
not a code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from .constants import E4M3_MAX, E4M3_MIN_SUBNORMAL_EXP

__all__ = ["ElementFormat", "FORMATS", "code_table", "get_format"]


@dataclass(frozen=True)
class ElementFormat:
    """A sign-exponent-mantissa element format (no infinities are used by MX)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float  # largest finite magnitude
    # Exponent field value reserved for NaN/Inf at the top of the range, if any (E5M2);
    # E4M3 ("fn") only reserves the single all-ones code, which `max` already excludes.

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def emax(self) -> int:
        """floor(log2(max)): the shared-exponent offset of the MX scale rule."""
        return math.floor(math.log2(self.max))

    @property
    def sign_mask(self) -> int:
        return 1 << (self.ebits + self.mbits)

    @property
    def fold_shift(self) -> int | None:
        """Largest s with max·2^s ≤ 448 (E4M3's max), or None if elements are not E4M3 values.

        Used by the FP8 fold (docs/design.md, "The exact FP8 fold and its window"): an element q
        of this format times 2^s is an exact E4M3 number. Needs at most 3 mantissa bits.
        """
        if self.mbits > 3:
            return None
        s = math.floor(math.log2(E4M3_MAX / self.max))
        # E5M2's range is wider than E4M3's: its small values have no E4M3 image at any shift.
        if math.log2(self.min_subnormal) + s < E4M3_MIN_SUBNORMAL_EXP:
            return None
        return s

    @property
    def fold_window(self) -> int | None:
        """How many binades below a group's reference exponent a block may sit and still fold exactly.

        The smallest non-zero element, min_subnormal·2^(s - window), must stay ≥ 2^-9 (E4M3's
        smallest subnormal), and the E4M3 quantum there (2^-9) is fine enough for every element
        because elements have ≤ 3 mantissa bits.
        """
        s = self.fold_shift
        if s is None:
            return None
        window = int(math.log2(self.min_subnormal)) + s - E4M3_MIN_SUBNORMAL_EXP
        return window if window >= 0 else None


FORMATS: dict[str, ElementFormat] = {
    "e2m3": ElementFormat("e2m3", ebits=2, mbits=3, bias=1, max=7.5),
    "e3m2": ElementFormat("e3m2", ebits=3, mbits=2, bias=3, max=28.0),
    "e2m1": ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max=6.0),
    "e4m3": ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max=448.0),
    "e5m2": ElementFormat("e5m2", ebits=5, mbits=2, bias=15, max=57344.0),
}


def get_format(fmt: str | ElementFormat, *, arg: str = "fmt") -> ElementFormat:
    """Look a format up by name; a clear ValueError names the argument otherwise."""
    if isinstance(fmt, ElementFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(
            f"{arg}: unknown element format {fmt!r}; expected one of {sorted(FORMATS)}"
        ) from None


@lru_cache(maxsize=None)
def _code_table_cpu(name: str) -> torch.Tensor:
    """fp32 value of every code of a format (index = code), built from the bit layout."""
    f = FORMATS[name]
    codes = torch.arange(1 << f.bits, dtype=torch.int64)
    sign = torch.where(codes & f.sign_mask != 0, -1.0, 1.0).double()
    efield = (codes >> f.mbits) & ((1 << f.ebits) - 1)
    mant = (codes & ((1 << f.mbits) - 1)).double()
    normal = (1.0 + mant / (1 << f.mbits)) * torch.pow(2.0, (efield - f.bias).double())
    subnormal = mant / (1 << f.mbits) * 2.0**f.emin
    mag = torch.where(efield == 0, subnormal, normal)
    # Codes above max (E4M3's all-ones NaN, E5M2's Inf/NaN) are not produced by quantize.
    mag = torch.where(mag > f.max, torch.full_like(mag, float("nan")), mag)
    return (sign * mag).float()


def code_table(fmt: ElementFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decode table for `fmt` on `device` (cached on CPU; copied per device)."""
    t = _code_table_cpu(fmt.name)
    return t if torch.device(device).type == "cpu" else t.to(device)
