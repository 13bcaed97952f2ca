"""Bugs planted in the core for the model checker's tests, and their shared checks."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import RendezvousState, Settings, actions, driver, operators
from rallypoint.core.actions import Action
from rallypoint.spec.check import CheckResult


def replace_row(monkeypatch: pytest.MonkeyPatch, action: Action, guard: str) -> None:
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
        "not complete and participant and quorum",
    )


def phase_without_the_last_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase that leaves out the last call: the write that arms it wakes nobody
    (a missed wake-up)."""
    parts = tuple(part for part in driver.PHASE_PARTS if part != "state.last_call")
    assert len(parts) == len(driver.PHASE_PARTS) - 1
    monkeypatch.setattr(driver, "PHASE_PARTS", parts)


def assert_same_space(first: CheckResult, second: CheckResult) -> None:
    """Two searches explored the same space: states, transitions, depth, edges."""
    assert (first.states, first.transitions, first.depth) == (
        second.states,
        second.transitions,
        second.depth,
    )
    assert first.lifecycle_edges == second.lifecycle_edges


def keep_the_waiters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round completes with its waiting nodes still waiting (the rule before
    waiters a round formed without stood by): a node that never joins makes every
    round regroup for it again, a restart storm."""
    real = actions._mark_complete

    def complete(state: RendezvousState, settings: Settings) -> RendezvousState:
        done = real(state, settings)
        if not state.wait_list:
            return done
        return done.evolve(
            wait_list=state.wait_list,
            redundancy_list=done.redundancy_list - state.wait_list,
        )

    monkeypatch.setattr(actions, "_mark_complete", complete)


def wait_out_every_last_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A regroup waits out its last call even when everyone expected is back
    (the rule before: only max_nodes completed a round at once)."""
    rows = tuple(row for row in operators.JOIN_TABLE if "everyone expected back" not in row.name)
    assert len(rows) == len(operators.JOIN_TABLE) - 1
    monkeypatch.setattr(operators, "JOIN_TABLE", rows)
