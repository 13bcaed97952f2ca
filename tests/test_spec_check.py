"""The model checker: it explores without violation, and finds planted bugs."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import (
    Decision,
    NodeDesc,
    Read,
    RendezvousState,
    Wait,
    Write,
    actions,
    driver,
    operators,
)
from rallypoint.core.actions import Action
from rallypoint.spec.check import (
    CheckConfig,
    Checker,
    CheckerConfigError,
    Global,
    check,
    describe,
)
from rallypoint.spec.cli import spec_main
from rallypoint.spec.invariants import check_removal_published

#: Three nodes, every round, no crashes or close: the full space in seconds.
SMALL = CheckConfig(nodes=3, max_crashes=0, allow_close=False)


def test_two_nodes_full_state_space_has_no_violation() -> None:
    result = check(CheckConfig(nodes=2, min_nodes=1, max_nodes=2))
    assert result.ok, result.summary()
    assert result.complete and result.states > 100 and result.depth > 5
    # The search drove nodes through most of the model's edges.
    triggers = {t for _, t, _ in result.lifecycle_edges}
    assert {"add_to_participants", "finish", "declared_dead", "crash", "closed"} <= triggers


def test_three_nodes_every_round_full_state_space_has_no_violation() -> None:
    result = check(SMALL)
    assert result.ok, result.summary()
    assert result.complete and result.states > 1000 and result.depth > 8


def test_the_search_is_reproducible() -> None:
    config = dataclasses.replace(SMALL, max_states=800)
    a, b = check(config), check(config)
    assert (a.states, a.transitions, a.depth) == (b.states, b.transitions, b.depth)


def test_the_round_abstraction_covers_every_concrete_round() -> None:
    """Every state of a search with concrete round numbers (rounds 0..2), once
    renumbered, is a state the abstract search stored: the abstraction loses no
    behaviour of the real core there."""
    base = CheckConfig(nodes=2, min_nodes=1, max_nodes=2, stable_ranks=True)
    abstract = Checker(base)
    stored: set[int] = set()
    assert abstract.run(on_state=lambda g, fp: stored.add(fp)).complete

    concrete = Checker(dataclasses.replace(base, max_round=1))
    rounds: set[int] = set()
    missing: list[Global] = []

    def covered(g: Global, _: int) -> None:
        rounds.add(g.shared.round)
        _, fingerprint = abstract.fingerprint(abstract._normalize(g))
        if fingerprint not in stored:
            missing.append(g)

    assert concrete.run(on_state=covered).ok
    assert rounds == {0, 1, 2}
    assert not missing, describe(missing[0])


def _keep_previous_ranks_blindly(
    participants: object, previous: dict[object, int] | None = None
) -> dict[object, int]:
    """A stable-ranks bug: keeps a previous rank even where a newcomer took it."""
    ordered = sorted(participants)  # type: ignore[call-overload]
    return {node: (previous or {}).get(node, i) for i, node in enumerate(ordered)}


def test_a_bug_of_later_rounds_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug needs a second round to show: round 0 alone misses it, the round
    abstraction finds it, and the trace shows the concrete round numbers."""
    monkeypatch.setattr(actions, "assign_ranks", _keep_previous_ranks_blindly)
    config = dataclasses.replace(SMALL, stable_ranks=True)
    first_round = check(dataclasses.replace(config, max_round=0))
    assert first_round.ok and first_round.complete
    result = check(config)
    assert result.violation is not None
    assert any("complete round 1 has ranks" in p for p in result.violation.problems)
    assert "round=1" in result.violation.format()


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


# -- the checker runs the driver ----------------------------------------------------


def _without_publishing(real: object) -> object:
    """A driver bug: a node that finds peers dead but whose operator would only wait
    or return does so, without publishing their removal (each peer would wait out
    the liveness window on its own)."""

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        decision: Decision = real(view, node, settings, op, deadline, now)  # type: ignore[operator]
        instruction = decision.instruction
        if isinstance(instruction, Write) and instruction.action is None:
            action = decision.action
            if action is Action.SYNC:
                return decision._replace(instruction=Wait(None))
            if action is not None and action.is_terminal:
                done = driver._done(node, op, action, decision.state)
                return decision._replace(instruction=done)
        return decision

    return decide


def test_a_driver_that_does_not_publish_a_removal_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(driver, "decide", _without_publishing(driver.decide))
    result = check(SMALL)
    assert result.violation is not None
    (problem,) = result.violation.problems
    assert "did not publish their removal" in problem
    text = result.violation.format()
    assert "0. initial" in text and "silent too long" in text and "declares dead" in text
    assert "(wait)" in text or "(done" in text
    assert "VIOLATES" in text


def test_a_driver_that_rereads_a_fresh_view_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker's view is read at the instant of the step: a Read then would be
    answered with the same view, and asked for again, forever."""
    real = driver.decide

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        decision = real(view, node, settings, op, deadline, now)
        if isinstance(decision.instruction, Wait):
            return decision._replace(instruction=Read(True))
        return decision

    monkeypatch.setattr(driver, "decide", decide)
    result = check(SMALL)
    assert result.violation is not None
    assert any("re-read a fresh view" in p for p in result.violation.problems)


def test_the_removal_property_reads_the_timers_not_only_the_driver() -> None:
    a, b, c = (NodeDesc(f"n{i}", 100, 0) for i in range(3))
    before = RendezvousState().evolve(
        participants={a: 0, b: 0, c: 0}, heartbeats={a: 1, b: 1, c: 1}, heartbeat_seq=1
    )
    removed = before.evolve(participants={a: 0, c: 0}, heartbeats={a: 1, c: 1})
    assert check_removal_published(a, before, {b}, {b}, removed) == []
    # b silent, but the driver declared nothing and wrote nothing
    problems = check_removal_published(a, before, {b}, set(), before)
    assert any("did not declare them dead" in p for p in problems)
    assert any("did not publish their removal" in p for p in problems)
    # c's heartbeat moved: declaring it dead is a false death
    problems = check_removal_published(a, before, {b}, {b, c}, removed)
    assert any("whose heartbeats it saw move" in p for p in problems)
    # the node found itself dead and joined again as a new entry in the same write
    again = before.evolve(participants={a: 0, b: 0, c: 0}, heartbeats={a: 2, b: 1, c: 1})
    assert check_removal_published(a, before, {a}, {a}, again) == []
    assert check_removal_published(a, before, {a}, {a}, before) != []


def test_the_checker_decides_through_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step asks rallypoint.core.driver.decide, looked up at call time."""
    real, calls = driver.decide, []

    def decide(*args: object) -> Decision:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(driver, "decide", decide)
    result = check(dataclasses.replace(SMALL, max_states=200))
    assert result.ok and calls
    view = calls[0][0]
    assert not view.stale and view.counters_fresh and view.counters_at == 0.0  # type: ignore[attr-defined]
