"""`apply_precision`: convert the linears a recipe's precision block chooses, with its converter."""

from __future__ import annotations

import fnmatch

from torch import nn

from .config import PrecisionConfig
from .report import PrecisionReport

__all__ = ["apply_precision"]


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
    cfg = precision if isinstance(precision, PrecisionConfig) else PrecisionConfig.from_name(precision)
    converter = cfg.converter()
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
