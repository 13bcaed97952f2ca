"""The core stays pure: no IO, threads, clocks, randomness or pickle (DESIGN.md)."""

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
