"""The package's layers import one way, checked on the source with `ast` (lazy imports inside
functions count too; imports under `if TYPE_CHECKING:` do not, they never run):

    mx <- kernels <- ops <- nn <- model, data <- train <- bench <- cli (the command line, on top)

Each package imports only packages below it (`LAYER`), `ops` is the only layer below `train` that
imports `kernels` (the backend choice and the reference switch live there), and no module of
mxflux imports another that imports it back, directly or around a longer loop. And no source file
cites design notes that are not in the repository, or reads an environment variable that overrides
a recipe."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mxflux"

# Each package's layer: it may import packages of lower layers only (and itself). The leaves
# (`_lazy`, `argtypes`: lazy attribute loading, argparse types; `switches`: the MXFLUX_* kernel switches;
# `recipes`: YAML files) import nothing of mxflux and may be imported from anywhere, as may the package
# root's own names (`__version__`); `cli` is the command line on top.
LAYER = {"_lazy": 0, "argtypes": 0, "recipes": 0, "switches": 0, "mx": 1, "kernels": 2, "ops": 3, "nn": 4, "model": 5,
         "data": 5, "train": 6, "optim": 7, "bench": 7, "cli": 8}
# Below `train`, only `ops` reaches the kernels.
KERNEL_IMPORTERS = {"kernels", "ops"}


def _package(path: Path, root: Path = SRC) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _runtime_nodes(tree):
    """Every node of the module except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def mxflux_imports(path: Path, root: Path = SRC) -> set[str]:
    """The mxflux subpackages a module under `root` (src/mxflux) imports, absolute or relative,
    at any depth of the code."""
    pkg = path.relative_to(root).parts[:-1]  # e.g. ("kernels",)
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
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


def test_every_module_belongs_to_a_layer():
    unknown = sorted({_package(f) for f in SRC.rglob("*.py")} - set(LAYER) - {"__init__", "__main__"})
    assert not unknown, f"give these a layer in LAYER: {unknown}"


@pytest.mark.parametrize("package", sorted(LAYER, key=LAYER.get))
def test_layers_import_one_way(package):
    files = sorted((SRC / package).rglob("*.py")) if (SRC / package).is_dir() else [SRC / f"{package}.py"]
    assert files and all(f.is_file() for f in files), f"no modules for {package}"
    bad = {}
    for f in files:
        ups = sorted(p for p in mxflux_imports(f) - {package} if p in LAYER
                     if LAYER[p] >= LAYER[package] or (p == "kernels" and LAYER[package] < LAYER["train"]
                                                                and package not in KERNEL_IMPORTERS))
        if ups:
            bad[str(f.relative_to(SRC))] = ups
    assert not bad, f"{package} (layer {LAYER[package]}) imports upward or around ops: {bad}"


def _module_imports(path: Path, modules: set[str], root: Path = SRC) -> set[str]:
    """The mxflux modules (dotted, below mxflux) that `path` imports at run time."""
    rel = path.relative_to(root).with_suffix("")
    here = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("mxflux.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("mxflux"):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            targets = [base + [a.name] for a in node.names] + [base]
        for t in targets:
            while t and ".".join(t) not in modules:
                t = t[:-1]
            if t:
                found.add(".".join(t))
    return found


def test_no_module_imports_itself_back():
    files = {".".join(f.relative_to(SRC).with_suffix("").parts): f for f in SRC.rglob("*.py")}
    graph = {m: _module_imports(f, set(files)) - {m} for m, f in files.items()}
    # a package's __init__ re-exporting its modules is not a loop back into it
    for m in graph:
        graph[m] = {d for d in graph[m] if not (d.endswith("__init__") and m.startswith(d[:-len("__init__")]))}
    graph = {m.removesuffix(".__init__"): {d.removesuffix(".__init__") for d in ds} for m, ds in graph.items()}
    for m in graph:  # a module importing its own package's __init__ (the package) is not a loop either
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


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


def test_the_trainer_stays_small():
    n = len((SRC / "train" / "trainer.py").read_text().splitlines())
    assert n <= 350, f"train/trainer.py is {n} lines: move a concern into a module of its own"
