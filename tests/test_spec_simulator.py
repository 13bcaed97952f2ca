"""The simulator: skew and drift cause no false death, a seed replays a run,
faults break no invariant (hypothesis stateful machines, one with 64 nodes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rallypoint.core import encode_state
from rallypoint.spec.cli import simulate_main
from rallypoint.spec.invariants import check_state
from rallypoint.spec.simulator import EncodedSize, SimConfig, SimConfigError, Simulator, simulate
from rallypoint.spec.strategies import rendezvous_settings, rendezvous_states, sim_configs


def test_minutes_of_skew_and_one_percent_drift_cause_no_false_death() -> None:
    config = SimConfig(
        nodes=24, min_nodes=12, duration=600.0, clock_offset=300.0, drift=0.01, seed=3
    )
    report = simulate(config)
    assert not report.violations, report.format()
    assert report.false_deaths == 0 and report.deaths == 0
    assert report.rounds, "a round must complete"
    # Offsets really are minutes apart and rates 1% apart in this run.
    sim = Simulator(config)
    offsets = [n.offset for n in sim.nodes]
    drifts = [n.drift for n in sim.nodes]
    assert max(offsets) - min(offsets) > 300.0
    assert max(drifts) - min(drifts) > 0.01


def test_a_real_silence_is_detected_under_skew() -> None:
    """The detector is not simply asleep: a partitioned member is declared dead."""
    sim = Simulator(SimConfig(nodes=6, min_nodes=3, clock_offset=300.0, drift=0.01, duration=200))
    sim.run_until(30.0)
    assert sim.state.complete
    member = next(n.slot for n in sim.nodes if n.desc in sim.state.participants)
    sim.partition(member)
    sim.run_until(120.0)
    assert sim.report.deaths >= 1 and sim.report.false_deaths == 0
    assert not sim.report.violations


def test_the_same_seed_prints_the_same_report() -> None:
    config = SimConfig(
        nodes=12,
        duration=300.0,
        crash_rate=0.2,
        partition_rate=0.1,
        leave_rate=0.1,
        conflict_rate=0.1,
        clock_offset=60.0,
        drift=0.01,
        seed=11,
    )
    a, b = simulate(config).format(), simulate(config).format()
    assert a == b
    other = simulate(SimConfig(**{**config.__dict__, "seed": 12})).format()
    assert other != a


FAULTY = SimConfig(
    nodes=10,
    max_nodes=8,
    min_nodes=3,
    duration=400.0,
    crash_rate=0.3,
    partition_rate=0.1,
    leave_rate=0.2,
    conflict_rate=0.2,
    seed=5,
    verify_bytes=True,
)


def test_faults_break_no_invariant_and_bytes_match_the_codec() -> None:
    report = simulate(FAULTY)
    assert not report.violations, report.format()
    assert report.crashes and report.rounds
    assert report.totals().bytes_written > 0


def test_no_false_death_after_an_observer_misses_an_exit_and_rejoin() -> None:
    """Found by the simulator: a rejoining node restarted its heartbeat counter, so a
    partitioned observer holding the old value saw no movement and declared it dead.
    The core now starts every new counter above all counters ever handed out."""
    report = simulate(FAULTY)
    assert report.false_deaths == 0, report.false_death_log[0].format()


@settings(max_examples=40, deadline=None)
@given(
    rendezvous_settings().flatmap(rendezvous_states),
    rendezvous_settings().flatmap(rendezvous_states),
)
def test_encoded_size_is_the_codec_length(first, second) -> None:  # type: ignore[no-untyped-def]
    size = EncodedSize(first)
    assert size.value == len(encode_state(first))
    touched = (
        first.members()
        | second.members()
        | frozenset(first.heartbeats)
        | frozenset(second.heartbeats)
    )
    assert size.update(second, touched) == len(encode_state(second))


@settings(max_examples=5, deadline=None)
@given(sim_configs(max_nodes=8, duration=90.0))
def test_random_configurations_keep_the_invariants(config: SimConfig) -> None:
    report = simulate(config)
    assert not report.violations, report.format()


def test_config_errors_name_the_option() -> None:
    for bad, name in (
        ({"nodes": 0}, "nodes"),
        ({"drift": 0.7}, "drift"),
        ({"jitter": 1}, "jitter"),
    ):
        try:
            SimConfig(**bad)  # type: ignore[arg-type]
        except SimConfigError as exc:
            assert name in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_cli_prints_a_table_and_writes_a_plot(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    plot = tmp_path / "rounds.png"
    status = simulate_main(
        ["--nodes", "8", "--duration", "60", "--seed", "1", "--plot", str(plot), "--no-timing"]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "rounds completed" in out and "bytes per write" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


class ClusterMachine(RuleBasedStateMachine):
    """Faults as rules, the safety properties as invariants. Every choice (which
    node, how long) comes from a strategy, so a failure shrinks."""

    NODES = 6

    def __init__(self) -> None:
        super().__init__()
        self.sim = Simulator(
            SimConfig(
                nodes=self.NODES,
                min_nodes=max(1, self.NODES // 2),
                duration=10_000.0,
                clock_offset=120.0,
                drift=0.01,
                conflict_rate=0.05,
                restart_delay=5.0,
            )
        )
        self.sim.run_until(5.0)

    nodes = st.integers(0, NODES - 1)

    @rule(slot=nodes)
    def crash(self, slot: int) -> None:
        self.sim.crash(slot)

    @rule(slot=nodes)
    def partition(self, slot: int) -> None:
        self.sim.partition(slot)

    @rule(slot=nodes)
    def heal(self, slot: int) -> None:
        self.sim.heal(slot)

    @rule(slot=nodes)
    def leave(self, slot: int) -> None:
        self.sim.leave(slot)

    @rule(slot=nodes)
    def arrive(self, slot: int) -> None:
        self.sim.arrive(slot)

    @precondition(lambda self: not self.sim.state.closed)
    @rule(slot=nodes, p=st.floats(0, 1))
    def maybe_close(self, slot: int, p: float) -> None:
        if p < 0.05:
            self.sim.close(slot)

    @rule(seconds=st.sampled_from([0.001, 0.5, 2.0, 10.0, 40.0]))
    def advance(self, seconds: float) -> None:
        self.sim.run_until(self.sim.now + seconds)

    @invariant()
    def shared_state_is_safe(self) -> None:
        assert not check_state(self.sim.state, self.sim.settings)

    @invariant()
    def no_violation_recorded(self) -> None:
        assert not self.sim.report.violations, self.sim.report.violations[0].format()


class BigClusterMachine(ClusterMachine):
    NODES = 64


TestCluster = ClusterMachine.TestCase
TestCluster.settings = settings(max_examples=12, stateful_step_count=25, deadline=None)
TestBigCluster = BigClusterMachine.TestCase
TestBigCluster.settings = settings(max_examples=3, stateful_step_count=12, deadline=None)
