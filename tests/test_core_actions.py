"""Each action's effect, the other operators, observation, liveness and ranks."""

from __future__ import annotations

import pytest
from core_scenarios import FAR, completed, ctx, joined, node, settings, step

from rallypoint.core import (
    Action,
    CloseOp,
    Context,
    ExitOp,
    InvalidTransitionError,
    KeepAliveOp,
    Observations,
    RendezvousState,
    apply,
    assign_ranks,
    dead_nodes,
    observe,
    sanitize,
    wake_at,
)

# --- each action ------------------------------------------------------------------


def test_add_to_participants_joins_heartbeats_and_leaves_the_wait_list():
    s = settings(1, 3)
    state = step(completed(1, s), node(5), Action.ADD_TO_WAIT_LIST, s)
    state = step(state, node(0), Action.REMOVE_FROM_PARTICIPANTS, s)
    after = step(state, node(5), Action.ADD_TO_PARTICIPANTS, s)
    assert node(5) in after.participants and node(5) not in after.wait_list
    assert after.heartbeats[node(5)] == state.heartbeats[node(5)] + 1


def test_add_to_participants_arms_the_last_call_at_min_only():
    s = settings(2, 4)
    one = joined([node(0)], s)
    assert one.last_call is None
    two = joined([node(1)], s, one)
    assert two.last_call == 1 and two.last_call_seq == 1
    three = joined([node(2)], s, two)
    assert three.last_call == 1  # not re-armed above min


def test_add_to_wait_list_and_redundancy_list():
    s = settings(2, 2)
    full = completed(2, s)
    redundant = step(full, node(7), Action.ADD_TO_REDUNDANCY_LIST, s)
    assert redundant.redundancy_list == {node(7)}
    assert redundant.heartbeats[node(7)] == full.heartbeat_seq + 1 == redundant.heartbeat_seq
    waiting = step(redundant, node(7), Action.ADD_TO_WAIT_LIST, s)
    assert waiting.wait_list == {node(7)} and not waiting.redundancy_list
    assert waiting.heartbeats[node(7)] == redundant.heartbeats[node(7)] + 1


def test_a_rejoining_node_never_repeats_a_heartbeat_counter():
    """An observer that missed a leave and rejoin must still see the counter move."""
    s = settings(1, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    first = joined([node(0)], s)
    stale = observe(Observations(), first, 0.0)  # then this observer is cut off
    left = step(first, node(0), Action.REMOVE_FROM_PARTICIPANTS, s)
    back = joined([node(0)], s, left)
    assert back.heartbeats[node(0)] != first.heartbeats[node(0)]
    fresh = observe(stale, back, 100.0)
    assert not dead_nodes(back, fresh, s, 100.5)


def test_remove_from_wait_and_redundancy_lists_drop_the_heartbeat():
    s = settings(2, 2)
    full = completed(2, s)
    waiting = step(full, node(7), Action.ADD_TO_WAIT_LIST, s)
    gone = step(waiting, node(7), Action.REMOVE_FROM_WAIT_LIST, s)
    assert node(7) not in gone.wait_list and node(7) not in gone.heartbeats
    redundant = step(full, node(8), Action.ADD_TO_REDUNDANCY_LIST, s)
    gone = step(redundant, node(8), Action.REMOVE_FROM_REDUNDANCY_LIST, s)
    assert node(8) not in gone.redundancy_list and node(8) not in gone.heartbeats


def test_remove_last_participant_of_complete_round_advances_the_round():
    s = settings(2, 2)
    state = completed(2, s)
    one_left = step(state, node(0), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert one_left.complete and one_left.world_size == 2 and one_left.round == 0
    none_left = step(one_left, node(1), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert not none_left.complete and none_left.round == 1 and none_left.world_size == 0


def test_remove_participant_below_min_disarms_the_last_call():
    s = settings(2, 3)
    state = joined([node(0), node(1)], s)
    assert state.last_call == 1
    after = step(state, node(1), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert after.last_call is None and after.last_call_seq == 1
    rearmed = joined([node(2)], s, after)
    assert rearmed.last_call == 2  # a new arming: observers restart their timers


def test_mark_complete_assigns_ranks_in_node_order():
    s = settings(2, 4)
    state = joined([node(3), node(1), node(2)], s)
    done = step(state, node(1), Action.MARK_RENDEZVOUS_COMPLETE, s)
    assert dict(done.participants) == {node(1): 0, node(2): 1, node(3): 2}
    assert done.complete and done.world_size == 3 and done.last_call is None


def test_mark_closed_and_keep_alive():
    s = settings()
    state = joined([node(0)], s)
    beat = step(state, node(0), Action.KEEP_ALIVE, s)
    assert beat.heartbeats[node(0)] == state.heartbeats[node(0)] + 1
    closed = step(beat, node(0), Action.MARK_RENDEZVOUS_CLOSED, s)
    assert closed.closed


@pytest.mark.parametrize(
    "action",
    [Action.SYNC, Action.FINISH, Action.ERROR_CLOSED, Action.ERROR_TIMEOUT],
)
def test_non_mutating_actions_cannot_be_applied(action: Action):
    s = settings()
    with pytest.raises(InvalidTransitionError, match="does not change"):
        step(RendezvousState(), node(0), action, s)


@pytest.mark.parametrize(
    "action",
    [
        Action.REMOVE_FROM_PARTICIPANTS,
        Action.REMOVE_FROM_WAIT_LIST,
        Action.REMOVE_FROM_REDUNDANCY_LIST,
        Action.KEEP_ALIVE,
        Action.MARK_RENDEZVOUS_COMPLETE,
    ],
)
def test_actions_that_do_not_fit_the_state_are_protocol_errors(action: Action):
    s = settings()
    with pytest.raises(InvalidTransitionError, match=str(node(0))):
        step(RendezvousState(), node(0), action, s)


def test_cannot_join_a_complete_round():
    s = settings(1, 2)
    with pytest.raises(InvalidTransitionError, match="complete"):
        step(completed(1, s), node(5), Action.ADD_TO_PARTICIPANTS, s)


# --- the other operators ----------------------------------------------------------


def test_exit_op():
    s = settings()
    state = joined([node(0)], s)
    assert ExitOp()(ctx(node(0), state, s), FAR) is Action.REMOVE_FROM_PARTICIPANTS
    assert ExitOp()(ctx(node(0), state, s, now=2.0), 1.0) is Action.ERROR_TIMEOUT
    assert ExitOp()(ctx(node(1), state, s), FAR) is Action.FINISH


def test_close_op():
    s = settings()
    state = RendezvousState()
    assert CloseOp()(ctx(node(0), state, s), FAR) is Action.MARK_RENDEZVOUS_CLOSED
    assert CloseOp()(ctx(node(0), state, s, now=2.0), 1.0) is Action.ERROR_TIMEOUT
    closed = step(state, node(0), Action.MARK_RENDEZVOUS_CLOSED, s)
    assert CloseOp()(ctx(node(0), closed, s), FAR) is Action.FINISH


def test_keep_alive_op():
    s = settings(keep_alive_interval=1.0)
    state = joined([node(0)], s)
    first = ctx(node(0), state, s, now=0.0)
    assert KeepAliveOp()(first, FAR) is Action.FINISH  # just beat by joining
    due = ctx(node(0), state, s, now=1.0, obs=first.observations)
    assert KeepAliveOp()(due, FAR) is Action.KEEP_ALIVE
    assert KeepAliveOp()(due, 0.5) is Action.ERROR_TIMEOUT
    assert KeepAliveOp()(ctx(node(9), state, s), FAR) is Action.FINISH  # not a member


# --- observation and liveness -----------------------------------------------------


def test_observe_times_counter_changes_and_forgets_departed_nodes():
    s = settings()
    state = joined([node(0), node(1)], s)
    obs = observe(Observations(), state, 5.0)
    assert obs.heartbeats[node(1)].since == 5.0
    assert observe(obs, state, 9.0) is obs  # nothing moved: same object
    beat = step(state, node(1), Action.KEEP_ALIVE, s)
    moved = observe(obs, beat, 9.0)
    assert moved.heartbeats[node(1)].since == 9.0 and moved.heartbeats[node(0)].since == 5.0
    left = step(beat, node(1), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert node(1) not in observe(moved, left, 10.0).heartbeats


def test_sanitize_removes_silent_nodes_after_the_liveness_window_of_own_clock():
    s = settings(1, 3, keep_alive_interval=1.0, keep_alive_max_attempt=3)
    state = completed(2, s)
    obs = observe(Observations(), state, 100.0)
    same, dead = sanitize(state, obs, s, 103.0)  # exactly the window: still alive
    assert not dead and same is state
    after, dead = sanitize(state, obs, s, 103.01)
    assert dead == {node(0), node(1)}
    # Both participants of a complete round gone: the epilogue advances the round.
    assert not after.participants and after.round == 1 and not after.complete


def test_sanitize_epilogue_disarms_last_call_below_min():
    s = settings(2, 3, keep_alive_interval=1.0, keep_alive_max_attempt=1)
    state = joined([node(0), node(1)], s)
    obs = observe(Observations(), state, 0.0)
    beat = step(state, node(0), Action.KEEP_ALIVE, s)
    obs = observe(obs, beat, 1.0)  # node(0) moved at t=1, node(1) silent since t=0
    after, dead = sanitize(beat, obs, s, 1.5)
    assert dead == {node(1)} and after.last_call is None and node(0) in after.participants


def test_clock_offset_does_not_matter_only_durations():
    """Two observers whose clocks differ by an hour agree on who is alive."""
    s = settings(1, 3, keep_alive_interval=1.0, keep_alive_max_attempt=2)
    state = completed(2, s)
    for offset in (0.0, 3600.0, -3600.0):
        obs = observe(Observations(), state, offset + 10.0)
        assert not dead_nodes(state, obs, s, offset + 11.9)
        assert dead_nodes(state, obs, s, offset + 12.1) == {node(0), node(1)}


def test_wake_at_names_the_next_local_timer():
    s = settings(2, 3, last_call_timeout=10.0, keep_alive_interval=1.0, keep_alive_max_attempt=3)
    state = joined([node(0), node(1)], s)
    c = ctx(node(0), state, s, now=0.0)
    assert wake_at(c, 50.0) == 1.0  # own heartbeat first
    later = Context(node(0), state, s, 2.0, c.observations)
    assert wake_at(later, 50.0) == 3.0  # node(1) would be declared dead at 3.0
    assert wake_at(Context(node(0), state, s, 52.0, c.observations), 50.0) == 55.0  # rollback
    assert wake_at(Context(node(0), state, s, 99.0, c.observations), 50.0) is None


# --- ranks ------------------------------------------------------------------------


def test_assign_ranks_default_is_node_order():
    assert assign_ranks([node(2), node(0), node(1)]) == {node(0): 0, node(1): 1, node(2): 2}


def test_assign_ranks_stable_keeps_survivors_and_fills_gaps():
    previous = {node(0): 0, node(1): 1, node(2): 2, node(3): 3}
    # node(1) is gone; node(3)'s old rank 3 is out of range for 3 nodes; node(9) is new.
    ranks = assign_ranks([node(0), node(2), node(3), node(9)], previous)
    assert ranks == {node(0): 0, node(2): 2, node(3): 3, node(9): 1}
    ranks = assign_ranks([node(0), node(2), node(3)], previous)
    assert ranks[node(0)] == 0 and ranks[node(2)] == 2 and ranks[node(3)] == 1


def test_stable_ranks_survive_a_regroup():
    s = settings(2, 3, stable_ranks=True)
    first = completed(3, s)
    assert dict(first.last_ranks) == dict(first.participants)
    # node(0) (rank 0) leaves for good; the others re-join with a newcomer.
    state = first
    for i in range(3):
        state = step(state, node(i), Action.REMOVE_FROM_PARTICIPANTS, s)
    state = joined([node(1), node(2), node(5)], s, state)
    assert state.complete
    assert state.participants[node(1)] == 1 and state.participants[node(2)] == 2
    assert state.participants[node(5)] == 0
    plain = settings(2, 3)
    again = joined([node(1), node(2), node(5)], plain, RendezvousState(round=1))
    assert dict(again.participants) == {node(1): 0, node(2): 1, node(5): 2}


def test_apply_on_context_uses_context_node_and_settings():
    s = settings(1, 1)
    c = Context(node(4), RendezvousState(), s, 0.0)
    state = apply(RendezvousState(), Action.ADD_TO_PARTICIPANTS, c)
    assert state.complete and dict(state.participants) == {node(4): 0}
