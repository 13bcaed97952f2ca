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
