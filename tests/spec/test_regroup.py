"""Regroups: a waiter a round formed without stands by (no restart storm), and a
regroup waits no last call for nodes known gone. The core's rules, and the checker
and simulator finding each rule planted the old way (the codec's refusal of a
waiter beside a full round: tests/core/test_codec.py)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.checker_plants import keep_the_waiters, wait_out_every_last_call
from helpers.core_scenarios import completed, ctx, joined, node, settings, step

from rallypoint.core import (
    Action,
    LeaveOp,
    Observations,
    RendezvousState,
    observe,
    sanitize,
)
from rallypoint.core.driver import phase_of
from rallypoint.core.operators import everyone_back
from rallypoint.spec.check import CheckConfig, Checker, Global, Op, check
from rallypoint.spec.simulator import simulate
from rallypoint.spec.simulator.config import SimConfig

#: Three nodes, one round of room above the minimum: a node waits beside a
#: complete round, and regroups open with some of the last round returning.
SMALL = CheckConfig(nodes=3, min_nodes=2, max_nodes=3, max_crashes=0, allow_close=False)
#: Four nodes for rounds of at most three: the fourth waits, rounds fill up.
CROWDED = SimConfig(nodes=4, min_nodes=2, max_nodes=3, seed=1, duration=120.0, crash_rate=0.05)


def _round_with_a_waiter() -> tuple[object, RendezvousState]:
    """Round 0 complete with node(0), node(1) (max 3); node(5) waits; both leave
    it to rejoin: round 1 opens with node(5) still waiting."""
    s = settings(2, 3)
    state = step(completed(2, s), node(5), Action.ADD_TO_WAIT_LIST, s)
    state = step(state, node(0), Action.REMOVE_FROM_PARTICIPANTS, s)
    state = step(state, node(1), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert not state.complete and state.round == 1 and node(5) in state.wait_list
    return s, state


# -- a waiter the round formed without ---------------------------------------------


def test_a_waiter_left_out_of_a_round_stands_by_and_nobody_regroups_for_it():
    s, state = _round_with_a_waiter()
    state = joined([node(0), node(1)], s, state)
    state = step(state, node(0), Action.MARK_RENDEZVOUS_COMPLETE, s)  # its last call passed
    assert state.complete and not state.wait_list
    assert node(5) in state.redundancy_list and node(5) in state.heartbeats
    # It asks again once it acts: it joins the wait list, one regroup for it.
    assert step(state, node(5), Action.REMOVE_FROM_REDUNDANCY_LIST, s).wait_list == frozenset()


def test_a_round_filled_beside_a_waiter_moves_it_to_the_redundancy_list():
    s, state = _round_with_a_waiter()
    state = joined([node(0), node(1), node(2)], s, state)  # node(2) fills it
    assert state.complete and len(state.participants) == s.max_nodes
    assert not state.wait_list and node(5) in state.redundancy_list


# -- a regroup waits for nobody known gone -----------------------------------------


def _regroup(min_nodes: int = 3) -> tuple[object, RendezvousState]:
    """Four nodes (max 4) complete a round; all four leave it to rejoin."""
    s = settings(min_nodes, 4)
    state = completed(4, s)
    for i in range(4):
        state = step(state, node(i), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert state.regroup and state.returning == {node(i) for i in range(4)}
    return s, state


def test_a_node_that_leaves_for_good_is_not_expected_back():
    s = settings(3, 4)
    state = completed(4, s)
    assert LeaveOp()(ctx(node(3), state, s), 1e9) is Action.LEAVE
    state = step(state, node(3), Action.LEAVE, s)
    for i in range(3):
        state = step(state, node(i), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert state.returning == {node(0), node(1), node(2)}
    assert LeaveOp()(ctx(node(3), state, s), 1e9) is Action.FINISH  # nothing left to do
    state = joined([node(0), node(1)], s, state)
    assert not everyone_back(state)
    state = joined([node(2)], s, state)
    assert everyone_back(state)


def test_a_returning_node_declared_dead_is_not_waited_for():
    s, state = _regroup()
    # node(3) rejoins the wait list... and falls silent there.
    state = joined([node(0), node(1), node(2)], s, state)
    assert not everyone_back(state) and state.returning == {node(3)}
    waiting = state.evolve(
        wait_list={node(3)},
        heartbeats=state.heartbeats.set(node(3), state.heartbeat_seq + 1),
        heartbeat_seq=state.heartbeat_seq + 1,
    )
    seen = observe(Observations(), waiting, 0.0)
    later = s.liveness_window + 1.0
    for i in (1, 2):  # its peers beat on
        waiting = step(waiting, node(i), Action.KEEP_ALIVE, s)
    seen = observe(seen, waiting, later)
    sanitized, dead = sanitize(waiting, seen, s, later + s.liveness_window / 2, node(0))
    assert dead == {node(3)} and not sanitized.returning and everyone_back(sanitized)
    assert phase_of(sanitized, s) != phase_of(waiting, s)  # the participants wake for it


def test_a_newcomer_a_waiter_or_a_spare_keeps_the_last_call():
    s, state = _regroup(min_nodes=2)
    back = joined([node(0), node(1), node(2), node(3)], s, state)
    assert back.complete  # max_nodes: at once, as always
    three = joined([node(0), node(1), node(2)], s, state)
    assert not everyone_back(three)  # node(3) is still returning
    leaving = step(three, node(3), Action.EXCLUDE, s)
    assert everyone_back(leaving)  # excluded: it sits the round out
    newcomer = joined([node(0), node(1), node(9)], s, state)
    assert not newcomer.regroup and not everyone_back(newcomer)
    first = joined([node(0), node(1)], s)
    assert not first.regroup and not everyone_back(first)  # the first round


# -- the checker and the simulator ---------------------------------------------------


@pytest.mark.slow
def test_the_checker_explores_leaving_for_good_without_violation():
    leaving = 0

    def note(g: Global, _: int) -> None:
        nonlocal leaving
        leaving += any(loc.op is Op.LEAVE for loc in g.locals)

    result = Checker(dataclasses.replace(SMALL, leaves=True)).run(on_state=note)
    assert result.complete and result.violation is None, result.summary()
    # Leaving for good makes states of its own: nodes running a LeaveOp (which
    # the search without leaves never starts), and the model's leave edges.
    assert leaving > 0
    assert "leave" in {trigger for _, trigger, _ in result.lifecycle_edges}


def test_a_planted_restart_storm_is_found_by_the_checker_and_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
):
    clean = simulate(CROWDED)
    assert clean.ok, clean.format()
    keep_the_waiters(monkeypatch)
    result = check(SMALL)
    assert result.violation is not None, result.summary()
    text = result.violation.format()
    assert "still waiting" in text or "wait beside full complete round" in text, text
    report = simulate(CROWDED)
    found = [p for v in report.violations for p in v.problems]
    assert any("wait beside full complete round" in p or "still waiting" in p for p in found)


@pytest.mark.slow
def test_a_regroup_that_waits_out_its_last_call_is_found_by_the_checker(
    monkeypatch: pytest.MonkeyPatch,
):
    wait_out_every_last_call(monkeypatch)
    result = check(SMALL)
    assert result.violation is not None, result.summary()
    assert any("needless wait" in p for p in result.violation.problems), result.violation.format()
