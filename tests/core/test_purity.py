"""The core stays pure: no IO, threads, clocks, randomness or pickle (docs/design.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rallypoint.core

CORE = Path(rallypoint.core.__file__).parent
FORBIDDEN_TEXT = re.compile(r"pickle|time\.time|time\.monotonic|datetime\.(utc)?now|sleep")
FORBIDDEN_MODULES = {
    "asyncio",
    "datetime",
    "logging",
    "os",
    "pickle",
    "random",
    "secrets",
    "select",
    "signal",
    "socket",
    "subprocess",
    "sys",
    "threading",
    "time",
    "torch",
    "uuid",
}


def core_sources() -> list[Path]:
    sources = sorted(CORE.glob("*.py"))
    assert sources, f"no core sources under {CORE}"
    return sources


def test_core_text_has_no_forbidden_words():
    hits = [
        f"{path.name}:{number}: {line.strip()}"
        for path in core_sources()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN_TEXT.search(line)
    ]
    assert hits == []


def test_core_imports_nothing_that_does_io_or_reads_clocks():
    imported: dict[str, str] = {}
    for path in core_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                imported[name.split(".")[0]] = path.name
    assert not FORBIDDEN_MODULES & imported.keys(), {
        name: imported[name] for name in FORBIDDEN_MODULES & imported.keys()
    }


# -- decisions are made in core, and reached from outside only through the driver --

#: The core's decision functions and the data they decide on. Outside core/ they are
#: reached only through rallypoint.core.driver (docs/design.md: "a decision written
#: outside core/ is a decision nobody verified").
DECISION_NAMES = frozenset(
    {
        "apply",
        "observe",
        "sanitize",
        "dead_nodes",
        "assign_ranks",
        "join_row",
        "wake_at",
        "keep_alive_due",
        "last_call_passed",
        "merge_heartbeats",
        "split_heartbeats",
        "remove_participant_epilogue",
        "Context",
        "JOIN_TABLE",
    }
)
#: Core modules whose module object would hand out decision functions.
DECISION_MODULES = frozenset({"actions", "liveness", "operators"})
OPERATORS = frozenset({"JoinOp", "ExitOp", "CloseOp", "KeepAliveOp"})
#: The product's packages outside core (bench/ measures single core decisions on
#: purpose, and tests test them one by one).
PRODUCT = CORE.parent
OUTSIDE_CORE = ("adapters", "agent", "spec")


def product_sources_outside_core() -> list[Path]:
    sources = [p for d in OUTSIDE_CORE for p in sorted((PRODUCT / d).rglob("*.py"))]
    sources += sorted(PRODUCT.glob("*.py"))
    assert len(sources) > 10, f"found only {sources} under {PRODUCT}"
    return sources


def _package_of(path: Path) -> str:
    """The package a product module's relative imports start from."""
    return ".".join(["rallypoint", *path.relative_to(PRODUCT).parent.parts])


def _imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module ``node`` imports from (``from ..core import x``
    in rallypoint.adapters.c10d: rallypoint.core)."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _decision_calls(tree: ast.AST, package: str) -> list[str]:
    """How the module of ``tree`` (in ``package``) reaches a core decision other
    than through the driver."""
    hits: list[str] = []
    module_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _imported_from(node, package)
            for alias in node.names:
                if module == "rallypoint" and alias.name == "core":
                    module_aliases.add(alias.asname or alias.name)
                if not module.startswith("rallypoint.core"):
                    continue
                if alias.name in DECISION_NAMES:
                    hits.append(f"imports {alias.name} from {module}")
                if alias.name in DECISION_MODULES:
                    hits.append(f"imports the module rallypoint.core.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["rallypoint", "core"] and set(parts[2:]) & DECISION_MODULES:
                    hits.append(f"imports the module {alias.name}")
                if alias.name == "rallypoint.core":
                    module_aliases.add(alias.asname or "rallypoint")
    for node in ast.walk(tree):
        # rallypoint.core.sanitize(...) or core.apply(...) through a module alias
        if isinstance(node, ast.Attribute) and node.attr in DECISION_NAMES:
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in module_aliases:
                hits.append(f"uses {ast.unparse(node)}")
        # JoinOp()(ctx, deadline): asking an operator directly instead of the driver
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Call)
            and isinstance(node.func.func, ast.Name)
            and node.func.func.id in OPERATORS
        ):
            hits.append(f"calls an operator directly: {ast.unparse(node)}")
    return hits


def test_no_module_outside_core_decides_except_through_the_driver():
    hits = [
        f"{path.relative_to(PRODUCT)}: {hit}"
        for path in product_sources_outside_core()
        for hit in _decision_calls(ast.parse(path.read_text()), _package_of(path))
    ]
    assert hits == []


def test_the_decision_scan_finds_each_way_around_the_driver():
    """The scan above is only worth something if it can fail."""
    bad = """
from rallypoint.core import sanitize, Context
from rallypoint.core.liveness import observe
from rallypoint.core import operators as ops
import rallypoint.core.actions
import rallypoint.core as rc
rc.apply(state, action, ctx)
JoinOp()(ctx, deadline)
"""
    hits = _decision_calls(ast.parse(bad), "rallypoint.adapters")
    assert any("sanitize" in h for h in hits)
    assert any("Context" in h for h in hits)
    assert any("observe" in h for h in hits)
    assert any("rallypoint.core.operators" in h for h in hits)
    assert any("rallypoint.core.actions" in h for h in hits)
    assert any("rc.apply" in h for h in hits)
    assert any("operator directly" in h for h in hits)
    good = """
from rallypoint.core import driver, JoinOp, NodeView
from rallypoint.core.actions import Action
driver.decide(view, node, settings, JoinOp(), deadline, now)
"""
    assert _decision_calls(ast.parse(good), "rallypoint.adapters") == []
    # The same through relative imports, as the product writes them.
    relative = """
from ...core import sanitize
from ..core.liveness import observe
from ... import core as rc
rc.apply(state, action, ctx)
"""
    hits = _decision_calls(ast.parse(relative), "rallypoint.adapters.c10d")
    assert any("sanitize from rallypoint.core" in h for h in hits)
    assert not any("observe" in h for h in hits)  # that is rallypoint.adapters.core.liveness
    assert any("rc.apply" in h for h in hits)
    hits = _decision_calls(ast.parse("from ..core.liveness import observe"), "rallypoint.agent")
    assert hits == ["imports observe from rallypoint.core.liveness"]
    assert _decision_calls(ast.parse("from .core import sanitize"), "rallypoint.agent") == []
