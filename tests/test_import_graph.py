"""No import circle in product code; the vocabulary and error modules import only each other;
the code that runs in a worker's process imports none of the supervisor's.

The graph is read from the source with ``ast``: every ``import`` counts, those
inside functions included (a lazy import hides a circle, it does not remove it);
only imports under ``if TYPE_CHECKING:`` are left out, since they never run. An
edge goes to the module a name comes from, or to the submodule it names
(``from . import actions``), never to a package's ``__init__`` only because a
submodule sits in it.

The worker side (``rallypoint.agent.worker``: what a worker's process imports) and
the supervisor (the rest of ``rallypoint.agent``) meet only where the supervisor
starts a worker or speaks to one: :func:`side_crossings` is the rule, applied to
the product's graph and to a planted one.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping
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

#: the package whose modules run in a worker's process; the rest of its parent
#: package is the supervisor (the agent, the launcher)
WORKER_SIDE = "rallypoint.agent.worker"
#: what the worker side may import of the supervisor's package: the error leaf,
#: for ``record`` (``worker/function.py`` decorates the user's function with it, the
#: worker's end of the error file); a leaf, so it brings nothing else along
WORKER_MAY_IMPORT = frozenset({"rallypoint.agent.errors"})
#: supervisor module -> the worker-side modules it may import, and why: each starts
#: a worker or speaks to a running one, and needs the contract both ends share
STARTERS: Mapping[str, frozenset[str]] = {
    # the live channel's format (variables, status file, assignment line) it
    # speaks to live workers and the warm spares it starts
    "rallypoint.agent.handover": frozenset({"rallypoint.agent.worker.live_channel"}),
    # starts the health check's process: its instructions' variable, stage names
    "rallypoint.agent.health": frozenset({"rallypoint.agent.worker.health"}),
    # starts elastic_launch's function workers: the function's and arguments' variables
    "rallypoint.agent.api": frozenset({"rallypoint.agent.worker.function"}),
    # each worker's environment: where a function worker writes its return value
    "rallypoint.agent.worker_specs": frozenset({"rallypoint.agent.worker.function"}),
}
#: deprecated old paths (CHANGELOG.md) -> the module each forwards to by name
#: (core/deprecation.py's moved_module); nothing of the repository imports them
#: but tests/core/test_deprecation.py
ALIASES = {
    f"rallypoint.agent.{name}": f"{WORKER_SIDE}.{name}"
    for name in ("live", "live_state", "live_snapshots", "live_reshard", "live_channel")
}

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


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def side_crossings(
    graph: Graph,
    worker: str,
    *,
    worker_may_import: Collection[str],
    starters: Mapping[str, Collection[str]],
) -> list[str]:
    """Each import in ``graph`` across the line between the worker side (the package
    ``worker`` and its modules) and the supervisor (the rest of ``worker``'s parent
    package, its ``__init__`` included): a worker-side module that imports a
    supervisor module other than ``worker_may_import``, or a supervisor module that
    imports a worker-side module ``starters`` does not allow it."""
    supervisor = worker.rpartition(".")[0]
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if _within(module, worker):
                if (
                    _within(target, supervisor)
                    and not _within(target, worker)
                    and target not in worker_may_import
                ):
                    found.append(f"{module} (worker side) imports {target} (supervisor)")
            elif _within(target, worker) and target not in starters.get(module, ()):
                found.append(
                    f"{module} imports {target} (worker side) but is not a module that "
                    "starts workers with it (STARTERS)"
                )
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


def test_the_worker_side_and_the_supervisor_meet_only_where_a_worker_is_started(
    product_graph: Graph,
) -> None:
    assert any(_within(m, WORKER_SIDE) for m in product_graph), f"no {WORKER_SIDE}: update"
    found = side_crossings(
        product_graph, WORKER_SIDE, worker_may_import=WORKER_MAY_IMPORT, starters=STARTERS
    )
    why = (
        "the worker side imports nothing of the supervisor but the error leaf, and the "
        "supervisor imports the worker side only where it starts a worker (STARTERS):\n"
    )
    assert not found, why + "\n".join(found)


def test_every_allowance_across_the_line_is_used_and_the_worker_side_needs_only_leaves(
    product_graph: Graph,
) -> None:
    assert WORKER_MAY_IMPORT.issubset(LEAVES), "the worker side may import only leaves"
    unused = [
        f"{module} -> {target}"
        for module, targets in STARTERS.items()
        for target in sorted(targets)
        if target not in product_graph.get(module, frozenset())
    ]
    assert not unused, f"STARTERS allows imports nothing makes (remove them): {unused}"


@pytest.mark.parametrize(("alias", "target"), sorted(ALIASES.items()))
def test_an_old_path_is_a_bare_alias_that_nothing_imports(
    alias: str, target: str, product_graph: Graph
) -> None:
    assert target in product_graph, f"{target} is not a module: update ALIASES"
    assert product_graph[alias] == {"rallypoint.core.deprecation"}, product_graph[alias]
    importers = sorted(m for m, targets in product_graph.items() if alias in targets)
    assert not importers, f"{importers} import the deprecated {alias}: use {target}"


def _absolute_imports(path: Path) -> Iterator[str]:
    """The modules a file outside the packages imports absolutely, ``from a import b``
    counted as ``a.b`` too (``b`` may be a submodule)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_tests_benches_and_examples_use_the_new_paths() -> None:
    exempt = {ROOT / "tests" / "core" / "test_deprecation.py"}  # it checks the aliases
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in ("tests", "bench", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path not in exempt
        for name in _absolute_imports(path)
        if name in ALIASES
    ]
    assert not found, "imports of deprecated paths:\n" + "\n".join(found)


def test_a_planted_crossing_is_found_either_way(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    (agent / "worker").mkdir(parents=True)
    (agent / "__init__.py").write_text("from .config import Config\nfrom .errors import record\n")
    (agent / "errors.py").write_text("def record(f):\n    return f\n")
    (agent / "config.py").write_text("Config = dict\n")
    (agent / "launcher.py").write_text("from .worker.live import Job\n")  # not a starter
    (agent / "spawn.py").write_text("from .worker import warm\n")  # a starter
    (agent / "worker" / "__init__.py").write_text("")
    (agent / "worker" / "warm.py").write_text("from . import live\nfrom ..errors import record\n")
    (agent / "worker" / "live.py").write_text(
        "def late():\n    from ..config import Config\n    return Config\n\nJob = 1\n"
    )
    (agent / "worker" / "fn.py").write_text("from .. import record\n")  # the package's init
    graph = import_graph(tmp_path, {"agent": "pkg.agent"})
    rule = {
        "worker_may_import": {"pkg.agent.errors"},
        "starters": {"pkg.agent.spawn": {"pkg.agent.worker.warm"}},
    }
    assert side_crossings(graph, "pkg.agent.worker", **rule) == [
        "pkg.agent.launcher imports pkg.agent.worker.live (worker side) but is not a module "
        "that starts workers with it (STARTERS)",
        "pkg.agent.worker.fn (worker side) imports pkg.agent (supervisor)",
        "pkg.agent.worker.live (worker side) imports pkg.agent.config (supervisor)",
    ]
    (agent / "launcher.py").write_text("from .spawn import warm\n")
    (agent / "worker" / "live.py").write_text("Job = 1\n")
    (agent / "worker" / "fn.py").write_text("from ..errors import record\n")
    assert (
        side_crossings(import_graph(tmp_path, {"agent": "pkg.agent"}), "pkg.agent.worker", **rule)
        == []
    )
