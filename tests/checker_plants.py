"""Bugs planted in the core for the model checker's tests, and their shared checks."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import RendezvousState, driver, operators
from rallypoint.core.actions import Action
from rallypoint.spec.check import CheckResult


def replace_row(monkeypatch: pytest.MonkeyPatch, action: Action, guard: object) -> None:
    """The join table with the guard of ``action``'s row replaced."""
    rows = tuple(
        dataclasses.replace(row, guard=guard) if row.action is action else row
        for row in operators.JOIN_TABLE
    )
    monkeypatch.setattr(operators, "JOIN_TABLE", rows)


def skip_the_last_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round completes at quorum without waiting out the last call: invariants
    still hold, only the model's guard (conformance) catches it."""
    replace_row(
        monkeypatch,
        Action.MARK_RENDEZVOUS_COMPLETE,
        lambda c, d: not c.state.complete and c.is_participant and operators._quorum(c),
    )


def phase_without_the_last_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase that leaves out the last call: the write that arms it wakes nobody
    (a missed wake-up)."""
    real = driver.phase_of

    def phase(state: RendezvousState, settings: object) -> tuple[object, ...]:
        full = real(state, settings)  # type: ignore[arg-type]
        return full[:3] + full[4:]

    monkeypatch.setattr(driver, "phase_of", phase)


def assert_same_space(first: CheckResult, second: CheckResult) -> None:
    """Two searches explored the same space: states, transitions, depth, edges."""
    assert (first.states, first.transitions, first.depth) == (
        second.states,
        second.transitions,
        second.depth,
    )
    assert first.lifecycle_edges == second.lifecycle_edges
