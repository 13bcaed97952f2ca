"""Each action's effect, the other operators, observation, liveness and ranks."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from helpers.core_scenarios import FAR, completed, ctx, joined, node, settings, step
from helpers.core_strategies import (
    POOL,
    any_observations,
    any_settings,
    any_states,
    counters,
    nodes,
    times,
)
from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st
from immutables import Map

from rallypoint.core import (
    Action,
    CloseOp,
    Context,
    ExitOp,
    HeartbeatSighting,
    InvalidTransitionError,
    KeepAliveOp,
    LastCallSighting,
    NodeDesc,
    Observations,
    RendezvousState,
    Settings,
    apply,
    assign_ranks,
    dead_nodes,
    heartbeat_of,
    keep_alive_due,
    observe,
    observe_own,
    sanitize,
    wake_at,
)
from rallypoint.core.liveness import observe_read
from rallypoint.core.state import _FIELD_NAMES

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


def test_a_closed_rendezvous_expects_nobody_back():
    """Closing forgets who would return to the next round and the regroup mark: a
    closed rendezvous forms no next round. A participant leaving a closed round is
    not expected back either."""
    s = settings(1, 3)
    exited = step(completed(3, s), node(0), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert exited.returning == {node(0)} and exited.regroup
    closed = step(exited, node(1), Action.MARK_RENDEZVOUS_CLOSED, s)
    assert closed.closed and closed.returning == frozenset() and not closed.regroup
    after = step(closed, node(1), Action.REMOVE_FROM_PARTICIPANTS, s)
    assert after.returning == frozenset() and not after.regroup
    # The failure that overspends the restart budget closes it the same way.
    budget = settings(1, 3, restart_budget=0)
    exited = step(completed(3, budget), node(0), Action.REMOVE_FROM_PARTICIPANTS, budget)
    spent = step(exited, node(1), Action.CHARGE_RESTART, budget)
    assert spent.closed and spent.returning == frozenset() and not spent.regroup


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


# --- properties over states of every shape ---------------------------------------


@given(nodes, any_states(), any_settings(), times, times)
def test_exit_op_leaves_a_round_it_is_in(node, state, s, now, deadline):
    action = ExitOp()(Context(node, state, s, now), deadline)
    if node not in state.participants:
        assert action is Action.FINISH
    elif now > deadline:
        assert action is Action.ERROR_TIMEOUT
    else:
        assert action is Action.REMOVE_FROM_PARTICIPANTS


def _reference_observe(
    observations: Observations,
    state: RendezvousState,
    now: float,
    side: Map[NodeDesc, int] | None,
    watch_counters: bool,
) -> tuple[Map[NodeDesc, HeartbeatSighting], LastCallSighting | None]:
    """Sightings and last call, computed from scratch (no caches consulted)."""
    sightings = dict(observations.heartbeats.items())
    if watch_counters:
        for node, counter in state.heartbeats.items():
            value = heartbeat_of(counter, 0 if side is None else side.get(node, 0))
            seen = sightings.get(node)
            if seen is None or seen.counter != value:
                sightings[node] = HeartbeatSighting(value, now)
        sightings = {n: h for n, h in sightings.items() if n in state.heartbeats}
    last_call = observations.last_call
    if state.last_call is None:
        last_call = None
    elif last_call is None or (last_call.round, last_call.arming) != (
        state.round,
        state.last_call,
    ):
        last_call = LastCallSighting(state.round, state.last_call, now)
    return Map(sightings), last_call


def _oldest(observations: Observations) -> float | None:
    return min((h.since for h in observations.heartbeats.values()), default=None)


_reads = st.tuples(
    any_states(),
    st.none() | st.dictionaries(nodes, counters, max_size=6),
    st.booleans(),
    st.floats(0, 5),
)


@pytest.mark.slow
@examples(500)
@given(any_observations(), st.lists(_reads, min_size=1, max_size=12), st.booleans())
def test_observe_keeps_its_caches_equal_to_a_from_scratch_observe(start, reads, repeat):
    """Sightings, last call and ``oldest`` after every read of a sequence are what a
    from-scratch observation gives; reading the same counters again (the identity
    shortcut) changes nothing but the last call."""
    obs = start
    now = 0.0
    for state, side_counters, watch, elapsed in reads:
        now += elapsed
        side = None if side_counters is None else Map(side_counters)
        for _ in range(2 if repeat else 1):
            expected = _reference_observe(obs, state, now, side, watch)
            obs = observe(obs, state, now, side, counters=watch)
            assert (obs.heartbeats, obs.last_call) == expected
            assert obs.oldest == _oldest(obs)


def _later(obs: Observations, step: float) -> float:
    """A local time no earlier than any sighting (a node's clock never goes back)."""
    return max((h.since for h in obs.heartbeats.values()), default=0.0) + step


def _with_own(obs: Observations, node: NodeDesc, pair: int | None, since: float) -> Observations:
    """``obs`` with the own sighting set to (pair, since), rebuilt the slow way."""
    beats = dict(obs.heartbeats.items())
    if pair is None:
        beats.pop(node, None)
    else:
        beats[node] = HeartbeatSighting(pair, since)
    return Observations(heartbeats=Map(beats), last_call=obs.last_call)


@examples(500)
@given(any_observations(), any_states(), nodes, counters, times)
def test_observe_read_is_observe_without_counters_then_the_own_pair(
    obs, state, node, side_counter, step
):
    now = _later(obs, step)
    counter = state.heartbeats.get(node)
    pair = None if counter is None else heartbeat_of(counter, side_counter)
    expected = observe(obs, state, now, counters=False)
    before = obs.heartbeats.get(node)
    if pair is not None and before is not None and before.counter != pair:
        # moved by somebody else's write: the own lease keeps its start
        expected = _with_own(expected, node, pair, before.since)
    else:
        expected = observe_own(expected, node, pair, now)
    got = observe_read(obs, state, node, side_counter, now)
    assert got == expected
    assert got.oldest == expected.oldest == _oldest(got)
    assert (got.source, got.source_side) == (obs.source, obs.source_side)


@given(any_observations(), nodes, st.none() | counters, times)
def test_observe_own_keeps_oldest_exact(obs, node, counter, step):
    got = observe_own(obs, node, counter, _later(obs, step))
    assert got.oldest == _oldest(got)


@given(any_states(), any_observations(), any_settings(), times, nodes)
def test_sanitize_first_test_matches_dead_nodes(state, obs, s, now, observer):
    obs = observe(obs, state, now / 2)  # every member has a sighting
    sanitized, dead = sanitize(state, obs, s, now, observer)
    silent = frozenset(
        n
        for n in state.heartbeats
        if n != observer and now - obs.heartbeats[n].since > s.liveness_window
    )
    assert dead == silent
    if not dead:
        assert sanitized is state


def test_evolve_converts_checks_and_drops_the_cached_hash():
    state = RendezvousState()
    hash(state)
    new = state.evolve(participants={POOL[0]: 0}, wait_list=[POOL[1]])
    assert isinstance(new.participants, Map) and isinstance(new.wait_list, frozenset)
    assert "_hash" not in vars(new)
    assert new == RendezvousState(participants={POOL[0]: 0}, wait_list={POOL[1]})
    assert state == RendezvousState()  # the input is untouched
    with pytest.raises(TypeError, match="no field 'rounds'"):
        state.evolve(rounds=1)


def test_states_that_swap_two_nodes_values_hash_apart():
    """A map's own hash folds keys and values in apart, so two ranks (or two
    heartbeat counters) swapped between nodes gave equal hashes: the model
    checker's memos, keyed on states, then compared such states field by field
    on every lookup."""
    a, b = POOL[0], POOL[1]
    ranked = RendezvousState(complete=True, world_size=2, participants={a: 0, b: 1})
    swapped = ranked.evolve(participants={a: 1, b: 0})
    assert ranked != swapped and hash(ranked) != hash(swapped)
    beating = RendezvousState(heartbeats={a: 1, b: 2})
    assert hash(beating) != hash(beating.evolve(heartbeats={a: 2, b: 1}))
    # equal states still hash alike, however their maps were built
    assert hash(ranked) == hash(
        RendezvousState(complete=True, world_size=2, participants=[(b, 1), (a, 0)])
    )


def test_context_is_still_a_frozen_dataclass():
    s = Settings("properties", 1, 2)
    ctx = Context(POOL[0], RendezvousState(), s, 1.0)
    assert ctx.observations == Observations()
    assert ctx == Context(node=POOL[0], state=RendezvousState(), settings=s, now=1.0)
    assert hash(ctx) == hash(dataclasses.replace(ctx))
    assert dataclasses.replace(ctx, now=2.0).now == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.now = 3.0  # type: ignore[misc]


def test_liveness_window_follows_the_settings_it_belongs_to():
    s = Settings("properties", 1, 2, keep_alive_interval=2.0, keep_alive_max_attempt=3)
    assert s.liveness_window == 6.0
    assert dataclasses.replace(s, keep_alive_max_attempt=4).liveness_window == 8.0
    assert s == Settings("properties", 1, 2, keep_alive_interval=2.0, keep_alive_max_attempt=3)


def test_actions_hash_as_the_singletons_they_are():
    """Actions hash by identity (a C-level hash for the effect table's lookups):
    equal members are the same object, so tables and sets still find them."""
    assert Action.__hash__ is object.__hash__
    effects = {action: action.name for action in Action}
    for action in Action:
        assert effects[action] == action.name
        assert Action(action.value) in effects and hash(action) == hash(Action[action.name])
    terminal = {a for a in Action if a.is_terminal}
    assert terminal == {Action.FINISH} | {a for a in Action if a.name.startswith("ERROR_")}


@given(any_states(), st.booleans(), st.booleans())
def test_a_derived_state_drops_the_caches_of_the_one_it_came_from(state, hashed, listed):
    """A transition copies the field dictionary; the copy's fields change, so
    neither the cached hash nor the cached member set may come along (the copy
    skips dropping them when the original holds neither)."""
    if hashed:
        hash(state)
    if listed:
        state.members()
    new = state.evolve(round=state.round + 1, wait_list=state.wait_list | {POOL[0]})
    assert "_hash" not in vars(new) and "_members" not in vars(new)
    assert new.members() == frozenset(new.participants) | new.wait_list | new.redundancy_list
    assert hash(new) == hash(RendezvousState(**{n: getattr(new, n) for n in _FIELD_NAMES}))


@given(any_states())
def test_a_state_copied_or_rebuilt_elsewhere_is_the_same_state(state):
    """States rebuilt from their fields (copies, another process's) equal the
    original and hash alike, and carry no cache from it."""
    hash(state)
    state.members()
    for copied in (
        copy.copy(state),
        copy.deepcopy(state),
        pickle.loads(pickle.dumps(state)),
    ):
        assert copied == state and hash(copied) == hash(state)
        assert set(vars(copied)) <= set(_FIELD_NAMES) | {"_hash"}
        assert {n: getattr(copied, n) for n in _FIELD_NAMES} == {
            n: getattr(state, n) for n in _FIELD_NAMES
        }
        assert copied.evolve(phase=copied.phase + 1).phase == state.phase + 1


def test_only_leaving_the_redundancy_list_resets_the_deadline():
    resetting = {action for action in Action if action.resets_deadline}
    assert resetting == {Action.REMOVE_FROM_REDUNDANCY_LIST}


def _reference_wake_at(ctx: Context, deadline: float | None) -> float | None:
    """wake_at as its docstring defines it: the earliest future time of the
    deadline, the end of its rollback, the own keep-alive, the end of the last call,
    and the expiry of the oldest sighting (or of every watched peer's, once the
    oldest has expired)."""
    s = ctx.settings
    times = [] if deadline is None else [deadline, deadline + s.rollback_period]
    own = ctx.observations.heartbeats.get(ctx.node)
    if own is not None and ctx.node in ctx.state.heartbeats:
        times.append(own.since + s.keep_alive_interval)
    if ctx.observations.last_call is not None and ctx.state.last_call is not None:
        times.append(ctx.observations.last_call.since + s.last_call_timeout)
    oldest = ctx.observations.oldest
    if oldest is not None and oldest + s.liveness_window > ctx.now:
        times.append(oldest + s.liveness_window)
    else:
        times.extend(
            seen.since + s.liveness_window
            for peer, seen in ctx.observations.heartbeats.items()
            if peer != ctx.node and peer in ctx.state.heartbeats
        )
    return min((t for t in times if t > ctx.now), default=None)


@examples(500)
@given(nodes, any_states(), any_settings(), times, any_observations(), st.none() | times)
def test_wake_at_is_the_earliest_future_timer(node, state, s, now, obs, deadline):
    ctx = Context(node, state, s, now, obs)
    assert wake_at(ctx, deadline) == _reference_wake_at(ctx, deadline)


@examples(500)
@given(nodes, any_states(), any_settings(), times, any_observations())
def test_keep_alive_due_is_its_definition(node, state, s, now, obs):
    """A heartbeat entry, and a sighting of it at least a keep-alive interval old."""
    sighting = obs.heartbeats.get(node)
    expected = (
        node in state.heartbeats
        and sighting is not None
        and now - sighting.since >= s.keep_alive_interval
    )
    assert keep_alive_due(Context(node, state, s, now, obs)) is expected
