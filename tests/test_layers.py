"""The layers of moec, read from the import statements of every module of the package.

A module's layer is its first name under ``moec`` (``moec.ops.ep`` -> ``ops``, ``moec.plan`` ->
``plan``). Rules, importer -> layers it must not import:

    kernels  -> ops, passes, runtime, analysis       (the ops register the kernels)
    ops      -> passes, runtime, analysis
    analysis -> passes, runtime
    runtime  -> passes                               (it runs a lowered program)
    passes   -> runtime
    plan     -> passes, runtime, ops, kernels, analysis

and no import cycle between moec modules. Imports count wherever they are written (module level
or inside a function); those under ``if TYPE_CHECKING:`` do not. A package ``__init__`` importing
modules under it (re-exporting them) is not an edge of a cycle.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moec"

FORBIDDEN: dict[str, frozenset[str]] = {
    "kernels": frozenset({"ops", "passes", "runtime", "analysis"}),
    "ops": frozenset({"passes", "runtime", "analysis"}),
    "analysis": frozenset({"passes", "runtime"}),
    "runtime": frozenset({"passes"}),
    "passes": frozenset({"runtime"}),
    "plan": frozenset({"passes", "runtime", "ops", "kernels", "analysis"}),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str  # file:line


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def _imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Dotted names each import statement of ``path`` may refer to (``from a import b``: a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield (base if alias.name == "*" else f"{base}.{alias.name}"), node.lineno


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The moec module a dotted name lives in (its longest prefix that is a module)."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def imports() -> tuple[Import, ...]:
    found = []
    for module, path in modules().items():
        for name, line in _imported_names(path, module):
            target = _resolve(name) if name.split(".")[0] == "moec" else None
            if target is not None and target != module:
                where = f"{path.relative_to(PACKAGE.parent)}:{line}"
                found.append(Import(module, target, where))
    return tuple(dict.fromkeys(found))


def _reexport(edge: Import) -> bool:
    """A package ``__init__`` importing a module under it."""
    is_package = modules()[edge.importer].name == "__init__.py"
    return is_package and edge.imported.startswith(edge.importer + ".")


def import_cycles() -> list[set[str]]:
    """The strongly connected components of more than one module in the import graph."""
    graph: dict[str, set[str]] = {module: set() for module in modules()}
    for edge in imports():
        if not _reexport(edge):
            graph[edge.importer].add(edge.imported)

    @functools.cache
    def reachable(start: str) -> frozenset[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return frozenset(seen)

    components: list[set[str]] = []
    for module in graph:
        if any(module in c for c in components):
            continue
        component = {m for m in reachable(module) if module in reachable(m)}
        if len(component) > 1:
            components.append(component)
    return components


@pytest.mark.parametrize("importer", list(FORBIDDEN))
def test_layer_imports_none_of_the_forbidden_layers(importer: str):
    broken = [
        f"{edge.where}: {edge.importer} imports {edge.imported}"
        for edge in imports()
        if layer(edge.importer) == importer and layer(edge.imported) in FORBIDDEN[importer]
    ]
    forbidden = ", ".join(sorted(FORBIDDEN[importer]))
    assert not broken, f"{importer} must not import {forbidden}:\n" + "\n".join(broken)


@pytest.mark.parametrize("layer_name", sorted({layer(m) for m in modules()} - {None}))
def test_no_import_cycle_through_layer(layer_name: str):
    cycles = [c for c in import_cycles() if any(layer(m) == layer_name for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_scan_sees_imports_in_functions_and_relative_ones_and_skips_type_checking(tmp_path):
    """The reader itself: a function-level import, a relative one and a TYPE_CHECKING one."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..ops.ep import EPPathError\n"
        "if TYPE_CHECKING:\n"
        "    from moec.passes import manager\n"
        "def f():\n"
        "    import moec.runtime.compiled\n"
    )
    path = tmp_path / "module.py"
    path.write_text(source)
    names = [name for name, _ in _imported_names(path, "moec.kernels.module")]
    assert names == [
        "typing.TYPE_CHECKING",
        "moec.kernels.sibling",
        "moec.ops.ep.EPPathError",
        "moec.runtime.compiled",
    ]
