"""One test per row of the join decision table, each asserting the exact action.

Every state here is reached through the core's own actions (core_scenarios), and the
row that decided is checked too, so a reordering of the table cannot hide behind an
action that happens to be the same.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from helpers.core_scenarios import FAR, completed, ctx, joined, node, settings, step
from helpers.core_strategies import any_observations, any_settings, any_states, nodes, times
from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.core import (
    JOIN_TABLE,
    Action,
    JoinOp,
    NodeView,
    Observations,
    RendezvousState,
    Write,
    after_read,
    decide,
    heartbeat_of,
    join_row,
    operators,
)
from rallypoint.core.operators import JOIN_FACTS, JoinRow, compile_join_table, join_source

ROWS_HIT: set[str] = set()


def decided(c, deadline: float = FAR) -> Action:
    row = join_row(c, deadline)
    ROWS_HIT.add(row.name)
    action = JoinOp()(c, deadline)
    assert action is row.action
    return action


def redundant_setup():
    """A full complete round (max=2) with node(9) standing by as redundant."""
    s = settings(1, 2)
    state = completed(2, s)
    state = step(state, node(9), Action.ADD_TO_REDUNDANCY_LIST, s)
    return s, state


def test_closed_while_redundant_exits_gracefully():
    s, state = redundant_setup()
    state = step(state, node(0), Action.MARK_RENDEZVOUS_CLOSED, s)
    assert decided(ctx(node(9), state, s)) is Action.ERROR_GRACEFUL_EXIT


def test_closed_is_an_error_for_a_joiner():
    s = settings()
    state = step(RendezvousState(), node(0), Action.MARK_RENDEZVOUS_CLOSED, s)
    assert decided(ctx(node(1), state, s)) is Action.ERROR_CLOSED


def test_redundant_in_full_round_heartbeats_when_due():
    s, state = redundant_setup()
    obs = ctx(node(9), state, s, now=0.0).observations
    later = ctx(node(9), state, s, now=s.keep_alive_interval, obs=obs)
    assert decided(later) is Action.KEEP_ALIVE


def test_redundant_in_full_round_waits():
    s, state = redundant_setup()
    assert decided(ctx(node(9), state, s)) is Action.SYNC


def test_redundant_with_room_becomes_a_joiner_and_resets_its_deadline():
    s, state = redundant_setup()
    state = step(state, node(1), Action.REMOVE_FROM_PARTICIPANTS, s)
    # Even past its join deadline: a redundant node is not subject to it.
    action = decided(ctx(node(9), state, s, now=100.0), deadline=0.0)
    assert action is Action.REMOVE_FROM_REDUNDANCY_LIST
    assert action.resets_deadline


def excluded_setup():
    """node(2) of a complete round of three (max=3) excluded itself; node(0) and
    node(1) left to regroup: round 1 is open."""
    s = settings(2, 3, exclusion_rounds=1)
    state = completed(3, s)
    state = step(state, node(2), Action.EXCLUDE, s)
    for i in (0, 1):
        state = step(state, node(i), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert state.round == 1 and not state.complete
    return s, state


def test_an_excluded_node_stands_by_as_redundant_even_past_its_deadline():
    s, state = excluded_setup()
    action = decided(ctx(node(2), state, s, now=100.0), deadline=0.0)
    assert action is Action.ADD_TO_REDUNDANCY_LIST


def test_an_excluded_spare_waits_in_a_round_with_room():
    s, state = excluded_setup()
    state = step(state, node(2), Action.ADD_TO_REDUNDANCY_LIST, s)
    assert decided(ctx(node(2), state, s)) is Action.SYNC
    obs = ctx(node(2), state, s, now=0.0).observations
    later = ctx(node(2), state, s, now=s.keep_alive_interval, obs=obs)
    assert decided(later) is Action.KEEP_ALIVE


def test_an_excluded_spare_joins_once_its_exclusion_runs_out():
    s, state = excluded_setup()
    state = step(state, node(2), Action.ADD_TO_REDUNDANCY_LIST, s)
    state = joined([node(0), node(1)], s, state)
    state = step(state, node(0), Action.MARK_RENDEZVOUS_COMPLETE, s)
    for i in (0, 1):  # round 1 ends: round 2 is open and the exclusion is over
        state = step(state, node(i), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert state.round == 2 and not state.excluded
    assert decided(ctx(node(2), state, s)) is Action.REMOVE_FROM_REDUNDANCY_LIST


def test_participant_of_complete_round_finishes():
    s = settings()
    state = completed(2, s)
    assert decided(ctx(node(1), state, s)) is Action.FINISH


def test_timed_out_participant_withdraws_within_rollback():
    s = settings()
    state = joined([node(0)], s)
    assert (
        decided(ctx(node(0), state, s, now=12.0), deadline=10.0) is Action.REMOVE_FROM_PARTICIPANTS
    )


def test_timed_out_waiter_withdraws_within_rollback():
    s = settings()
    state = step(completed(2, s), node(5), Action.ADD_TO_WAIT_LIST, s)
    assert decided(ctx(node(5), state, s, now=12.0), deadline=10.0) is Action.REMOVE_FROM_WAIT_LIST


def test_timed_out_after_rollback_is_an_error():
    s = settings()
    state = joined([node(0)], s)
    late = 10.0 + s.rollback_period + 0.1
    assert decided(ctx(node(0), state, s, now=late), deadline=10.0) is Action.ERROR_TIMEOUT


def test_timed_out_stranger_is_an_error_at_once():
    s = settings()
    assert decided(ctx(node(0), RendezvousState(), s, now=11.0), 10.0) is Action.ERROR_TIMEOUT


def test_complete_round_with_capacity_puts_a_newcomer_on_the_wait_list():
    s = settings(2, 3)
    state = completed(2, s)
    assert decided(ctx(node(5), state, s)) is Action.ADD_TO_WAIT_LIST


def test_complete_full_round_makes_a_newcomer_redundant():
    s = settings(2, 2)
    state = completed(2, s)
    assert decided(ctx(node(5), state, s)) is Action.ADD_TO_REDUNDANCY_LIST


def test_min_reached_and_last_call_passed_completes():
    s = settings(2, 3, last_call_timeout=10.0)
    state = joined([node(0), node(1)], s)
    armed = ctx(node(0), state, s, now=0.0)
    # Still within the last call: wait for more nodes.
    within = ctx(node(0), state, s, now=9.0, obs=armed.observations)
    assert decided(within) is not Action.MARK_RENDEZVOUS_COMPLETE
    passed = ctx(node(0), state, s, now=10.5, obs=armed.observations)
    assert decided(passed) is Action.MARK_RENDEZVOUS_COMPLETE


def test_last_call_is_timed_from_this_nodes_own_sighting():
    """A node that saw the last call armed late waits its full last call."""
    s = settings(2, 3, last_call_timeout=10.0)
    state = joined([node(0), node(1)], s)
    late_observer = ctx(node(1), state, s, now=1000.0)
    assert decided(late_observer) is not Action.MARK_RENDEZVOUS_COMPLETE
    later = ctx(node(1), state, s, now=1010.5, obs=late_observer.observations)
    assert decided(later) is Action.MARK_RENDEZVOUS_COMPLETE


def _regroup_after_a_leave(min_nodes: int = 3):
    """Four nodes (max 4) in a complete round; node(3) leaves for good and the
    other three leave it to rejoin: the next round opens as a regroup."""
    s = settings(min_nodes, 4, last_call_timeout=10.0)
    state = step(completed(4, s), node(3), Action.LEAVE, s)
    for i in range(3):
        state = step(state, node(i), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert not state.complete and state.round == 1 and state.regroup
    assert state.returning == {node(0), node(1), node(2)}
    return s, state


def test_a_regroup_with_every_survivor_back_completes_without_its_last_call():
    s, state = _regroup_after_a_leave()
    state = joined([node(0), node(1), node(2)], s, state)
    assert state.last_call is not None and not state.returning
    # At once: the last call would only wait for node(3), which left for good.
    assert decided(ctx(node(0), state, s, now=0.0)) is Action.MARK_RENDEZVOUS_COMPLETE
    assert join_row(ctx(node(0), state, s), FAR).name.startswith("participant, quorum, everyone")


def test_a_regroup_waits_its_last_call_while_a_survivor_is_still_returning():
    s, state = _regroup_after_a_leave(min_nodes=2)
    state = joined([node(0), node(1)], s, state)  # node(2) has not rejoined yet
    assert state.returning == {node(2)} and state.last_call is not None
    assert decided(ctx(node(0), state, s, now=0.0)) is Action.SYNC


def test_open_round_admits_a_newcomer():
    s = settings()
    assert decided(ctx(node(0), RendezvousState(), s)) is Action.ADD_TO_PARTICIPANTS


def test_open_round_admits_a_waiter():
    s = settings(1, 2)
    state = step(completed(1, s), node(5), Action.ADD_TO_WAIT_LIST, s)
    state = step(state, node(0), Action.REMOVE_FROM_PARTICIPANTS, s)  # round advances
    assert not state.complete and state.round == 1
    assert decided(ctx(node(5), state, s)) is Action.ADD_TO_PARTICIPANTS


def test_participant_below_quorum_heartbeats_when_due():
    s = settings(2, 3)
    state = joined([node(0)], s)
    first = ctx(node(0), state, s, now=0.0)
    due = ctx(node(0), state, s, now=s.keep_alive_interval, obs=first.observations)
    assert decided(due) is Action.KEEP_ALIVE


def test_participant_below_quorum_waits():
    s = settings(2, 3)
    state = joined([node(0)], s)
    assert decided(ctx(node(0), state, s)) is Action.SYNC


def test_waiter_of_a_complete_round_waits():
    s = settings(2, 3)
    state = step(completed(2, s), node(5), Action.ADD_TO_WAIT_LIST, s)
    assert decided(ctx(node(5), state, s)) is Action.SYNC


def test_max_reached_completes_at_once():
    s = settings(2, 3)
    state = joined([node(0), node(1), node(2)], s)
    assert state.complete and state.world_size == 3
    assert sorted(state.participants.values()) == [0, 1, 2]
    assert decided(ctx(node(2), state, s)) is Action.FINISH


def test_every_row_of_the_table_is_reached():
    """Replays every scenario of this module: together they decide by every row."""
    ROWS_HIT.clear()
    for name, scenario in sorted(globals().items()):
        scenario_like = (
            name.startswith("test_") and name != test_every_row_of_the_table_is_reached.__name__
        )
        if scenario_like and not inspect.signature(scenario).parameters:
            scenario()
    assert {row.name for row in JOIN_TABLE} == ROWS_HIT


def test_observations_default_to_empty_and_change_nothing_when_fresh():
    s = settings()
    state = joined([node(0)], s)
    c = ctx(node(0), state, s, obs=Observations())
    assert c.observations.heartbeats[node(0)].counter == heartbeat_of(1, 0)


# --- the table is what runs ---------------------------------------------------------


def test_editing_a_row_of_the_table_changes_what_the_driver_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """decide (what adapters, the simulator and the checker run) answers from the
    table in force: a newcomer to an open round joins it; with that row's action
    edited to stand by instead, the same decision writes a redundancy entry."""
    s = settings(2, 3)
    me = node(0)

    def first_write() -> Write:
        view = after_read(NodeView(), me, RendezvousState(), {}, 0.0)
        write = decide(view, me, s, JoinOp(), FAR, 0.0)
        assert isinstance(write, Write)
        return write

    assert first_write().action is Action.ADD_TO_PARTICIPANTS
    edited = tuple(
        dataclasses.replace(row, action=Action.ADD_TO_REDUNDANCY_LIST)
        if row.name == "round open, not a participant: join"
        else row
        for row in JOIN_TABLE
    )
    monkeypatch.setattr(operators, "JOIN_TABLE", edited)
    write = first_write()
    assert write.action is Action.ADD_TO_REDUNDANCY_LIST
    assert me in write.state.redundancy_list and me not in write.state.participants


def test_a_guard_edited_in_the_table_changes_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A participant of a complete round (with room) is done; with that row's
    guard asking for an open round instead, the next row decides: it queues for
    the next round."""
    s = settings()
    state = completed(2, s)
    assert join_row(ctx(node(1), state, s), FAR).action is Action.FINISH
    edited = tuple(
        dataclasses.replace(row, guard="not complete and participant")
        if row.action is Action.FINISH
        else row
        for row in JOIN_TABLE
    )
    monkeypatch.setattr(operators, "JOIN_TABLE", edited)
    assert JoinOp()(ctx(node(1), state, s), FAR) is Action.ADD_TO_WAIT_LIST


def _walked(table: tuple[JoinRow, ...], c, deadline: float) -> JoinRow:  # type: ignore[no-untyped-def]
    """The table as its docstring defines it: every fact evaluated, then the rows
    walked top to bottom, each guard evaluated as the Python expression it is."""
    fields = {
        "node": c.node,
        "state": c.state,
        "settings": c.settings,
        "now": c.now,
        "deadline": deadline,
        "own": c.observations.heartbeats.get(c.node),
        "last_call": c.observations.last_call,
        **vars(operators),
    }
    facts = {name: bool(eval(expression, fields)) for name, expression in JOIN_FACTS.items()}
    for row in table:
        if eval(row.guard, {}, facts):
            return row
    raise AssertionError("no row holds")


_literals = st.sampled_from(sorted(JOIN_FACTS)).flatmap(
    lambda fact: st.sampled_from([fact, f"not {fact}"])
)
_guards = st.lists(
    st.lists(_literals, min_size=1, max_size=3).map(" and ".join), min_size=1, max_size=2
).map(lambda terms: " or ".join(f"({term})" for term in terms))


@st.composite
def _tables(draw: st.DrawFn) -> tuple[JoinRow, ...]:
    """Tables of random rows over the facts, the last row always holding."""
    guards = draw(st.lists(_guards, max_size=8))
    rows = [
        JoinRow(f"row {i}", guard, draw(st.sampled_from(list(Action))))
        for i, guard in enumerate(guards)
    ]
    return (*rows, JoinRow("otherwise", "True", Action.SYNC))


@examples(300)
@given(_tables(), nodes, any_states(), any_settings(), times, any_observations(), times)
def test_a_compiled_table_answers_what_walking_it_answers(table, me, state, s, now, obs, deadline):
    """The compiler reads each fact once, lazily, and leaves out the facts whose
    outcome changes nothing: the row it picks is the one a plain walk picks,
    for the real table and for random ones."""
    c = ctx(me, state, s, now, obs)
    own, seen = c.observations.heartbeats.get(me), c.observations.last_call
    for rows in (JOIN_TABLE, table):
        decision = compile_join_table(rows)
        for limit in (deadline, float("inf"), now, now - s.rollback_period):
            expected = _walked(rows, c, limit)
            assert decision(me, state, s, now, own, seen, limit) is expected


def test_a_guard_outside_the_facts_is_refused_with_the_row_named() -> None:
    bad = (JoinRow("typo", "closed and redundnat", Action.SYNC),)
    with pytest.raises(ValueError, match="join row 'typo': 'redundnat' in its guard is not a fact"):
        compile_join_table(bad)
    with pytest.raises(ValueError, match="join row 'syntax'"):
        compile_join_table((JoinRow("syntax", "closed and", Action.SYNC),))


def test_the_compiled_source_reads_each_fact_once_per_path() -> None:
    source = join_source(JOIN_TABLE)
    compile(source, "<JOIN_TABLE>", "exec")
    assert "return _row_0" in source and "def join_decision(" in source
