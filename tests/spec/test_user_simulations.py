"""The simulator as a library for users' own tests: ``sim_configs`` fixes or draws
any field (``nodes=8`` always gives 8 nodes), and a report lists what every node's
join returned (``returns``, ``by_round``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rallypoint.spec
from rallypoint.spec import JoinReturn, SimConfig, Simulator, sim_configs, simulate
from rallypoint.spec.model.lifecycle import Phase


@settings(max_examples=30, deadline=None)
@given(sim_configs(nodes=8))
def test_a_fixed_node_count_is_always_that_count(config: SimConfig) -> None:
    assert config.nodes == 8
    settings_ = config.settings()
    assert 1 <= settings_.min_nodes <= settings_.max_nodes <= 8


@settings(max_examples=30, deadline=None)
@given(
    sim_configs(
        nodes=st.integers(3, 5),
        min_nodes=3,
        crash_rate=0.0,
        poll_interval=st.sampled_from([1.0, 2.0]),
        jitter=0.0,
    )
)
def test_fields_are_fixed_or_drawn_from_the_given_strategy(config: SimConfig) -> None:
    assert 3 <= config.nodes <= 5
    assert config.min_nodes == 3
    assert config.max_nodes is not None and 3 <= config.max_nodes <= config.nodes
    assert config.crash_rate == 0.0 and config.jitter == 0.0
    assert config.poll_interval in (1.0, 2.0)
    assert config.duration == 120.0


def test_a_field_simconfig_lacks_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match="nodez"):
        sim_configs(nodez=8)


def test_the_names_for_user_simulations_come_from_rallypoint_spec() -> None:
    for name in rallypoint.spec.__all__:
        assert getattr(rallypoint.spec, name) is not None
    with pytest.raises(AttributeError, match="nothing_here"):
        rallypoint.spec.nothing_here  # noqa: B018


def test_every_node_of_a_fault_free_round_is_in_the_report() -> None:
    report = simulate(SimConfig(nodes=8, min_nodes=8, duration=60.0, seed=4))
    assert report.ok, report.format()
    first = report.by_round()[0]
    assert list(first) == list(range(8))
    members = first[0].joined.members
    assert len(members) == 8
    for slot, returned in first.items():
        joined = returned.joined
        assert returned.slot == slot and joined.round == 0 and joined.world_size == 8
        assert returned.node in members
        assert joined.participants[returned.node] == joined.rank
    assert sorted(r.joined.rank for r in first.values()) == list(range(8))
    # In the order they returned, all after the nodes' arrival.
    times = [r.time for r in report.returns]
    assert times == sorted(times) and times[0] > 0


def test_a_restarted_node_returns_as_a_new_process_in_a_later_round() -> None:
    sim = Simulator(SimConfig(nodes=4, min_nodes=3, duration=120.0, seed=2))
    sim.run_until(20.0)
    before = sim.report.by_round()
    assert 0 in before and 0 in before[0]
    old = before[0][0].node
    sim.crash(0)
    sim.run_until(120.0)
    report = sim.report
    assert report.ok, report.format()
    later = [r for r in report.returns if r.slot == 0 and r.joined.round > 0]
    assert later, report.format()
    assert all(r.node != old and r.node.addr == old.addr for r in later)
    # What the report says each training node returned last is what it trains in.
    for node in sim.nodes:
        if node.phase is Phase.TRAINING:
            last = [r for r in report.returns if r.slot == node.slot][-1]
            assert (last.node, last.joined) == (node.desc, node.joined)


def test_the_returns_are_part_of_the_replayed_run() -> None:
    config = SimConfig(nodes=6, duration=90.0, crash_rate=0.2, seed=11)
    first, second = simulate(config).returns, simulate(config).returns
    assert first == second
    assert all(isinstance(r, JoinReturn) for r in first)
