"""The precision registry: each precision's converter class, found by name (`apply` uses it).

A precision is a `PrecisionConverter` subclass registered with `@register_precision`: its
selector field in `PrecisionConfig`, the options only it reads, ONE eligibility function and a
`convert` that swaps the chosen linears in place. `apply_precision` does the part every precision
shares (`mxflux.nn.precision.apply`), choosing the linears by the recipe's include/exclude
patterns and eligibility, and never branches on the precision's name (docs/design.md, "Precisions as converters and the layer map").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import nn

if TYPE_CHECKING:
    from .config import PrecisionConfig

__all__ = ["PrecisionConverter", "converter_class", "register_precision", "registered_precisions", "replace_module",
           "selected_precision"]


class PrecisionConverter:
    """One precision: how a recipe selects it, which linears it can take, and how it converts them.

    Subclasses set the class attributes and override `ineligibility` and `convert`; an instance
    holds the recipe's `PrecisionConfig`.
    """

    name: ClassVar[str]  # 'mxfp6', 'fp8', 'bf16': cfg.precision.name, the report's and MLPerf's word
    selected_by: ClassVar[str | None]  # the PrecisionConfig field that selects it; None: the default
    selector_value: ClassVar[str | None] = None  # what `PrecisionConfig.from_name` sets that field to
    options: ClassVar[tuple[str, ...]] = ()  # PrecisionConfig fields only this precision reads
    # Options that choose how the values are computed or kept, not the values (bit-identical, as
    # the tests check): a run resumed with another setting of one is the same run.
    same_values: ClassVar[tuple[str, ...]] = ()

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

    def optimizer_state_off(self, model: nn.Module) -> str | None:
        """Why this precision keeps nothing between optimizer steps for `model` (as the option or fact
        to change), or None when `optimizer_state` has something for a step that writes it."""
        return f"precision {self.name}: nothing kept between optimizer steps"

    def optimizer_state(self, model: nn.Module, *, min_elements: int = 1):
        """What this precision keeps between optimizer steps for `model`'s converted layers, for an
        optimizer step that writes it (its `weight_state`); None: nothing."""
        return None


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
