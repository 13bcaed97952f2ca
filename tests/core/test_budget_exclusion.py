"""The job-wide restart budget and self-exclusion, decided in core: their effects,
their operators, and their wire form."""

from __future__ import annotations

import json

import pytest
from helpers.core_scenarios import FAR, completed, ctx, joined, node, settings, step

from rallypoint.core import (
    Action,
    ChargeRestartOp,
    ExcludeOp,
    InvalidTransitionError,
    decode_state,
    encode_state,
)


def charge(state, n, s):
    """What a node whose workers failed in ``state``'s round does: run the operator
    until it finishes."""
    op = ChargeRestartOp(state.round)
    while (action := op(ctx(n, state, s), FAR)) is Action.CHARGE_RESTART:
        state = step(state, n, action, s)
    assert action is Action.FINISH
    return state


def regroup(state, s):
    """Every participant leaves the complete round: the next round opens."""
    for n in sorted(state.participants):
        state = step(state, n, Action.REMOVE_FROM_PARTICIPANTS, s)
    return state


def test_failures_of_several_nodes_in_one_round_cost_one_restart():
    s = settings(2, 3, restart_budget=5)
    state = completed(3, s)
    for i in range(3):
        state = charge(state, node(i), s)
    assert (state.restarts, state.charged_through, state.closed) == (1, 1, False)
    with pytest.raises(InvalidTransitionError, match="already counted"):
        step(state, node(0), Action.CHARGE_RESTART, s)


def test_a_failure_reported_after_its_round_ended_is_free():
    s = settings(2, 3, restart_budget=5)
    state = regroup(completed(3, s), s)
    assert ChargeRestartOp(0)(ctx(node(0), state, s), FAR) is Action.FINISH


def test_the_failure_after_the_budget_is_spent_closes_the_rendezvous():
    s = settings(2, 2, restart_budget=2)
    state = completed(2, s)
    for round_, who in enumerate((node(0), node(1))):  # two nodes spend the budget
        state = charge(state, who, s)
        assert (state.restarts, state.closed) == (round_ + 1, False)
        state = regroup(state, s)
        state = joined([node(0), node(1)], s, state)
    state = charge(state, node(0), s)
    assert (state.restarts, state.closed) == (3, True)
    assert decode_state(encode_state(state), s) == state


def test_without_a_budget_failures_are_counted_but_never_close():
    s = settings(1, 1)
    state = completed(1, s)
    for _ in range(4):
        state = charge(state, node(0), s)
        state = joined([node(0)], s, regroup(state, s))
    assert (state.restarts, state.closed) == (4, False)


def test_a_node_excluded_from_a_complete_round_sits_out_the_next_rounds():
    s = settings(2, 3, exclusion_rounds=2)
    state = completed(3, s)
    state = step(state, node(1), Action.EXCLUDE, s)
    assert node(1) not in state.participants and node(1) not in state.heartbeats
    assert dict(state.excluded) == {node(1): 3}  # out of rounds 1 and 2
    assert ExcludeOp()(ctx(node(1), state, s), FAR) is Action.FINISH
    state = regroup(state, s)
    assert state.round == 1 and dict(state.excluded) == {node(1): 3}
    state = regroup(
        step(joined([node(0), node(2)], s, state), node(0), Action.MARK_RENDEZVOUS_COMPLETE, s), s
    )
    assert state.round == 2 and state.excluded
    state = regroup(
        step(joined([node(0), node(2)], s, state), node(0), Action.MARK_RENDEZVOUS_COMPLETE, s), s
    )
    assert state.round == 3 and not state.excluded


def test_the_last_participant_excluding_itself_advances_the_round():
    s = settings(1, 1)
    state = step(completed(1, s), node(0), Action.EXCLUDE, s)
    assert (state.round, state.complete, dict(state.excluded)) == (1, False, {node(0): 2})


def test_an_excluded_spare_leaves_the_redundancy_list_when_excluded_again():
    s = settings(2, 2)
    state = step(completed(2, s), node(5), Action.ADD_TO_REDUNDANCY_LIST, s)
    state = step(state, node(5), Action.EXCLUDE, s)
    assert node(5) not in state.redundancy_list and node(5) not in state.heartbeats


def _doc(state):
    return json.loads(encode_state(state))


def test_the_wire_form_carries_the_budget_and_the_exclusions():
    s = settings(2, 3, restart_budget=3)
    state = step(charge(completed(3, s), node(0), s), node(2), Action.EXCLUDE, s)
    doc = _doc(state)
    assert (doc["rs"], doc["ct"], doc["x"]) == (1, 1, [["host2", 102, 0, 2]])
    assert decode_state(encode_state(state), s) == state
