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


def _decision_calls(tree: ast.AST) -> list[str]:
    hits: list[str] = []
    module_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rallypoint.core"):
            for alias in node.names:
                if alias.name in DECISION_NAMES:
                    hits.append(f"imports {alias.name} from {node.module}")
                if alias.name in DECISION_MODULES:
                    hits.append(f"imports the module rallypoint.core.{alias.name}")
                if node.module == "rallypoint" and alias.name == "core":
                    module_aliases.add(alias.asname or alias.name)
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
        for hit in _decision_calls(ast.parse(path.read_text()))
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
    hits = _decision_calls(ast.parse(bad))
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
    assert _decision_calls(ast.parse(good)) == []
