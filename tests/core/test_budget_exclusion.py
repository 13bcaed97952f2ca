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
    RendezvousStateError,
    Settings,
    decode_state,
    encode_shared_settings,
    encode_state,
    shared_settings_differences,
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


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["x"].append([*d["p"][0][:3], 9]), "is excluded until round 9 but is a member"),
        (lambda d: d["x"].append(["host7", 1, 0, 0]), "exclusion ended at round 0"),
        (lambda d: d.update(ct=5), "counted through round 4, after round 0"),
        (lambda d: d.update(ct=1, rs=0), "the restart count is 0"),
        (lambda d: d.update(rs=3, ct=1), "restart budget of 2 is spent but the rendezvous is open"),
        (lambda d: d.update(rs=9, ct=1, closed=True), "overspend the restart budget of 2"),
        (lambda d: d.update(rs=-1), "restarts must be >= 0"),
    ],
)
def test_decode_rejects_a_broken_budget_or_exclusion(mutate, message):
    s = settings(2, 3, restart_budget=2)
    doc = _doc(completed(3, s))
    mutate(doc)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(json.dumps(doc).encode(), s)


def test_nodes_with_different_budgets_are_told_so():
    ours = settings(2, 3, restart_budget=3)
    theirs = settings(2, 3, restart_budget=None, exclusion_rounds=2)
    assert shared_settings_differences(ours, encode_shared_settings(theirs)) == [
        "restart_budget: 3 on this node, None for the run",
        "exclusion_rounds: 1 on this node, 2 for the run",
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("restart_budget", -1, "restart_budget must be at least 0"),
        ("restart_budget", 1.5, "restart_budget must be an integer or None"),
        ("restart_budget", True, "restart_budget must be an integer or None"),
        ("exclusion_rounds", 0, "exclusion_rounds must be an integer >= 1"),
    ],
)
def test_settings_refuse_a_bad_budget_or_exclusion_length(field, value, message):
    with pytest.raises(ValueError, match=message):
        Settings("job", 1, 2, **{field: value})
