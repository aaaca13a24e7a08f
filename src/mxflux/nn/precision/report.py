"""`PrecisionReport`: which linear runs in which precision, and why the others stay bf16."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

__all__ = ["PrecisionReport"]


def _layer_pattern(name: str) -> str:
    """The name with container indices as '*' ('double_blocks.3.img_mlp.0' → 'double_blocks.*.img_mlp.0').

    Only indices followed by more of the name are containers (ModuleList entries); a last
    numeric part is the layer itself (an nn.Sequential's '0' and '2') and stays.
    """
    return re.sub(r"(?<![^.])\d+\.", "*.", name)


def _summarise(names) -> str:
    counts = Counter(_layer_pattern(n) for n in names)
    return ", ".join(p if n == 1 else f"{p} ×{n}" for p, n in counts.items())


@dataclass
class PrecisionReport:
    """What `apply_precision` did to every nn.Linear of the model, by qualified module name.

    swapped: the converted linears → how each runs ('mxfp6', 'mxfp6-fused', 'fp8').
    kept_bf16: every other linear → why it stays bf16 (not included, excluded by which pattern,
    ineligible shape, or the recipe is bf16).
    """

    precision: str
    settings: str = ""
    swapped: dict[str, str] = field(default_factory=dict)
    kept_bf16: dict[str, str] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        """How many linears run as `kind` (a label of `swapped`, or 'bf16' for the kept ones)."""
        if kind == "bf16":
            return len(self.kept_bf16)
        return sum(1 for v in self.swapped.values() if v == kind)

    def format(self) -> str:
        """The report as text, one line per label and per reason; block indices folded into '*'."""
        total = len(self.swapped) + len(self.kept_bf16)
        head = f"precision {self.precision}" + (f" ({self.settings})" if self.settings else "")
        lines = [f"{head}: {len(self.swapped)} of {total} linears converted"]
        by_label = defaultdict(list)
        for name, label in self.swapped.items():
            by_label[label].append(name)
        for label, names in by_label.items():
            lines.append(f"  {label:<12} {len(names):>5}  {_summarise(names)}")
        if self.kept_bf16:
            lines.append(f"  {'bf16':<12} {len(self.kept_bf16):>5}")
            by_reason = defaultdict(list)
            for name, reason in self.kept_bf16.items():
                by_reason[reason].append(name)
            for reason, names in by_reason.items():
                lines.append(f"    {reason} ({len(names)}): {_summarise(names)}")
        return "\n".join(lines)

    __str__ = format
