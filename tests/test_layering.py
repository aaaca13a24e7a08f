"""The package's layers import one way: `mx` (the references) imports nothing else of mxflux,
`kernels` imports only `mx`, and `ops` is the only layer that imports `kernels` (checked on the
source with `ast`, so lazy imports inside functions count too). And no source file cites design
notes that are not in the repository, or reads an environment variable that overrides a recipe."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mxflux"

# package → the mxflux subpackages it may import
ALLOWED = {"mx": {"mx"}, "kernels": {"mx", "kernels"}, "ops": {"mx", "kernels", "ops"}}


def mxflux_imports(path: Path, root: Path = SRC) -> set[str]:
    """The mxflux subpackages a module under `root` (src/mxflux) imports, absolute or relative,
    at any depth of the code."""
    pkg = path.relative_to(root).parts[:-1]  # e.g. ("kernels",)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "mxflux" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "mxflux":
                    found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
            else:
                base = list(pkg[: len(pkg) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
                if target:
                    found.add(target[0])
                else:  # `from .. import x` at the top of the package
                    found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layers_import_one_way(package):
    files = sorted((SRC / package).rglob("*.py"))
    assert files, f"no modules under {SRC / package}"
    bad = {str(f.relative_to(SRC)): sorted(mxflux_imports(f) - ALLOWED[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_the_import_checker_sees_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "mxflux" / "kernels"
    pkg.mkdir(parents=True)
    mod = pkg / "m.py"
    mod.write_text("from ..mx import quantize\n\ndef f():\n    from ..ops.custom_ops import mx_operands\n"
                   "    import mxflux.nn\n")
    assert mxflux_imports(mod, tmp_path / "mxflux") == {"mx", "ops", "nn"}


def _sources_mentioning(text: str) -> list[str]:
    return sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml")
                  and text in p.read_text())


def test_no_environment_variable_overrides_the_fused_mlp_recipe_field():
    assert _sources_mentioning("MXFLUX_FUSED_MLP") == []
