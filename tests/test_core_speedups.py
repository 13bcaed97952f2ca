"""The core's fast paths decide exactly what their plain definitions decide.

Each fast path (the join operator's hand-ordered rows, the incremental ``oldest``,
``observe_read``, one-copy effects, views built without ``_replace``) is compared
with a plain reference over random inputs: the table walk, a from-scratch
observation, the composition it stands for, the effect written field by field.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from immutables import Map

from rallypoint.core import (
    Action,
    Context,
    Decision,
    Done,
    ExitOp,
    HeartbeatSighting,
    InvalidTransitionError,
    JoinOp,
    LastCallSighting,
    Membership,
    NodeDesc,
    NodeView,
    Observations,
    Read,
    RendezvousState,
    Settings,
    Write,
    after_beat,
    after_read,
    after_wait,
    after_write,
    apply,
    assign_ranks,
    decide,
    driver,
    heartbeat_of,
    join_row,
    keep_alive_due,
    observe,
    observe_own,
    sanitize,
    wake_at,
)
from rallypoint.core import operators as core_operators
from rallypoint.core.driver import _VIEW_SLOTS
from rallypoint.core.liveness import observe_read
from rallypoint.core.state import _FIELD_NAMES

POOL = [NodeDesc(addr, pid, 0) for addr in ("a", "b") for pid in (1, 2, 3)]
nodes = st.sampled_from(POOL)
node_sets = st.frozensets(nodes)
counters = st.integers(0, 6)
times = st.sampled_from([0.0, 0.5, 1.0, 4.0, 5.0, 5.5, 15.0, 30.0, 100.0])


@st.composite
def any_settings(draw: st.DrawFn) -> Settings:
    high = draw(st.integers(1, 5))
    return Settings(
        "speedups",
        draw(st.integers(1, high)),
        high,
        last_call_timeout=draw(st.sampled_from([0.5, 1.0, 30.0])),
        keep_alive_interval=draw(st.sampled_from([1.0, 5.0])),
        keep_alive_max_attempt=draw(st.integers(1, 3)),
        rollback_period=draw(st.sampled_from([0.0, 5.0])),
        stable_ranks=draw(st.booleans()),
        restart_budget=draw(st.none() | st.integers(0, 2)),
        exclusion_rounds=draw(st.integers(1, 2)),
    )


@st.composite
def any_states(draw: st.DrawFn) -> RendezvousState:
    """States of every shape, valid or not: a decision must agree on all of them."""
    participants = draw(st.dictionaries(nodes, st.integers(0, 4), max_size=5))
    heartbeats = draw(st.dictionaries(nodes, counters, max_size=6))
    last_call = draw(st.none() | st.integers(1, 3))
    return RendezvousState(
        round=draw(st.integers(0, 2)),
        complete=draw(st.booleans()),
        closed=draw(st.booleans()),
        world_size=draw(st.integers(0, 5)),
        participants=participants,
        wait_list=draw(node_sets),
        redundancy_list=draw(node_sets),
        heartbeats=heartbeats,
        last_call=last_call,
        last_call_seq=(last_call or 0) + draw(st.integers(0, 2)),
        last_ranks=draw(st.dictionaries(nodes, st.integers(-1, 5), max_size=4)),
        heartbeat_seq=max(heartbeats.values(), default=0) + draw(st.integers(0, 2)),
        restarts=draw(st.integers(0, 3)),
        charged_through=draw(st.integers(0, 3)),
        excluded=draw(st.dictionaries(nodes, st.integers(0, 4), max_size=3)),
    )


@st.composite
def any_observations(draw: st.DrawFn) -> Observations:
    sightings = draw(
        st.dictionaries(nodes, st.builds(HeartbeatSighting, counters, times), max_size=6)
    )
    last_call = draw(
        st.none() | st.builds(LastCallSighting, st.integers(0, 2), st.integers(1, 3), times)
    )
    return Observations(heartbeats=sightings, last_call=last_call)


# -- the join operator ---------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=1500)
@given(nodes, any_states(), any_settings(), times, any_observations(), times)
def test_join_op_answers_what_the_table_answers(node, state, s, now, obs, deadline):
    ctx = Context(node, state, s, now, obs)
    for limit in (deadline, float("inf"), now, now - s.rollback_period):
        assert JoinOp()(ctx, limit) is join_row(ctx, limit).action


@given(nodes, any_states(), any_settings(), times, times)
def test_exit_op_leaves_a_round_it_is_in(node, state, s, now, deadline):
    action = ExitOp()(Context(node, state, s, now), deadline)
    if node not in state.participants:
        assert action is Action.FINISH
    elif now > deadline:
        assert action is Action.ERROR_TIMEOUT
    else:
        assert action is Action.REMOVE_FROM_PARTICIPANTS


def test_join_op_walks_a_table_swapped_in(monkeypatch: pytest.MonkeyPatch) -> None:
    always = core_operators.JoinRow("always wait", lambda c, d: True, Action.SYNC)
    monkeypatch.setattr(core_operators, "JOIN_TABLE", (always,))
    s = Settings("speedups", 1, 2)
    assert JoinOp()(Context(POOL[0], RendezvousState(), s, 0.0), 1.0) is Action.SYNC


# -- observations --------------------------------------------------------------------


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
@settings(max_examples=500)
@given(any_observations(), st.lists(_reads, min_size=1, max_size=12), st.booleans())
def test_observe_keeps_its_caches_equal_to_a_from_scratch_observe(start, reads, repeat):
    """Sightings, last call and ``oldest`` after every read of a sequence are what a
    from-scratch observation gives; reading the same counters again (the identity
    shortcut) changes nothing but the last call."""
    obs = start
    now = 0.0
    for state, side_counters, watch, step in reads:
        now += step
        side = None if side_counters is None else Map(side_counters)
        for _ in range(2 if repeat else 1):
            expected = _reference_observe(obs, state, now, side, watch)
            obs = observe(obs, state, now, side, counters=watch)
            assert (obs.heartbeats, obs.last_call) == expected
            assert obs.oldest == _oldest(obs)


def _later(obs: Observations, step: float) -> float:
    """A local time no earlier than any sighting (a node's clock never goes back)."""
    return max((h.since for h in obs.heartbeats.values()), default=0.0) + step


@settings(max_examples=500)
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


# -- effects -------------------------------------------------------------------------


def _reference_keep_alive(state: RendezvousState, node: NodeDesc) -> RendezvousState:
    current = state.heartbeats.get(node)
    counter = state.heartbeat_seq + 1 if current is None else current + 1
    return state.evolve(
        heartbeats=state.heartbeats.set(node, counter),
        heartbeat_seq=max(state.heartbeat_seq, counter),
    )


def _reference_epilogue(state: RendezvousState, s: Settings) -> RendezvousState:
    if state.complete:
        if not state.participants:
            state = state.evolve(
                complete=False, world_size=0, round=state.round + 1, intent_cursor=0
            )
            running = {n: u for n, u in state.excluded.items() if u > state.round}
            return state.evolve(excluded=running) if running != dict(state.excluded) else state
        return state
    if len(state.participants) < s.min_nodes and state.last_call is not None:
        return state.evolve(last_call=None)
    return state


def _reference_ranks(participants, previous):  # type: ignore[no-untyped-def]
    ordered = sorted(participants)
    size = len(ordered)
    kept = {n: r for n, r in (previous or {}).items() if n in set(ordered) and 0 <= r < size}
    free = iter(r for r in range(size) if r not in set(kept.values()))
    return {node: kept[node] if node in kept else next(free) for node in ordered}


def _reference_complete(state: RendezvousState, s: Settings) -> RendezvousState:
    previous = dict(state.last_ranks.items()) if s.stable_ranks else None
    ranks = _reference_ranks(state.participants, previous)
    return state.evolve(
        complete=True,
        last_call=None,
        world_size=len(ranks),
        participants=ranks,
        last_ranks=ranks if s.stable_ranks else {},
        returning=frozenset(),
        regroup=True,
        # a node still waiting did not join the round: it stands by
        wait_list=frozenset(),
        redundancy_list=state.redundancy_list | state.wait_list,
    )


def _reference_apply(
    state: RendezvousState, action: Action, node: NodeDesc, s: Settings
) -> RendezvousState | str:
    """Each effect as a sequence of field-by-field evolves; a refusal as its reason."""
    a = Action
    without = state.heartbeats.delete(node) if node in state.heartbeats else state.heartbeats
    if action is a.ADD_TO_PARTICIPANTS:
        if state.closed:
            return "the rendezvous is closed"
        if state.complete:
            return "the round is complete"
        if node in state.participants:
            return "already joined"
        if len(state.participants) >= s.max_nodes:
            return "round is full"
        if node in state.returning:
            state = state.evolve(returning=state.returning - {node})
        elif state.regroup:
            state = state.evolve(regroup=False, returning=frozenset())
        state = state.evolve(
            wait_list=state.wait_list - {node},
            redundancy_list=state.redundancy_list - {node},
            participants=state.participants.set(node, 0),
        )
        state = _reference_keep_alive(state, node)
        if len(state.participants) == s.min_nodes:
            state = state.evolve(last_call=state.last_call_seq + 1)
            state = state.evolve(last_call_seq=state.last_call)
        if len(state.participants) == s.max_nodes:
            state = _reference_complete(state, s)
        return state
    if action is a.ADD_TO_WAIT_LIST:
        if node in state.participants:
            return "is a participant"
        state = state.evolve(
            redundancy_list=state.redundancy_list - {node}, wait_list=state.wait_list | {node}
        )
        return _reference_keep_alive(state, node)
    if action is a.ADD_TO_REDUNDANCY_LIST:
        if node in state.participants or node in state.wait_list:
            return "is a participant or waiting"
        state = state.evolve(redundancy_list=state.redundancy_list | {node})
        return _reference_keep_alive(state, node)
    if action is a.REMOVE_FROM_PARTICIPANTS:
        if node not in state.participants:
            return "not a participant"
        state = state.evolve(participants=state.participants.delete(node), heartbeats=without)
        if state.complete:
            state = state.evolve(returning=state.returning | {node})
        return _reference_epilogue(state, s)
    if action is a.REMOVE_FROM_WAIT_LIST:
        if node not in state.wait_list:
            return "not waiting"
        return state.evolve(
            wait_list=state.wait_list - {node},
            heartbeats=without,
            returning=state.returning - {node},
        )
    if action is a.REMOVE_FROM_REDUNDANCY_LIST:
        if node not in state.redundancy_list:
            return "not redundant"
        return state.evolve(redundancy_list=state.redundancy_list - {node}, heartbeats=without)
    if action is a.MARK_RENDEZVOUS_COMPLETE:
        if state.complete:
            return "already complete"
        count = len(state.participants)
        if not s.min_nodes <= count <= s.max_nodes:
            return f"{count} participants is outside [{s.min_nodes}, {s.max_nodes}]"
        return _reference_complete(state, s)
    if action is a.MARK_RENDEZVOUS_CLOSED:
        return state.evolve(closed=True)
    if action is a.CHARGE_RESTART:
        if state.charged_through > state.round:
            return f"round {state.round}'s failure is already counted"
        state = state.evolve(restarts=state.restarts + 1, charged_through=state.round + 1)
        if s.restart_budget is not None and state.restarts > s.restart_budget:
            state = state.evolve(closed=True)
        return state
    if action is a.EXCLUDE:
        until = state.round + s.exclusion_rounds + (1 if state.complete else 0)
        excluded = state.excluded.set(node, max(until, state.excluded.get(node, 0)))
        state = state.evolve(
            excluded=excluded,
            heartbeats=without,
            wait_list=state.wait_list - {node},
            redundancy_list=state.redundancy_list - {node},
            returning=state.returning - {node},
        )
        if node not in state.participants:
            return state
        state = state.evolve(participants=state.participants.delete(node))
        return _reference_epilogue(state, s)
    if action is a.LEAVE:
        if node not in state.members() and node not in state.returning:
            return "neither a member nor returning"
        member = node in state.participants
        state = state.evolve(
            participants=state.participants.delete(node) if member else state.participants,
            wait_list=state.wait_list - {node},
            redundancy_list=state.redundancy_list - {node},
            returning=state.returning - {node},
            heartbeats=without,
        )
        return _reference_epilogue(state, s) if member else state
    assert action is a.KEEP_ALIVE
    if node not in state.heartbeats:
        return "has no heartbeat entry"
    return _reference_keep_alive(state, node)


_EFFECTFUL = [a for a in Action if a.changes_state]


@pytest.mark.slow
@settings(max_examples=1000)
@given(any_states(), st.sampled_from(_EFFECTFUL), nodes, any_settings())
def test_each_effect_gives_the_state_its_field_by_field_definition_gives(state, action, node, s):
    hash(state)  # a cached hash must not leak into the result
    expected = _reference_apply(state, action, node, s)
    ctx = Context(node, state, s, 0.0)
    if isinstance(expected, str):
        with pytest.raises(InvalidTransitionError, match=f"{action.name} by {node}") as error:
            apply(state, action, ctx)
        assert str(error.value).endswith(f"is not allowed: {expected}")
        return
    new = apply(state, action, ctx)
    assert new == expected
    assert hash(new) == hash(expected)
    assert "_hash" not in vars(new) or vars(new)["_hash"] == hash(expected)
    for name in ("participants", "heartbeats", "last_ranks", "excluded"):
        assert isinstance(getattr(new, name), Map)
    for name in ("wait_list", "redundancy_list", "returning"):
        assert isinstance(getattr(new, name), frozenset)


@given(st.frozensets(nodes), st.none() | st.dictionaries(nodes, st.integers(-2, 7)))
def test_assign_ranks_matches_its_definition(participants, previous):
    assert assign_ranks(participants, previous) == _reference_ranks(participants, previous)


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


# -- values --------------------------------------------------------------------------


def test_context_is_still_a_frozen_dataclass():
    s = Settings("speedups", 1, 2)
    ctx = Context(POOL[0], RendezvousState(), s, 1.0)
    assert ctx.observations == Observations()
    assert ctx == Context(node=POOL[0], state=RendezvousState(), settings=s, now=1.0)
    assert hash(ctx) == hash(dataclasses.replace(ctx))
    assert dataclasses.replace(ctx, now=2.0).now == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.now = 3.0  # type: ignore[misc]


def test_liveness_window_follows_the_settings_it_belongs_to():
    s = Settings("speedups", 1, 2, keep_alive_interval=2.0, keep_alive_max_attempt=3)
    assert s.liveness_window == 6.0
    assert dataclasses.replace(s, keep_alive_max_attempt=4).liveness_window == 8.0
    assert s == Settings("speedups", 1, 2, keep_alive_interval=2.0, keep_alive_max_attempt=3)


# -- the driver's views and instructions ----------------------------------------------


def test_the_field_orders_the_driver_builds_by_position():
    assert Write._fields == ("state", "action", "dead", "phase", "deadline", "admitted")
    assert Decision._fields == ("instruction", "action", "state", "dead")
    assert Done._fields == ("action", "state", "joined", "rejoin")
    assert Membership._fields == ("round", "rank", "world_size", "participants")
    # (the checker builds its views with every argument, in order)
    assert [f.name for f in dataclasses.fields(NodeView) if f.init] == [
        "state",
        "counters",
        "counters_at",
        "since",
        "own",
        "last_call",
        "peers",
        "stale",
        "intents",
        "intents_round",
        "contended",
        "announced",
    ]


def _with_own(obs: Observations, node: NodeDesc, pair: int | None, since: float) -> Observations:
    """``obs`` with the own sighting set to (pair, since), rebuilt the slow way."""
    beats = dict(obs.heartbeats.items())
    if pair is None:
        beats.pop(node, None)
    else:
        beats[node] = HeartbeatSighting(pair, since)
    return Observations(heartbeats=Map(beats), last_call=obs.last_call)


def _reference_own(
    obs: Observations, node: NodeDesc, state: RendezvousState, side: Map, now: float
):  # type: ignore[no-untyped-def]
    """The own sighting after a read: a new entry is first seen now; a counter moved
    by somebody else keeps the lease's start (a read renews nothing)."""
    counter = state.heartbeats.get(node)
    own = None if counter is None else heartbeat_of(counter, side.get(node, 0))
    before = obs.heartbeats.get(node)
    if own is None or before is None:
        return observe_own(obs, node, own, now)
    if before.counter == own:
        return obs
    return _with_own(obs, node, own, before.since)


def _reference_renewal(obs: Observations, node: NodeDesc, pair: int | None, at: float):  # type: ignore[no-untyped-def]
    """The own sighting after a renewal sent at ``at``."""
    before = obs.heartbeats.get(node)
    if pair is not None and before is not None and before.counter == pair and before.since > at:
        at = before.since
    return _with_own(obs, node, pair, at)


@st.composite
def nodes_and_views(draw: st.DrawFn) -> tuple[NodeDesc, NodeView]:
    """A node, and a view of it: its own sighting apart from its peers'."""
    node = draw(nodes)
    sightings = st.builds(HeartbeatSighting, counters, times)
    peers = draw(st.dictionaries(nodes.filter(lambda n: n != node), sightings, max_size=5))
    view = NodeView(
        state=draw(any_states()),
        counters=Map(draw(st.dictionaries(nodes, counters, max_size=3))),
        counters_at=draw(st.none() | times),
        since=draw(st.none() | times),
        own=draw(st.none() | sightings),
        last_call=draw(
            st.none() | st.builds(LastCallSighting, st.integers(0, 2), st.integers(1, 3), times)
        ),
        peers=Map(peers),
        stale=draw(st.booleans()),
        intents=draw(st.none() | st.tuples(nodes)),
        intents_round=draw(st.integers(-1, 2)),
        contended=draw(st.booleans()),
        announced=draw(st.integers(-1, 2)),
    )
    return node, view


def _fields(view: NodeView, node: NodeDesc) -> dict[str, object]:
    """What a view holds, its sightings as one record (the peers' cache checked)."""
    assert node not in view.peers
    assert view.peers_oldest == min((h.since for h in view.peers.values()), default=None)
    fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(NodeView) if f.init}
    for name in ("own", "last_call", "peers"):
        del fields[name]
    fields["observations"] = view.observations(node)
    return fields


@pytest.mark.slow
@settings(max_examples=500)
@given(
    nodes_and_views(),
    st.none() | any_states(),
    st.none() | st.dictionaries(nodes, counters, max_size=3),
    times,
    st.none() | st.lists(nodes, max_size=3),
)
def test_after_read_updates_the_view_as_the_plain_definitions_say(
    node_view, state, side, now, intents
):
    node, view = node_view
    read = RendezvousState() if state is None else state
    expected = _fields(view, node)
    if view.since is None:
        expected["since"] = now
    obs = expected["observations"]
    if side is None:
        obs = observe(obs, read, now, counters=False)
        obs = _reference_own(obs, node, read, view.counters, now)
    else:
        counters_read = Map(side)
        if node in view.counters and node not in counters_read:
            counters_read = counters_read.set(node, view.counters[node])
        before = obs.heartbeats.get(node)
        obs = observe(obs, read, now, counters_read)
        mine = obs.heartbeats.get(node)
        if before is not None and mine is not None:
            obs = _with_own(obs, node, mine.counter, before.since)
        expected.update(counters=counters_read, counters_at=now)
    expected.update(state=read, observations=obs, stale=False)
    if intents is None:
        expected.update(intents=None, intents_round=-1)
    else:
        expected.update(intents=tuple(intents), intents_round=read.round)
    got = after_read(view, node, state, side, now, intents)
    assert got is view
    assert _fields(got, node) == expected


def _reference_after_write(view, node, won, stored, now):  # type: ignore[no-untyped-def]
    """What a view holds after a write, from the plain definitions."""
    state = RendezvousState() if stored is None else stored
    expected = _fields(view, node)
    obs = observe(expected["observations"], state, now, counters=False)
    obs = _reference_own(obs, node, state, view.counters, now)
    mine = state.heartbeats.get(node)
    if won and mine is not None and mine != view.state.heartbeats.get(node):
        pair = heartbeat_of(mine, view.counters.get(node, 0))
        obs = _reference_renewal(obs, node, pair, now)
    expected.update(
        state=state,
        observations=obs,
        stale=False,
        intents=None,
        intents_round=-1,
        contended=view.contended or not won,
    )
    return expected


@given(nodes_and_views(), st.booleans(), st.none() | any_states(), times, counters)
def test_after_write_wait_and_beat_update_the_view_as_the_plain_definitions_say(
    node_view, won, stored, now, beat
):
    node, view = node_view
    # Sightings are taken on a monotonic clock: none is later than now. (Otherwise
    # a renewal's "recorded by a later renewal" rule compares against the future.)
    assume(view.own is None or view.own.since <= now)
    expected = _reference_after_write(view, node, won, stored, now)
    assert _fields(after_write(view.copy(), node, won, stored, now), node) == expected

    expected = _fields(view, node)
    expected.update(stale=True, contended=False)
    assert _fields(after_wait(view.copy()), node) == expected

    expected = _fields(view, node)
    expected["counters"] = view.counters.set(node, beat)
    own = view.state.heartbeats.get(node)
    pair = None if own is None else heartbeat_of(own, beat)
    if pair is None:
        expected["observations"] = observe_own(expected["observations"], node, None, now)
    else:
        expected["observations"] = _reference_renewal(expected["observations"], node, pair, now)
    assert _fields(after_beat(view, node, beat, now), node) == expected


def test_a_copy_of_a_view_changes_apart_from_it():
    view = after_read(NodeView(), POOL[0], RendezvousState(), {}, 1.0)
    kept = view.copy()
    assert kept == view and kept is not view
    after_wait(view)
    assert view.stale and not kept.stale
    assert dataclasses.replace(kept, stale=True) == view


# -- decisions made without a Context ---------------------------------------------------


class _TableJoin(JoinOp):
    """The join operator as defined: :data:`JOIN_TABLE` walked row by row. A
    subclass, so the driver hands it a :class:`Context` (its field-wise shortcut is
    for JoinOp itself) while every isinstance check still sees a join."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        return join_row(ctx, deadline).action


class _PlainExit(ExitOp):
    """The exit operator as its docstring defines it, read off a Context."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        if ctx.node not in ctx.state.participants:
            return Action.FINISH
        return Action.ERROR_TIMEOUT if ctx.now > deadline else Action.REMOVE_FROM_PARTICIPANTS


def _outcome(view: NodeView, node: NodeDesc, s: Settings, op: object, deadline: float, now: float):  # type: ignore[no-untyped-def]
    """The decision, or the error it raised (states of every shape are drawn, and
    applying an action to some of them is refused)."""
    try:
        return Decision.of(decide(view, node, s, op, deadline, now), view)  # type: ignore[arg-type]
    except Exception as error:  # compared below, not swallowed
        return type(error), str(error)


@pytest.mark.slow
@settings(max_examples=1500)
@given(nodes_and_views(), any_settings(), times, times, st.booleans(), st.booleans())
def test_decide_without_a_context_decides_what_the_operators_as_defined_decide(
    node_view, s, now, deadline, leaving, fresh
):
    """The driver asks JoinOp and ExitOp for their answer from the context's
    fields; the decision (wait, write, admission batch, beat, done) is the one it
    makes when the operators are called with a Context and walk the table."""
    node, view = node_view
    if fresh:  # past the reads, to the operator's answer
        view.stale, view.counters_at, view.since = False, now, now
    fast, plain = (ExitOp(), _PlainExit()) if leaving else (JoinOp(), _TableJoin())
    for limit in (deadline, float("inf"), now - s.rollback_period):
        expected = _outcome(view, node, s, plain, limit, now)
        assert _outcome(view, node, s, fast, limit, now) == expected


@settings(max_examples=1000)
@given(nodes_and_views(), any_settings(), times, st.booleans())
def test_decide_reads_first_exactly_when_the_counters_are_due_or_the_view_is_stale(
    node_view, s, now, leaving
):
    """decide makes _counters_due's test inline: it asks for the same reads."""
    node, view = node_view
    op = ExitOp() if leaving else JoinOp()
    due = driver._counters_due(view, s, now)
    outcome = _outcome(view, node, s, op, float("inf"), now)
    if due or view.stale:
        assert outcome.instruction == Read(due)
    elif isinstance(outcome, Decision) and isinstance(outcome.instruction, Read):
        # the intent log's read of a contended joiner, or the re-read before a
        # death is declared: counters, on a view with the dead removed
        read = outcome.instruction
        assert read.intents or (read == Read(True) and outcome.state != view.state)


@settings(max_examples=300)
@given(nodes_and_views(), any_settings(), times, times, st.booleans())
def test_decide_changes_nothing_in_the_view_but_the_record_of_the_decision(
    node_view, s, now, deadline, leaving
):
    """decide and monitor only read the view, and leave in it what they decided on
    (Decision.of): a copy taken before compares equal after, field by field."""
    node, view = node_view
    op = ExitOp() if leaving else JoinOp()
    for decider in (
        lambda: decide(view, node, s, op, deadline, now),
        lambda: driver.monitor(view, node, s, None, now),
    ):
        before = view.copy()
        try:
            instruction = decider()
        except InvalidTransitionError:
            continue  # states of every shape are drawn: some refuse the action
        assert view == before
        kept = [f for f in _VIEW_SLOTS if f not in _DECISION_RECORD]
        assert [getattr(view, f) for f in kept] == [getattr(before, f) for f in kept]
        assert Decision.of(instruction, view).instruction is instruction


#: What deciding may set in a view: the record of the decision, and the removal of
#: the dead judged on its peers' sightings (made once per view and instant, when a
#: death is judged).
_DECISION_RECORD = {"decided_action", "decided_on", "declared_dead", "_removal"}


@settings(max_examples=300)
@given(
    nodes_and_views(),
    any_settings(),
    times,
    times,
    st.none() | any_states(),
    st.none() | st.dictionaries(nodes, counters, max_size=3),
    st.booleans(),
    st.booleans(),
)
def test_a_view_judged_again_after_it_changed_is_judged_afresh(
    node_view, s, now, deadline, state, side, same_state, monitoring
):
    """The removal of the dead is judged once per view and instant (_dead_removed):
    a view read again at the same instant (a new state, new side counters, or the
    same state object with new side counters) is judged on what it holds now, as
    a copy that never decided is."""
    node, view = node_view
    view.stale, view.counters_at, view.since = False, now, now
    if same_state:
        state = view.state

    def decided(on: NodeView) -> object:
        if monitoring:
            return _monitored(on, node, s, now)
        return _outcome(on, node, s, JoinOp(), deadline, now)

    def never_judged(on: NodeView) -> NodeView:
        fresh = on.copy()
        fresh._removal = None
        return fresh

    decided(view)
    assert decided(view) == decided(never_judged(view))  # the judgment kept
    after_read(view, node, state, side, now)
    assert decided(view) == decided(never_judged(view))


def test_a_view_whose_peers_moved_at_the_same_instant_is_judged_afresh():
    """The state read again is the same object, only a peer's side counter moved:
    that peer is alive again at the same instant, and the other still dead."""
    s = Settings("speedups", 1, 3)
    me, moved, silent = POOL[:3]
    state = RendezvousState(wait_list={me, moved, silent}, heartbeats={me: 1, moved: 1, silent: 1})
    view = after_read(NodeView(), me, state, {moved: 0, silent: 0}, 0.0)
    now = s.liveness_window + 1  # both peers silent since 0, the counters read now
    after_read(view, me, state, {moved: 0, silent: 0}, now)
    driver.monitor(view, me, s, None, now)
    assert view.declared_dead == {moved, silent}
    after_read(view, me, state, {moved: 1, silent: 0}, now)
    driver.monitor(view, me, s, None, now)
    assert view.declared_dead == {silent}


def _monitored(view: NodeView, node: NodeDesc, s: Settings, now: float):  # type: ignore[no-untyped-def]
    """monitor's decision, or the error it raised (see _outcome)."""
    try:
        return Decision.of(driver.monitor(view, node, s, None, now), view)
    except Exception as error:  # compared below, not swallowed
        return type(error), str(error)


_PHASE_FIELDS = ("round", "complete", "closed", "last_call", "participants", "wait_list")
_PHASE_FIELDS += ("world_size", "heartbeats")


@st.composite
def state_pairs(draw: st.DrawFn) -> tuple[RendezvousState, RendezvousState]:
    """Two states: unrelated, or the second one the first with some of the fields
    a phase is made of changed (mostly, the phases agree)."""
    first = draw(any_states())
    if draw(st.booleans()):
        return first, draw(any_states())
    other = draw(any_states())
    names = draw(st.sets(st.sampled_from(_PHASE_FIELDS)))
    return first, first.evolve(**{name: getattr(other, name) for name in names})


@settings(max_examples=1000)
@given(state_pairs(), any_settings())
def test_same_phase_is_phase_of_compared(pair, s):
    first, second = pair
    expected = driver.phase_of(first, s) == driver.phase_of(second, s)
    assert driver._same_phase(first, second, s.max_nodes) is expected


def test_a_phase_of_swapped_in_decides_what_a_write_publishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Settings("speedups", 1, 3)
    view = after_read(NodeView(), POOL[0], RendezvousState(), None, 0.0)
    write = decide(view, POOL[0], s, JoinOp(), 10.0, 0.0)
    assert isinstance(write, Write) and write.phase == 1  # the join arms the last call
    monkeypatch.setattr(driver, "phase_of", lambda state, _: (state.round,))
    write = decide(view, POOL[0], s, JoinOp(), 10.0, 0.0)
    assert isinstance(write, Write) and write.phase is None and write.state.phase == 0


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


# -- the copies a transition makes ------------------------------------------------------


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


@given(nodes_and_views(), st.booleans(), st.sampled_from(_PHASE_FIELDS[:4]), times)
def test_after_write_of_a_state_sharing_the_views_heartbeats(node_view, won, name, now):
    """A write that left the heartbeats as they were (the same map: completing a
    round, closing it, a phase) moves no own counter: after_write tells so by
    identity, and updates the view as its plain definition says."""
    node, view = node_view
    assume(view.own is None or view.own.since <= now)
    other = {"round": 7, "complete": True, "closed": True, "last_call": 9}[name]
    stored = view.state.evolve(**{name: other})
    assert stored.heartbeats is view.state.heartbeats
    expected = _reference_after_write(view, node, won, stored, now)
    assert _fields(after_write(view, node, won, stored, now), node) == expected


def test_only_leaving_the_redundancy_list_resets_the_deadline():
    resetting = {action for action in Action if action.resets_deadline}
    assert resetting == {Action.REMOVE_FROM_REDUNDANCY_LIST}


# -- timers --------------------------------------------------------------------------


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


@settings(max_examples=500)
@given(nodes, any_states(), any_settings(), times, any_observations(), st.none() | times)
def test_wake_at_is_the_earliest_future_timer(node, state, s, now, obs, deadline):
    ctx = Context(node, state, s, now, obs)
    assert wake_at(ctx, deadline) == _reference_wake_at(ctx, deadline)


@settings(max_examples=500)
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
