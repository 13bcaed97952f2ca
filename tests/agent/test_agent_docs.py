"""docs/agent.md says what the code does: its flags table names every flag of
``rallypoint run``; its wrapper for data-order state carries a generator over."""

from __future__ import annotations

import argparse
import io
import re
import textwrap
from pathlib import Path

import torch

from rallypoint.agent.launcher import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "agent.md"


def _table_rows() -> str:
    text = DOCS.read_text()
    section = text.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_flags_table_names_every_flag_of_rallypoint_run() -> None:
    # A flag is named in a cell as `--flag ...`; either of its spellings will do.
    named = set(re.findall(r"`(-[-\w]+)", _table_rows())) | set(
        re.findall(r"`[^`]*?(?:, |/)(-[-\w]+)", _table_rows())
    )
    missing = []
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        if not named & set(action.option_strings):
            missing.append(action.option_strings[0])
    assert missing == [], f"docs/agent.md's flags table does not name {missing}"


def test_the_generator_wrapper_carries_the_data_order_through_a_state_copy() -> None:
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
        if "class GeneratorState" in b
    ]  # fmt: skip
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(block).split("\njob = ")[0], namespace)
    wrapper = namespace["GeneratorState"]
    source = torch.Generator().manual_seed(7)
    torch.randperm(10, generator=source)  # some of the epoch's order is used
    # A regroup sends the state as live regroup does: saved, loaded with weights only.
    buffer = io.BytesIO()
    torch.save(wrapper(source).state_dict(), buffer)  # type: ignore[operator]
    buffer.seek(0)
    copy = torch.Generator()
    wrapper(copy).load_state_dict(torch.load(buffer, weights_only=True))  # type: ignore[operator]
    assert torch.equal(torch.randperm(10, generator=copy), torch.randperm(10, generator=source))
