"""Hypothesis strategies for writing your own properties of the rendezvous.

* :func:`node_descs` -- nodes (addr, pid, local id);
* :func:`rendezvous_settings` -- valid :class:`Settings`;
* :func:`rendezvous_states` -- shared states that pass :func:`check_state`;
* :func:`sim_configs` -- simulator configurations with faults (workers' failures
  and failed health checks among them), skew and drift; any field fixed or drawn
  from a strategy of yours (``sim_configs(nodes=8)``: always 8 nodes).

Example (docs/spec.md, "Simulations in your own tests", has more)::

    @given(sim_configs(nodes=st.integers(1, 16)))
    def test_no_split_brain(config):
        assert not simulate(config).violations
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
    :func:`rallypoint.spec.model.invariants.check_state`. A complete round's ranks are
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


#: The fields :func:`sim_configs` draws when not given, and from what. The rates are
#: per node per simulated minute; ``jitter`` is half the drawn ``latency``.
_SIM_DRAWN: dict[str, st.SearchStrategy[Any]] = {
    "nodes": st.integers(1, 16),
    "seed": st.integers(0, 2**32 - 1),
    "crash_rate": st.sampled_from([0.0, 0.05, 0.2]),
    "partition_rate": st.sampled_from([0.0, 0.05]),
    "leave_rate": st.sampled_from([0.0, 0.05]),
    "conflict_rate": st.sampled_from([0.0, 0.1]),
    # zero latency: requests, notifications and writes at one instant
    "latency": st.sampled_from([0.0, 0.002]),
    "clock_offset": st.sampled_from([0.0, 300.0]),
    "drift": st.sampled_from([0.0, 0.01]),
    "worker_failure_rate": st.sampled_from([0.0, 0.1]),
    "health_failure_rate": st.sampled_from([0.0, 0.05]),
    "restart_budget": st.sampled_from([None, 1, 3]),
    "exclusion_rounds": st.integers(1, 2),
}

#: The fields of SimConfig, the names sim_configs accepts.
_SIM_FIELDS = frozenset(f.name for f in dataclasses.fields(SimConfig))


def sim_configs(
    *, duration: float | st.SearchStrategy[float] = 120.0, **fixed: Any
) -> st.SearchStrategy[SimConfig]:
    """Simulator runs with random faults, clock skew and drift.

    Every keyword is a :class:`SimConfig` field: a value fixes it, a strategy
    draws it. ``sim_configs(nodes=8)`` always simulates 8 nodes;
    ``sim_configs(nodes=st.integers(100, 200), crash_rate=0.0)`` 100 to 200 nodes
    that never crash. Not given, ``nodes`` is drawn from 1 to 16, then
    ``max_nodes`` from 1 to ``nodes`` (from ``min_nodes`` up when that is given)
    and ``min_nodes`` from 1 to ``max_nodes``; the seed, the fault rates (crashes,
    partitions, leaves, CAS conflicts, workers' failures, failed health checks),
    latency, clock offset, drift, restart budget and exclusion rounds among a few
    values each (``_SIM_DRAWN``); every other field keeps its default. A name
    that is not a field is a TypeError at once.
    """
    unknown = sorted(set(fixed) - _SIM_FIELDS)
    if unknown:
        raise TypeError(f"sim_configs() got fields SimConfig does not have: {', '.join(unknown)}")
    return _sim_configs(dict(fixed, duration=duration))


@st.composite
def _sim_configs(draw: st.DrawFn, fixed: dict[str, Any]) -> SimConfig:
    def pick(name: str, default: st.SearchStrategy[Any] | None = None) -> Any:
        """The given value of ``name``, else a draw from ``default``."""
        value = fixed.get(name, default)
        return draw(value) if isinstance(value, st.SearchStrategy) else value

    nodes = pick("nodes", _SIM_DRAWN["nodes"])
    if "min_nodes" in fixed:
        low = pick("min_nodes")
        floor = 1 if low is None else low
        high = pick("max_nodes", st.integers(floor, max(floor, nodes)))
    else:
        high = pick("max_nodes", st.integers(1, nodes))
        low = draw(st.integers(1, nodes if high is None else high))
    drawn = {name: pick(name, strategy) for name, strategy in _SIM_DRAWN.items()}
    if "jitter" not in fixed:
        drawn["jitter"] = drawn["latency"] / 2
    rest = {name: pick(name) for name in fixed.keys() - drawn.keys() - {"min_nodes", "max_nodes"}}
    return SimConfig(**{**rest, **drawn, "nodes": nodes, "min_nodes": low, "max_nodes": high})
