"""Hypothesis strategies shared by the core's property tests: nodes, settings,
states of every shape (valid or not), observations and views."""

from __future__ import annotations

from hypothesis import strategies as st
from immutables import Map

from rallypoint.core import (
    HeartbeatSighting,
    LastCallSighting,
    NodeDesc,
    NodeView,
    Observations,
    RendezvousState,
    Settings,
)

POOL = [NodeDesc(addr, pid, 0) for addr in ("a", "b") for pid in (1, 2, 3)]

nodes = st.sampled_from(POOL)

node_sets = st.frozensets(nodes)

counters = st.integers(0, 6)

times = st.sampled_from([0.0, 0.5, 1.0, 4.0, 5.0, 5.5, 15.0, 30.0, 100.0])


@st.composite
def any_settings(draw: st.DrawFn) -> Settings:
    high = draw(st.integers(1, 5))
    return Settings(
        "properties",
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
