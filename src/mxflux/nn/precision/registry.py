"""The precision registry and `apply_precision`, which converts a model's linears with one converter.

A precision is a `PrecisionConverter` subclass registered with `@register_precision`: its
selector field in `PrecisionConfig`, the options only it reads, ONE eligibility function and a
`convert` that swaps the chosen linears in place. `apply_precision` does the part every precision
shares, choosing the linears by the recipe's include/exclude patterns and eligibility, and never
branches on the precision's name (docs/design.md, "Precisions as converters and the layer map").
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from .report import PrecisionReport

if TYPE_CHECKING:
    from .config import PrecisionConfig

__all__ = ["PrecisionConverter", "apply_precision", "converter_class", "register_precision",
           "registered_precisions", "replace_module", "selected_precision"]


class PrecisionConverter:
    """One precision: how a recipe selects it, which linears it can take, and how it converts them.

    Subclasses set the class attributes and override `ineligibility` and `convert`; an instance
    holds the recipe's `PrecisionConfig`.
    """

    name: ClassVar[str]  # 'mxfp6', 'fp8', 'bf16': cfg.precision.name, the report's and MLPerf's word
    selected_by: ClassVar[str | None]  # the PrecisionConfig field that selects it; None: the default
    selector_value: ClassVar[str | None] = None  # what `PrecisionConfig.from_name` sets that field to
    options: ClassVar[tuple[str, ...]] = ()  # PrecisionConfig fields only this precision reads

    def __init__(self, cfg: "PrecisionConfig"):
        self.cfg = cfg

    def settings(self) -> str:
        """The options as the report's header shows them, e.g. 'mx_gemm=rowwise, hadamard=True'."""
        return ", ".join(f"{o}={getattr(self.cfg, o)}" for o in self.options)

    def ineligibility(self, linear: nn.Linear) -> str | None:
        """Why this linear cannot run in this precision (its shape, say), or None if it can."""
        return None

    def convert(self, model: nn.Module, chosen: dict[str, nn.Linear]) -> dict[str, str]:
        """Swap the chosen linears (qualified name → module, all eligible) of `model` in place.

        Returns qualified name → how that linear now runs (the report's label, e.g. 'mxfp6' or
        'mxfp6-fused'). Chosen linears left out of the result stay bf16.
        """
        raise NotImplementedError


_REGISTRY: dict[str, type[PrecisionConverter]] = {}


def register_precision(cls: type[PrecisionConverter]) -> type[PrecisionConverter]:
    """Class decorator: make `cls` selectable by recipes (by its `selected_by` field)."""
    if cls.name in _REGISTRY:
        raise ValueError(f"precision {cls.name!r} is already registered (by {_REGISTRY[cls.name].__qualname__})")
    taken = {c.selected_by for c in _REGISTRY.values()}
    if cls.selected_by in taken:
        raise ValueError(f"precision {cls.name!r}: selector field {cls.selected_by!r} already selects another precision")
    _REGISTRY[cls.name] = cls
    return cls


def registered_precisions() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def converter_class(name: str) -> type[PrecisionConverter]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"precision: expected one of {sorted(_REGISTRY)}, got {name!r}") from None


def selected_precision(cfg: "PrecisionConfig") -> str:
    """The name of the precision whose selector field `cfg` sets; the default one if none is set."""
    for c in _REGISTRY.values():
        if c.selected_by is not None and getattr(cfg, c.selected_by) is not None:
            return c.name
    return next(c.name for c in _REGISTRY.values() if c.selected_by is None)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule with qualified name `name` is (same key, so same state-dict names)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def _first_match(name: str, patterns) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def apply_precision(model: nn.Module, precision: "str | PrecisionConfig") -> PrecisionReport:
    """Convert the linears of `model` that the recipe chooses to its precision, in place.

    A linear is chosen when one of `precision.include` matches its qualified name (as in
    `model.named_modules()`), none of `precision.exclude` does, and the precision's eligibility
    accepts it; every other linear stays bf16 and the returned report says why. Parameters are
    kept (the same Parameter objects), so state-dict keys and optimizer state are unchanged.
    Raises ValueError naming the pattern when an include or exclude pattern matches no nn.Linear
    (a typo there would otherwise silently run the layers in another precision).
    `precision` is a PrecisionConfig or a precision name with the default layer set.
    """
    from .config import PrecisionConfig

    cfg = precision if isinstance(precision, PrecisionConfig) else PrecisionConfig.from_name(precision)
    converter = converter_class(cfg.name)(cfg)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}
    for field, patterns in (("include", cfg.include), ("exclude", cfg.exclude)):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
                examples = ", ".join(list(linears)[:4]) or "none"
                raise ValueError(f"precision.{field}: pattern {pattern!r} matches no nn.Linear of this "
                                 f"{type(model).__name__} (its linears are named like {examples})")

    report = PrecisionReport(cfg.name, settings=converter.settings())
    chosen: dict[str, nn.Linear] = {}
    for name, linear in linears.items():
        excluded_by = _first_match(name, cfg.exclude)
        if _first_match(name, cfg.include) is None:
            report.kept_bf16[name] = "not matched by precision.include"
        elif excluded_by is not None:
            report.kept_bf16[name] = f"matched by precision.exclude {excluded_by!r}"
        elif type(linear) is not nn.Linear:
            raise ValueError(f"apply_precision: {name} is already a {type(linear).__name__}; apply a "
                             f"precision once, to a model built of nn.Linear")
        elif (why := converter.ineligibility(linear)) is not None:
            report.kept_bf16[name] = f"ineligible for {cfg.name}: {why}"
        else:
            chosen[name] = linear
    report.swapped.update(converter.convert(model, chosen))
    for name in chosen:
        if name not in report.swapped:
            report.kept_bf16[name] = f"the recipe's precision is {cfg.name}"
    return report
