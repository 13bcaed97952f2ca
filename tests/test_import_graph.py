"""No import circle in product code; the vocabulary and error modules import only each other.

The graph is read from the source with ``ast``: every ``import`` counts, those
inside functions included (a lazy import hides a circle, it does not remove it);
only imports under ``if TYPE_CHECKING:`` are left out, since they never run. An
edge goes to the module a name comes from, or to the submodule it names
(``from . import actions``), never to a package's ``__init__`` only because a
submodule sits in it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> the package it installs as
PACKAGES = {
    "core": "rallypoint.core",
    "adapters": "rallypoint.adapters",
    "agent": "rallypoint.agent",
    "spec": "rallypoint.spec",
}
#: modules that name things for the others: they import none of the package but
#: each other (an adapter's error derives from the core's)
LEAVES = (
    "rallypoint.core.errors",
    "rallypoint.adapters.errors",
    "rallypoint.agent.errors",
    "rallypoint.agent._reaper",
    "rallypoint.agent.worker.live_channel",
    "rallypoint.spec.model.lifecycle",
)

Graph = Mapping[str, frozenset[str]]


def modules(root: Path, packages: Mapping[str, str]) -> dict[str, Path]:
    """Every module of ``packages`` (folder -> package name) under ``root``."""
    found = {}
    for folder, package in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` that run, in functions too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_imports_of(child))
            continue
        yield from _runtime_imports_of(node)


def _runtime_imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _runtime_imports(node)


def _targets(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: Mapping[str, Path]
) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if not is_package:
            parts.pop()
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    submodules = {f"{base}.{alias.name}" for alias in node.names} & known.keys()
    return submodules if len(submodules) == len(node.names) else {*submodules, base}


def import_graph(root: Path, packages: Mapping[str, str]) -> Graph:
    """module -> the modules of ``packages`` it imports."""
    known = modules(root, packages)
    graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        targets: set[str] = set()
        for node in _runtime_imports(tree):
            targets |= _targets(module, path.name == "__init__.py", node, known)
        graph[module] = frozenset(t for t in targets if t in known and t != module)
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


@pytest.fixture(scope="module")
def product_graph() -> Graph:
    return import_graph(ROOT, PACKAGES)


def test_product_code_has_no_import_circle(product_graph: Graph) -> None:
    found = circles(product_graph)
    assert not found, "import circles (break each, e.g. move the shared name to a leaf):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


@pytest.mark.parametrize("leaf", LEAVES)
def test_vocabulary_and_error_modules_import_only_each_other(
    leaf: str, product_graph: Graph
) -> None:
    assert leaf in product_graph, f"{leaf} is not a module any more: update LEAVES"
    beyond = product_graph[leaf] - set(LEAVES)
    assert not beyond, f"{leaf} imports {sorted(beyond)}"


def test_a_planted_circle_is_found_also_through_a_lazy_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\n\nA = 1\n")
    (pkg / "b.py").write_text("def late():\n    from . import a\n    return a.A\n\nB = 2\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
    )
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert circles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg.c"] == frozenset()  # typing-only imports never run
    (pkg / "b.py").write_text("B = 2\n")
    assert circles(import_graph(tmp_path, {"pkg": "pkg"})) == []
