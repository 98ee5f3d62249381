"""The layers of moec, read from the import statements of every module of the package.

A module's layer is its first name under ``moec`` (``moec.ops.ep`` -> ``ops``, ``moec.plan`` ->
``plan``). Rules, importer -> layers it must not import:

    kernels  -> ops, passes, runtime, analysis       (the ops register the kernels)
    ops      -> passes, runtime, analysis
    analysis -> passes, runtime
    runtime  -> passes                               (it runs a lowered program)
    passes   -> runtime
    plan     -> passes, runtime, ops, kernels, analysis

and the kernels import no moec module outside ``moec.kernels`` (what a kernel and its caller
share lives in the kernels: ``moec.kernels.adamw_update`` for the optimizer), and no import
cycle between moec modules. Imports count wherever they are written: module level, inside a
function, and under ``if TYPE_CHECKING:`` (a type-only import is a dependency too: two modules
naming each other's types are one module in two files). A package ``__init__`` importing modules
under it (re-exporting them) is not an edge of a cycle.
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


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Dotted names each import statement of ``path`` may refer to (``from a import b``: a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
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
def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` (a folder named as its top-level package) by dotted name."""
    root = package.parent
    return {module_name(path, root): path for path in sorted(package.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (its longest prefix that is a module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def imports(package: Path = PACKAGE) -> tuple[Import, ...]:
    known, found = modules(package), []
    for module, path in known.items():
        for name, line in _imported_names(path, module):
            target = _resolve(name, known) if name.split(".")[0] == package.name else None
            if target is not None and target != module:
                where = f"{path.relative_to(package.parent)}:{line}"
                found.append(Import(module, target, where))
    return tuple(dict.fromkeys(found))


def _reexport(edge: Import, known: dict[str, Path]) -> bool:
    """A package ``__init__`` importing a module under it."""
    is_package = known[edge.importer].name == "__init__.py"
    return is_package and edge.imported.startswith(edge.importer + ".")


def import_cycles(package: Path = PACKAGE) -> list[set[str]]:
    """The strongly connected components of more than one module in ``package``'s import
    graph."""
    known = modules(package)
    graph: dict[str, set[str]] = {module: set() for module in known}
    for edge in imports(package):
        if not _reexport(edge, known):
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


def test_kernels_import_only_kernels():
    """A kernel takes plain tensors and numbers: it imports nothing of moec but other kernels
    and leaf helpers that import no moec module themselves (``moec.cache``: where compiled
    artefacts and tuning choices go); the optimizer, the program or the plan would drag the
    layers above in."""
    edges = imports()
    importers = {edge.importer for edge in edges}
    broken = [
        f"{edge.where}: {edge.importer} imports {edge.imported}"
        for edge in edges
        if layer(edge.importer) == "kernels"
        and layer(edge.imported) != "kernels"
        and edge.imported in importers
    ]
    assert not broken, "kernels import only moec.kernels:\n" + "\n".join(broken)


def test_the_scan_sees_imports_in_functions_relative_ones_and_type_checking_ones(tmp_path):
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
        "moec.passes.manager",
        "moec.runtime.compiled",
    ]


def test_a_circle_through_a_type_only_import_is_a_cycle_and_a_reexport_is_not(tmp_path):
    """The shapes the issue found: ``a`` imports ``b`` for its types only, ``b`` imports ``a``
    inside a function; the package ``__init__`` re-exporting ``a`` closes no cycle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from pkg.a import A\n")
    (package / "c.py").write_text("import pkg\n")
    assert import_cycles(package) == [{"pkg.a", "pkg.b"}]
