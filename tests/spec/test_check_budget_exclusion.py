"""The restart budget and self-exclusion in the model checker and the simulator:
both explore them when asked (and only then), hold them to their invariants, and
find bugs planted in the core's budget and exclusion rules."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import NodeDesc, RendezvousState, actions, operators
from rallypoint.core.actions import Action
from rallypoint.spec.check import (
    Age,
    CheckConfig,
    Checker,
    CheckerConfigError,
    Deadline,
    Event,
    EventKind,
    Global,
    Local,
    Op,
    Phase,
    check,
    describe,
    node_of,
    relabel,
)
from rallypoint.spec.cli import simulate_main, spec_main
from rallypoint.spec.model.invariants import check_state, check_transition
from rallypoint.spec.simulator import SimConfig, SimConfigError, Simulator, simulate

#: Two nodes, one of whose workers may fail twice, with a budget of one restart:
#: the second failure (in a later round) closes the rendezvous.
FAILING = CheckConfig(
    nodes=2,
    min_nodes=1,
    max_nodes=2,
    max_crashes=0,
    allow_close=False,
    max_failures=2,
    restart_budget=1,
)
#: Two nodes, one of which may exclude itself once, for two rounds.
EXCLUDING = CheckConfig(
    nodes=2,
    min_nodes=1,
    max_nodes=2,
    max_crashes=0,
    allow_close=False,
    max_exclusions=1,
    exclusion_rounds=2,
)

# -- the checker ---------------------------------------------------------------------


def _events(config: CheckConfig, g: Global) -> set[tuple[EventKind, int]]:
    return {(e.kind, e.slot) for e in Checker(config).events(g)}


def _training(config: CheckConfig) -> Global:
    """Both nodes trained in a complete round 0 (reached through the checker's own
    steps: each joins, the round fills and completes, each returns)."""
    checker = Checker(config)
    g = checker.initial()
    for slot in (0, 1, 0, 1):
        kind = EventKind.JOIN if g.locals[slot].op is None else EventKind.STEP
        (event, *_), _ = checker.choices(g, Event(kind, slot))
        g = checker.normalize(checker.successor(g, event)[0], shift_rounds=False)
    assert all(loc.phase is Phase.TRAINING for loc in g.locals), describe(g)
    assert g.shared.complete
    return g


def test_failures_and_exclusions_are_events_only_when_asked_for() -> None:
    plain = CheckConfig(nodes=2, min_nodes=1, max_nodes=2)
    g = _training(plain)
    kinds = {kind for kind, _ in _events(plain, g)}
    assert EventKind.FAIL not in kinds and EventKind.EXCLUDE not in kinds
    both = dataclasses.replace(plain, max_failures=1, max_exclusions=1)
    assert {(EventKind.FAIL, 0), (EventKind.EXCLUDE, 1)} <= _events(both, g)
    # an idle node excludes itself too; only a training node's workers fail
    idle = Checker(both).initial()
    assert {kind for kind, _ in _events(both, idle)} == {
        EventKind.JOIN,
        EventKind.EXCLUDE,
        EventKind.CLOSE,
        EventKind.CRASH,
    }
    # bounded: a spent bound disables the event
    spent = g._replace(failures=1, exclusions=1)
    kinds = {kind for kind, _ in _events(both, spent)}
    assert EventKind.FAIL not in kinds and EventKind.EXCLUDE not in kinds


def _event(
    checker: Checker, g: Global, kind: EventKind, slot: int, expired: tuple[int, ...] = ()
) -> Event:
    """The concrete event of ``kind`` whose timers show the slots ``expired``
    silent, the node's own heartbeat fresh, its deadline ahead and no lost
    compare-and-set."""
    silent = frozenset(node_of(i, g.locals[i].incarnation) for i in expired)
    for event in checker.expand(g, Event(kind, slot)):
        t = event.timers
        if t is None or (
            t.expired == silent
            and t.deadline is Deadline.BEFORE
            and not t.contended
            and t.own is Age.FRESH
        ):
            return event
    raise AssertionError(f"no such {kind} event")


def test_a_failure_charges_its_round_once_and_a_late_charge_is_free() -> None:
    """A node whose workers failed charges the round it trained in. When that round
    ends before its charge is written (a peer's write advanced it), the charge is
    free: it is of a round that is over."""
    config = dataclasses.replace(FAILING, restart_budget=5)
    checker = Checker(config)
    g = _training(config)
    after, lines = checker.successor(g, _event(checker, g, EventKind.FAIL, 0))
    assert (after.shared.restarts, after.shared.charged_through, after.failures) == (1, 1, 1)
    assert after.locals[0].op is Op.CHARGE
    finished, _ = checker.successor(after, _event(checker, after, EventKind.STEP, 0))
    assert finished.locals[0] == Local(0, Phase.TRAINING, None, None)
    assert finished.shared.restarts == 1
    # node 1's failure runs while node 0 leaves the round and, declaring node 1
    # dead, opens the next one in the same write as its join
    running = g._replace(
        locals=(g.locals[0], g.locals[1]._replace(op=Op.CHARGE, deadline=Deadline.BEFORE))
    )
    left, _ = checker.successor(running, _event(checker, running, EventKind.EXIT, 0))
    assert left.locals[1].op is Op.CHARGE and left.shared.round == 0
    advanced, _ = checker.successor(left, _event(checker, left, EventKind.JOIN, 0, expired=(1,)))
    assert advanced.shared.round == 1
    assert advanced.locals[1].op is Op.CHARGE_LATE
    assert advanced.locals[1].round_ended
    ended, _ = checker.successor(advanced, _event(checker, advanced, EventKind.STEP, 1))
    assert ended.locals[1] == Local(0, Phase.TRAINING, None, None, round_ended=True)
    assert (ended.shared.restarts, ended.shared.charged_through) == (0, 0)
    checker.steps.narrate = True
    _, lines = checker.successor(advanced, _event(checker, advanced, EventKind.STEP, 1))
    assert lines == ["ChargeRestartOp(an ended round) -> FINISH (done)"]
    # a node whose round ended has no failure of its own to charge: its exit and
    # join are its events
    assert (EventKind.FAIL, 1) not in _events(config, ended)
    assert (EventKind.FAIL, 0) in _events(config, g)


def test_failures_with_a_budget_explore_without_violation_and_close() -> None:
    spent: list[tuple[int, bool]] = []
    checker = Checker(FAILING)
    result = checker.run(on_state=lambda g, _: spent.append((g.shared.restarts, g.shared.closed)))
    assert result.ok, result.summary()
    assert result.complete
    assert ("training", "charge_restart", "training") in result.lifecycle_edges
    # the budget of one was spent, and the failure after it closed the rendezvous
    assert (1, False) in spent and (2, True) in spent
    assert all(closed for restarts, closed in spent if restarts > 1)


def test_exclusions_explore_without_violation_and_stand_by_as_spares() -> None:
    spares: list[Global] = []

    def spare(g: Global, _: int) -> None:
        if any(n in g.shared.redundancy_list for n in g.shared.excluded):
            spares.append(g)

    result = Checker(EXCLUDING).run(on_state=spare)
    assert result.ok, result.summary()
    assert result.complete and spares
    triggers = {(src, t, dst) for src, t, dst in result.lifecycle_edges}
    assert ("training", "exclude", "exited") in triggers
    assert ("joining", "add_to_redundancy_list", "redundant") in triggers
    # a spare whose exclusion ran out joined again
    assert ("redundant", "remove_from_redundancy_list", "joining") in triggers


@pytest.mark.slow
def test_the_round_abstraction_covers_the_budget_and_exclusions() -> None:
    """As tests/spec/test_check.py's test for ranks: every state of a search with
    concrete rounds 0..2 is, renumbered (charged-through rounds and exclusions
    shifted with the round), a state the abstract search stored."""
    base = CheckConfig(
        nodes=2,
        min_nodes=1,
        max_nodes=2,
        max_crashes=0,
        max_failures=1,
        max_exclusions=1,
        restart_budget=1,
        exclusion_rounds=2,
    )
    abstract = Checker(base)
    stored: set[int] = set()
    assert abstract.run(on_state=lambda g, fp: stored.add(fp)).complete
    concrete = Checker(dataclasses.replace(base, max_round=1, subsumption=False))
    rounds: set[int] = set()
    missing: list[Global] = []

    def covered(g: Global, _: int) -> None:
        rounds.add(g.shared.round)
        if stored.isdisjoint(abstract.stand_ins(g)):
            missing.append(g)

    assert concrete.run(on_state=covered).ok
    assert rounds == {0, 1, 2}
    assert not missing, describe(missing[0])


def test_normal_forms_shift_the_budget_and_exclusions_with_the_round() -> None:
    checker = Checker(FAILING)
    g = checker.initial()
    a, b = node_of(0, 0), node_of(1, 0)
    shared = RendezvousState(round=5, restarts=2, charged_through=3, excluded={a: 7})
    normal = checker.normalize(g._replace(shared=shared)).shared
    # charged through an earlier round: as good as through round 0 (nothing left to tell)
    assert (normal.round, normal.restarts, normal.charged_through) == (0, 2, 0)
    assert dict(normal.excluded) == {a: 2}
    now = checker.normalize(g._replace(shared=shared.evolve(charged_through=6))).shared
    assert now.charged_through == 1
    # a relabelling moves exclusions with their nodes, and the fingerprint with them
    moved = relabel(g._replace(shared=normal), (1, 0))
    assert dict(moved.shared.excluded) == {b: 2}
    other = g._replace(shared=normal.evolve(excluded={b: 1}))
    assert checker.fingerprint(g._replace(shared=normal))[1] == checker.fingerprint(moved)[1]
    assert checker.fingerprint(g._replace(shared=normal))[1] != checker.fingerprint(other)[1]
    assert "restarts=2" in describe(g._replace(shared=normal))
    assert "X{n0:2}" in describe(g._replace(shared=normal))


def test_config_errors_name_the_new_fields() -> None:
    with pytest.raises(CheckerConfigError, match="max_failures must be a number >= 0"):
        CheckConfig(max_failures=-1)
    with pytest.raises(CheckerConfigError, match="max_exclusions must be a number >= 0"):
        CheckConfig(max_exclusions=-1)
    with pytest.raises(CheckerConfigError, match="restart_budget must be at least 0"):
        CheckConfig(restart_budget=-1)
    with pytest.raises(CheckerConfigError, match="exclusion_rounds must be an integer >= 1"):
        CheckConfig(exclusion_rounds=0)


def test_the_check_cli_takes_the_new_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = (
        "check --nodes 2 --min 1 --max 2 --no-close --max-crashes 0 --max-failures 1 "
        "--max-exclusions 1 --restart-budget 0 --exclusion-rounds 2 --max-states 300 --quiet"
    )
    assert spec_main(args.split()) == 0
    out = capsys.readouterr().out
    assert "max_failures=1 max_exclusions=1 restart_budget=0 exclusion_rounds=2" in out
    assert spec_main(["check", "--max-failures", "-1"]) == 2
    assert "max_failures must be a number >= 0" in capsys.readouterr().err
    assert spec_main(["check", "--restart-budget", "-2"]) == 2
    assert "restart_budget must be at least 0" in capsys.readouterr().err


# -- the simulator -------------------------------------------------------------------


def test_worker_failures_spend_the_budget_and_the_run_ends_closed() -> None:
    config = SimConfig(
        nodes=6, min_nodes=3, seed=4, duration=600.0, worker_failure_rate=0.5, restart_budget=2
    )
    sim = Simulator(config)
    report = sim.run()
    assert report.ok, report.format()
    assert report.worker_failures >= 3 and report.charges == 3
    assert report.restarts == 3 and report.closed
    assert sim.state.closed and sim.state.restarts == 3
    # every node stopped with the rendezvous (or was down when it closed)
    assert all(node.phase in (Phase.CLOSED, Phase.DOWN) for node in sim.nodes)
    text = report.format()
    assert "restarts charged (budget)" in text and "3 (2)" in text


def test_without_a_budget_failures_are_counted_and_the_job_goes_on() -> None:
    report = simulate(
        SimConfig(nodes=6, min_nodes=3, seed=4, duration=300.0, worker_failure_rate=0.5)
    )
    assert report.ok, report.format()
    assert report.charges >= 2 and report.restarts == report.charges and not report.closed
    assert len(report.rounds) > report.charges


def test_a_node_that_fails_its_health_check_stands_by_while_excluded() -> None:
    sim = Simulator(SimConfig(nodes=4, min_nodes=2, seed=1, duration=600.0, exclusion_rounds=1))
    sim.run_until(20.0)
    assert sim.state.complete and len(sim.state.participants) == 4
    sick = sim.nodes[0]
    sim.fail_health_check(sick.slot)
    sim.run_until(60.0)
    state = sim.state
    assert state.excluded.get(sick.desc, 0) > state.round
    assert sick.desc in state.redundancy_list and sick.desc not in state.participants
    assert state.complete and len(state.participants) == 3
    assert sim.report.health_failures == 1 and sim.report.exclusions == 1
    assert sim.report.ok, sim.report.format()
    # once a new round opens the exclusion is over, and the spare joins it
    sim.fail_workers(sim.nodes[1].slot)
    sim.run_until(120.0)
    assert not sim.state.excluded and sick.desc in sim.state.participants
    assert sim.report.ok, sim.report.format()


def test_random_health_failures_break_no_invariant() -> None:
    report = simulate(
        SimConfig(
            nodes=8,
            min_nodes=3,
            max_nodes=6,
            seed=9,
            duration=400.0,
            health_failure_rate=0.3,
            worker_failure_rate=0.2,
            crash_rate=0.1,
            exclusion_rounds=2,
            conflict_rate=0.1,
            verify_bytes=True,
        )
    )
    assert report.ok, report.format()
    assert report.exclusions > 3 and report.charges > 1


def test_a_run_without_the_new_faults_reports_as_before() -> None:
    text = simulate(SimConfig(nodes=4, seed=2, duration=30.0, crash_rate=1.0)).format()
    assert "worker failures" not in text and "restarts charged" not in text


def test_simulator_options_are_checked() -> None:
    for bad, message in (
        ({"worker_failure_rate": -1.0}, "worker_failure_rate must be a finite number >= 0"),
        ({"health_failure_rate": float("inf")}, "health_failure_rate must be a finite number"),
        ({"restart_budget": -1}, "restart_budget must be at least 0"),
        ({"exclusion_rounds": 0}, "exclusion_rounds must be an integer >= 1"),
    ):
        with pytest.raises(SimConfigError, match=message):
            SimConfig(**bad)  # type: ignore[arg-type]


def test_the_simulate_cli_takes_the_new_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = (
        "--nodes 6 --min 3 --seed 4 --duration 600 --worker-failure-rate 0.5 "
        "--restart-budget 2 --health-failure-rate 0.1 --exclusion-rounds 2 --no-timing"
    )
    assert simulate_main(args.split()) == 0
    out = capsys.readouterr().out
    assert "restarts charged (budget)" in out and "rendezvous closed" in out
    assert simulate_main(["--restart-budget", "-1"]) == 2
    assert "restart_budget must be at least 0" in capsys.readouterr().err
    assert simulate_main(["--worker-failure-rate", "-1"]) == 2
    assert "worker_failure_rate must be a finite number >= 0" in capsys.readouterr().err


# -- planted bugs: the checker and the simulator find them ---------------------------


def _charge_that_never_closes(state, node, settings):  # type: ignore[no-untyped-def]
    """A budget bug: the failure after the budget is spent is counted, but the
    rendezvous stays open (the job restarts forever)."""
    return actions._charge_restart(state, node, settings).evolve(closed=state.closed)


def _charge_that_refunds(state, node, settings):  # type: ignore[no-untyped-def]
    """A budget bug: a charge of a later round takes one restart back instead (the
    budget grows again)."""
    charged = actions._charge_restart(state, node, settings)
    if state.restarts:
        return charged.evolve(restarts=state.restarts - 1, closed=state.closed)
    return charged


@pytest.mark.parametrize(
    ("bug", "problem"),
    [
        (_charge_that_never_closes, "restarts spent a budget of 1; still open"),
        (_charge_that_refunds, "the restart count went back from 1"),
    ],
)
def test_a_planted_budget_bug_is_found_by_the_checker_and_the_simulator(
    monkeypatch: pytest.MonkeyPatch, bug: object, problem: str
) -> None:
    config = SimConfig(
        nodes=4, min_nodes=2, seed=3, duration=600.0, worker_failure_rate=0.5, restart_budget=1
    )
    clean = simulate(config)
    assert clean.ok and clean.closed, clean.format()  # without the bug: closed, no violation
    effects = dict(actions._EFFECTS)
    effects[Action.CHARGE_RESTART] = bug  # type: ignore[assignment]
    monkeypatch.setattr(actions, "_EFFECTS", effects)
    result = check(FAILING)
    assert result.violation is not None, result.summary()
    assert any(problem in p for p in result.violation.problems), result.violation.format()
    text = result.violation.format()
    assert "fail: " in text and "CHARGE_RESTART" in text and "VIOLATES" in text
    print(text)
    report = simulate(config)
    assert report.violations, report.format()
    found = [p for v in report.violations for p in v.problems]
    assert any(problem in p for p in found), found
    print(report.violations[0].format())


def _join_table_ignoring_exclusions() -> tuple[operators.JoinRow, ...]:
    """An exclusion bug: the join table of before self-exclusion, which admits an
    excluded node (it stands by only when the round is full)."""
    rows = []
    for row in operators.JOIN_TABLE:
        if row.name.startswith("excluded"):
            continue
        if row.name.startswith("redundant, round full or excluded"):
            guard = row.guard.replace("(full or excluded)", "full")
            assert guard != row.guard
            row = dataclasses.replace(row, guard=guard)
        rows.append(row)
    return tuple(rows)


def test_a_planted_exclusion_bug_is_found_by_the_checker_and_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = SimConfig(nodes=4, min_nodes=2, seed=1, duration=300.0, health_failure_rate=0.5)
    clean = simulate(config)
    assert clean.ok and clean.exclusions, clean.format()  # without the bug: no violation
    monkeypatch.setattr(operators, "JOIN_TABLE", _join_table_ignoring_exclusions())
    result = check(EXCLUDING)
    assert result.violation is not None, result.summary()
    text = result.violation.format()
    assert any("is excluded until round" in p for p in result.violation.problems), text
    assert "exclude: " in text and "VIOLATES" in text
    print(text)
    report = simulate(config)
    found = [p for v in report.violations for p in v.problems]
    assert any("is excluded until round" in p and "but is a member" in p for p in found), (
        report.format()
    )
    print(report.violations[0].format())


def test_the_simulator_checks_the_new_fields_on_writes_it_checks_by_entry() -> None:
    """Above 256 nodes most writes are checked on the entries they touched: the
    budget and the exclusions are among them."""
    sim = Simulator(SimConfig(nodes=300, check_every=10_000))
    a = NodeDesc("x", 1, 0)
    before = RendezvousState(round=1, restarts=2, charged_through=1, excluded={a: 3})
    assert sim.checks.check_touched(before, before.evolve(restarts=1), (a,))
    joined = before.evolve(participants={a: 0}, heartbeats={a: 1})
    assert sim.checks.check_touched(before, joined, (a,))
    assert sim.checks.check_touched(before, before.evolve(excluded={}), (a,))
    assert not sim.checks.check_touched(before, before.evolve(restarts=3, charged_through=2), (a,))
    # and over several writes, several failures may be counted
    after = before.evolve(round=2, restarts=4, charged_through=3)
    assert check_transition(before, after) and not check_transition(before, after, steps=2)
    assert not check_state(after, sim.settings)
