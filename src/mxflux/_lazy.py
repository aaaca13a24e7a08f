"""Lazy package exports: names are imported from their submodules on first use.

Packages whose modules import torch use this so that building the CLI parser (and
`mxflux --help`) never loads torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, namespace: dict, exports: dict[str, list[str]]
                 ) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """(__all__, __getattr__, __dir__) for `package`, exporting {submodule: [names]}."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # cache: later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return sorted(module_of), __getattr__, __dir__
