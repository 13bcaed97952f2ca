"""Hypothesis strategies for writing your own properties of the rendezvous.

* :func:`node_descs` -- nodes (addr, pid, local id);
* :func:`rendezvous_settings` -- valid :class:`Settings`;
* :func:`rendezvous_states` -- shared states that pass :func:`check_state`;
* :func:`sim_configs` -- simulator configurations with faults (workers' failures
  and failed health checks among them), skew and drift.

Example::

    @given(sim_configs(max_nodes=16))
    def test_no_split_brain(config):
        assert not simulate(config).violations
"""

from __future__ import annotations

from hypothesis import strategies as st
from immutables import Map

from ..core import NodeDesc, RendezvousState, Settings
from .simulator import SimConfig

__all__ = ["node_descs", "rendezvous_settings", "rendezvous_states", "sim_configs"]


def node_descs() -> st.SearchStrategy[NodeDesc]:
    """Nodes with short addresses, pids and local ids."""
    return st.builds(
        NodeDesc,
        st.sampled_from(["10.0.0.1", "10.0.0.2", "host-a", "host-b"]),
        st.integers(1, 5),
        st.integers(0, 2),
    )


@st.composite
def rendezvous_settings(draw: st.DrawFn, max_nodes: int = 8) -> Settings:
    """Valid settings with min_nodes <= max_nodes <= ``max_nodes`` (with or
    without a restart budget)."""
    high = draw(st.integers(1, max_nodes))
    low = draw(st.integers(1, high))
    return Settings(
        run_id="strategy",
        min_nodes=low,
        max_nodes=high,
        last_call_timeout=draw(st.sampled_from([0.5, 1.0, 30.0])),
        keep_alive_interval=draw(st.sampled_from([1.0, 5.0])),
        keep_alive_max_attempt=draw(st.integers(1, 3)),
        stable_ranks=draw(st.booleans()),
        restart_budget=draw(st.sampled_from([None, 0, 2])),
        exclusion_rounds=draw(st.integers(1, 3)),
    )


@st.composite
def rendezvous_states(draw: st.DrawFn, settings: Settings | None = None) -> RendezvousState:
    """Shared states, as stored (the state's own heartbeat counters; side counters
    live beside it on the backend), that satisfy
    :func:`rallypoint.spec.invariants.check_state`. A complete round's ranks are
    any permutation of 0..n-1 (the stable-ranks option can give any); ``phase``
    and ``intent_cursor`` take any small value. Some redundant nodes (and nodes
    in no list) may be excluded, and some restarts charged (within the budget,
    or the one past it with the rendezvous closed)."""
    s = settings or draw(rendezvous_settings())
    nodes = draw(st.lists(node_descs(), unique=True, max_size=s.max_nodes + 3))
    count = draw(st.integers(0, min(len(nodes), s.max_nodes)))
    participants, rest = nodes[:count], nodes[count:]
    complete = s.min_nodes <= count and draw(st.booleans())
    ranks = draw(st.permutations(range(count))) if complete else [0] * count
    # (nobody waits beside a full complete round)
    split = 0 if complete and count >= s.max_nodes else draw(st.integers(0, len(rest)))
    heartbeats = {n: draw(st.integers(1, 9)) for n in nodes}
    state = RendezvousState(
        round=draw(st.integers(0, 3)),
        complete=complete,
        closed=draw(st.booleans()),
        world_size=count if complete else 0,
        participants=Map(zip(participants, ranks, strict=True)),
        wait_list=frozenset(rest[:split]),
        redundancy_list=frozenset(rest[split:]),
        heartbeats=Map(heartbeats),
        # the largest counter ever handed out: at least every current one
        heartbeat_seq=max(heartbeats.values(), default=0) + draw(st.integers(0, 3)),
        phase=draw(st.integers(0, 12)),
        intent_cursor=draw(st.integers(0, 12)),
    )
    if not complete and count >= s.min_nodes:
        state = state.evolve(last_call=1, last_call_seq=1)
    outsiders = draw(st.lists(node_descs(), unique=True, max_size=2))
    standing_by = [n for n in outsiders if n not in nodes] + sorted(state.redundancy_list)
    excluded = draw(st.lists(st.sampled_from(standing_by), unique=True)) if standing_by else []
    if excluded:
        ends = {n: state.round + draw(st.integers(1, s.exclusion_rounds + 1)) for n in excluded}
        state = state.evolve(excluded=ends)
    most = 3 if s.restart_budget is None else s.restart_budget + 1
    restarts = draw(st.integers(0, most))
    if restarts:
        through = draw(st.integers(1, state.round + 1))
        spent = s.restart_budget is not None and restarts > s.restart_budget
        state = state.evolve(
            restarts=restarts, charged_through=through, closed=state.closed or spent
        )
    # Who returns from the last complete round: any non-participants, not excluded.
    others = [n for n in rest + outsiders if n not in state.excluded]
    returning = draw(st.lists(st.sampled_from(others), unique=True)) if others else []
    return state.evolve(returning=frozenset(returning), regroup=draw(st.booleans()))


@st.composite
def sim_configs(draw: st.DrawFn, max_nodes: int = 16, duration: float = 120.0) -> SimConfig:
    """Simulator runs with random faults, clock skew and drift."""
    nodes = draw(st.integers(1, max_nodes))
    high = draw(st.integers(1, nodes))
    return SimConfig(
        nodes=nodes,
        min_nodes=draw(st.integers(1, high)),
        max_nodes=high,
        seed=draw(st.integers(0, 2**32 - 1)),
        duration=duration,
        crash_rate=draw(st.sampled_from([0.0, 0.05, 0.2])),
        partition_rate=draw(st.sampled_from([0.0, 0.05])),
        leave_rate=draw(st.sampled_from([0.0, 0.05])),
        conflict_rate=draw(st.sampled_from([0.0, 0.1])),
        # zero latency: requests, notifications and writes at one instant
        latency=(latency := draw(st.sampled_from([0.0, 0.002]))),
        jitter=latency / 2,
        clock_offset=draw(st.sampled_from([0.0, 300.0])),
        drift=draw(st.sampled_from([0.0, 0.01])),
        worker_failure_rate=draw(st.sampled_from([0.0, 0.1])),
        health_failure_rate=draw(st.sampled_from([0.0, 0.05])),
        restart_budget=draw(st.sampled_from([None, 1, 3])),
        exclusion_rounds=draw(st.integers(1, 2)),
    )
