"""The model checker: it explores without violation, and finds planted bugs."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import actions, operators
from rallypoint.core.actions import Action
from rallypoint.spec.check import CheckConfig, CheckerConfigError, check
from rallypoint.spec.cli import spec_main

SMALL = CheckConfig(nodes=3, max_crashes=0, max_round=0, allow_close=False, max_states=2500)


def test_two_nodes_full_state_space_has_no_violation() -> None:
    result = check(CheckConfig(nodes=2, min_nodes=1, max_nodes=2, max_round=0))
    assert result.ok, result.summary()
    assert result.complete and result.states > 100 and result.depth > 5
    # The search drove nodes through most of the model's edges.
    triggers = {t for _, t, _ in result.lifecycle_edges}
    assert {"add_to_participants", "finish", "declared_dead", "crash", "closed"} <= triggers


def test_three_nodes_bounded_has_no_violation() -> None:
    result = check(SMALL)
    assert result.ok, result.summary()
    assert result.states >= 2500 and not result.complete


def test_the_search_is_reproducible() -> None:
    config = dataclasses.replace(SMALL, max_states=800)
    a, b = check(config), check(config)
    assert (a.states, a.transitions, a.depth) == (b.states, b.transitions, b.depth)


def _replace_row(monkeypatch: pytest.MonkeyPatch, action: Action, guard: object) -> None:
    rows = tuple(
        dataclasses.replace(row, guard=guard) if row.action is action else row
        for row in operators.JOIN_TABLE
    )
    monkeypatch.setattr(operators, "JOIN_TABLE", rows)


def test_mutation_duplicate_ranks_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        actions, "assign_ranks", lambda parts, prev=None: dict.fromkeys(sorted(parts), 0)
    )
    result = check(SMALL)
    assert result.violation is not None
    assert any("duplicate ranks" in p for p in result.violation.problems)
    text = result.violation.format()
    assert "0. initial" in text and "ADD_TO_PARTICIPANTS" in text and "VIOLATES" in text


def test_mutation_complete_below_min_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    _replace_row(
        monkeypatch,
        Action.MARK_RENDEZVOUS_COMPLETE,
        lambda c, d: not c.state.complete and c.is_participant,
    )
    effects = dict(actions._EFFECTS)
    effects[Action.MARK_RENDEZVOUS_COMPLETE] = lambda st, node, s: actions._mark_complete(st, s)
    monkeypatch.setattr(actions, "_EFFECTS", effects)
    result = check(SMALL)
    assert result.violation is not None
    assert any("world size 1, outside [2, 3]" in p for p in result.violation.problems)


def test_mutation_skipping_the_last_call_breaks_conformance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Invariants still hold; only the model's guard catches the early completion."""
    _replace_row(
        monkeypatch,
        Action.MARK_RENDEZVOUS_COMPLETE,
        lambda c, d: not c.state.complete and c.is_participant and operators._quorum(c),
    )
    result = check(SMALL)
    assert result.violation is not None
    (problem,) = result.violation.problems
    assert "conformance" in problem and "mark_rendezvous_complete" in problem


def test_config_errors_name_the_field() -> None:
    with pytest.raises(CheckerConfigError, match="nodes"):
        CheckConfig(nodes=0)
    with pytest.raises(CheckerConfigError, match="max_nodes"):
        CheckConfig(min_nodes=3, max_nodes=2)


def test_cli_check_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    args = "check --nodes 2 --min 1 --max 2 --max-round 0 --no-close --max-crashes 0"
    status = spec_main(args.split())
    out = capsys.readouterr().out
    assert status == 0
    for figure in ("states explored", "transitions", "depth", "seconds", "no violation"):
        assert figure in out
