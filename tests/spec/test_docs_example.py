"""The example of docs/spec.md, "Simulations in your own tests", runs as written:
every ``python`` block of that section is executed as a module and each of its
``test_*`` functions (hypothesis properties) is called."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SPEC_DOC = Path(__file__).resolve().parents[2] / "docs" / "spec.md"
SECTION = "## Simulations in your own tests"


def _section_code() -> str:
    text = SPEC_DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"```python\n(.*?)```", text[start : None if end < 0 else end], re.S)
    assert blocks, f"no python block under {SECTION!r} in {SPEC_DOC}"
    return "\n".join(blocks)


def _example_tests() -> dict[str, Callable[[], Any]]:
    namespace: dict[str, Any] = {"__name__": "docs_spec_example"}
    exec(compile(_section_code(), f"{SPEC_DOC}:{SECTION}", "exec"), namespace)
    return {name: f for name, f in namespace.items() if name.startswith("test_")}


def test_the_example_has_properties_to_run() -> None:
    assert len(_example_tests()) >= 1


@pytest.mark.parametrize("name", sorted(_example_tests()))
def test_the_docs_simulation_example_passes(name: str) -> None:
    _example_tests()[name]()


def _section_text() -> str:
    text = SPEC_DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : None if end < 0 else end]


def test_the_section_documents_every_simconfig_field_with_its_default() -> None:
    from dataclasses import fields

    from rallypoint.spec import SimConfig

    rows: dict[str, str] = {}
    for line in _section_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            names = re.findall(r"`(\w+)`", cells[0])
            defaults = [d.strip() for d in cells[1].split(",")]
            assert len(defaults) == len(names), f"one default per field: {line}"
            rows.update(zip(names, defaults, strict=True))
    for field in fields(SimConfig):
        assert field.name in rows, f"SimConfig.{field.name} is not in the table of {SECTION!r}"
        if field.name in ("min_nodes", "max_nodes"):
            continue  # derived from nodes, as the table says
        default = field.default
        written = f"{default:g}" if type(default) in (int, float) else str(default)
        assert rows[field.name] == written, (field.name, rows[field.name], written)
    assert set(rows) <= {f.name for f in fields(SimConfig)}


def test_the_section_documents_every_fault_the_simulator_injects() -> None:
    """Every public method of Simulator but the byte count and the conformance
    tests' injections, which a user's own simulation does not need."""
    from rallypoint.spec import Simulator

    text = _section_text()
    public = [
        name
        for name in vars(Simulator)
        if not name.startswith("_")
        and name not in ("size", "inject_write", "inject_beat", "inject_announce")
    ]
    missing = [name for name in public if f"`{name}" not in text]
    assert not missing, f"Simulator methods not in {SECTION!r}: {missing}"
