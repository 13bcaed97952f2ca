"""The checker's reductions hide no state and no planted bug of the kind they could hide.

Each reduction is compared with the search without it (patched off here), on a
space small enough to search both ways in seconds:

* finished nodes stored as one phase, and a crashed slot's incarnation forgotten
  once its crashed node is named nowhere (``Symmetry._normal_locals``): the
  reduced search reaches exactly the normal forms of the states the full search
  reaches; a bug that reads a restarted process's pid (which the renaming
  changes) is still found;
* a checked event checked once per shared state, intent log and local state of its
  node (``Steps.plan``): the same states, transitions and lifecycle edges as
  checking it in every state, and the same planted bugs found;
* stored successors made from templates (``Steps.plan`` / ``Steps.follow``): the
  successors the step rules make (``Steps.successor``), event for event;
* a step conformed once per what its conformance reads (``Steps._conformance``):
  the same states, transitions and lifecycle edges as conforming every step, the
  same (step, lifecycle change) pairs judged, and a declared-dead change the
  model refuses found either way;
* a state not stepped when a state reached by then is the same but for earlier
  deadlines of running operations (subsumption, ``Search._merge``): every state
  of the full search has such a stand-in stored, the same lifecycle edges are
  exercised, and the same planted bugs found.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import NamedTuple

import pytest
from helpers.checker_plants import (
    assert_same_space,
    phase_without_the_last_call,
    skip_the_last_call,
)

from rallypoint.core import NodeDesc, RendezvousState, actions, operators
from rallypoint.core.actions import Action
from rallypoint.spec.check import CheckConfig, Checker, CheckResult, Global, check
from rallypoint.spec.check.memo import Memo
from rallypoint.spec.check.search import Search
from rallypoint.spec.check.state import Age, Deadline, Local, Op, Timers
from rallypoint.spec.check.steps import Plan, Steps
from rallypoint.spec.check.symmetry import Symmetry, relabel
from rallypoint.spec.model.lifecycle import Lifecycle, Phase
from rallypoint.spec.model.machine import Guards, LifecycleModel, View, built

#: Two nodes, one crash, close: crashes, ghosts and finished nodes, in seconds.
CRASHING = CheckConfig(nodes=2, max_crashes=1)
#: Three nodes, no crash or close (the planted bugs' usual space).
SMALL = CheckConfig(nodes=3, max_crashes=0, allow_close=False)


def _search(config: CheckConfig) -> tuple[Checker, CheckResult, list[Global]]:
    checker = Checker(config)
    states: list[Global] = []
    search = Search(checker.steps, checker.symmetry)
    result = search.run(checker.initial(), on_state=lambda g, fp: states.append(g))
    return checker, result, states


class _Reduced(NamedTuple):
    """A search with every reduction on, as the checker runs it: its checker, result
    and stored states, and the lifecycle changes it judged (``_changes_judged``)."""

    checker: Checker
    result: CheckResult
    states: list[Global]
    judged: set[tuple[object, ...]]


@pytest.fixture(scope="module")
def reduced_searches() -> Callable[[CheckConfig], _Reduced]:
    """The reduced search of a config, run once for the module: each test compares
    it with a search without one reduction (recording what it judges changes
    nothing in the search; the tests that step its checker again only read it)."""
    done: dict[CheckConfig, _Reduced] = {}

    def reduced(config: CheckConfig) -> _Reduced:
        if config not in done:
            with pytest.MonkeyPatch.context() as patch:
                judged = _changes_judged(patch)
                done[config] = _Reduced(*_search(config), judged)
        return done[config]

    return reduced


def _without_local_normal_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    def unchanged(self: Symmetry, *forms: object) -> tuple[object, ...]:
        return forms

    monkeypatch.setattr(Symmetry, "_normal_locals", unchanged)


def _lose_no_state(
    monkeypatch: pytest.MonkeyPatch, without: Callable[[pytest.MonkeyPatch], None]
) -> tuple[list[Global], list[Global]]:
    """The stored states of the 2-node search with a crash and close (without
    subsumption), with every normal form and with the ones ``without`` removes
    (monkeypatching): both find no violation, every state of the second has its
    normal form in the first, which reaches nothing else, and fewer states.

    Without subsumption: which states it skips depends on the order states are
    reached in, which the normal forms change (with the regroup record, two
    states of a timed-out joiner were stored by the search without them and not
    by the one with them; without subsumption both reach the same images)."""
    unsubsumed = dataclasses.replace(CRASHING, subsumption=False)
    reduced, reduced_result, reduced_states = _search(unsubsumed)
    with monkeypatch.context() as patch:
        without(patch)
        _, full_result, full_states = _search(unsubsumed)
    assert reduced_result.ok and full_result.ok and full_result.complete
    # (up to the ranks' order: a renamed slot may be relabelled differently, and
    # ranks move with their nodes; see docs/spec.md, "Symmetry reduction")
    symmetry = reduced.symmetry

    def image(g: Global) -> int:
        return symmetry.fingerprint(symmetry.normalize(_rankless(g)))[1]

    assert {image(g) for g in full_states} == {image(g) for g in reduced_states}
    assert len(reduced_states) < len(full_states)
    return reduced_states, full_states


@pytest.mark.slow
def test_finished_nodes_and_forgotten_crashes_lose_no_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reduced_states, full_states = _lose_no_state(monkeypatch, _without_local_normal_forms)
    # the full search stores finished nodes in different phases and a restarted
    # slot under its new pid; the reduced one merges them
    assert any(g.crashes and all(loc.incarnation == 0 for loc in g.locals) for g in reduced_states)
    assert not any(g.crashes and all(loc.incarnation == 0 for loc in g.locals) for g in full_states)


@pytest.mark.slow
def test_a_closed_rendezvous_forgets_its_intent_log_and_loses_no_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search stores a closed state without its intent log and loses no state
    by it (and no step on a closed state read the log: that is a violation)."""

    def keeping_the_log(patch: pytest.MonkeyPatch) -> None:
        patch.setattr(Symmetry, "_normal_intents", lambda self, shared, intents: intents)

    reduced_states, full_states = _lose_no_state(monkeypatch, keeping_the_log)
    assert any(g.shared.closed and g.intents for g in full_states)
    assert not any(g.shared.closed and g.intents for g in reduced_states)


def _rankless(g: Global) -> Global:
    shared = g.shared.evolve(
        participants=dict.fromkeys(g.shared.participants, 0),
        last_ranks=dict.fromkeys(g.shared.last_ranks, 0),
    )
    return g._replace(shared=shared)


def _ranks_that_break_for_a_restarted_process(
    participants: object, previous: object = None
) -> dict[NodeDesc, int]:
    """A bug that reads a pid as more than an order: a round with a restarted
    process in it (the checker's restarts have pids above 100) gets duplicate ranks."""
    ordered = sorted(participants)  # type: ignore[call-overload]
    if any(node.pid > 100 for node in ordered):
        return dict.fromkeys(ordered, 0)
    return {node: rank for rank, node in enumerate(ordered)}


def test_a_bug_that_reads_a_restarted_pid_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgetting a crash renames the restarted process to its slot's first pid,
    which keeps every order the core compares but not the pid itself. The
    renaming waits until the crashed process is named nowhere, so a restarted
    process still completes rounds under its own pid (beside its ghost) and the
    bug shows."""
    monkeypatch.setattr(actions, "assign_ranks", _ranks_that_break_for_a_restarted_process)
    result = check(dataclasses.replace(CRASHING, nodes=3, allow_close=False, max_states=50_000))
    assert result.violation is not None
    assert any("duplicate ranks" in p for p in result.violation.problems)
    assert "crashed, restarts as n" in result.violation.format()


def _checking_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans made afresh for every state: checked events checked in every state."""
    plan = Steps.plan

    def every_time(self: Steps, g: Global, event: object) -> Plan:
        self._plans.clear()
        return plan(self, g, event)  # type: ignore[arg-type]

    monkeypatch.setattr(Steps, "plan", every_time)


@pytest.mark.slow
def test_checking_once_explores_what_checking_every_time_does(
    monkeypatch: pytest.MonkeyPatch, reduced_searches: Callable[[CheckConfig], _Reduced]
) -> None:
    once = reduced_searches(CRASHING).result
    with monkeypatch.context() as patch:
        _checking_every_time(patch)
        every = check(CRASHING)
    assert once.ok and every.ok
    assert_same_space(once, every)


def _skip_the_last_call(monkeypatch: pytest.MonkeyPatch) -> str:
    skip_the_last_call(monkeypatch)
    return "conformance"


def _phase_without_the_last_call(monkeypatch: pytest.MonkeyPatch) -> str:
    phase_without_the_last_call(monkeypatch)
    return "missed wake-up"


def _exit_that_keeps_its_heartbeat(monkeypatch: pytest.MonkeyPatch) -> str:
    """A participant leaving a complete round keeps its heartbeat entry: a
    checked exit (a later deadline) writes what the stored one writes."""
    effects = dict(actions._EFFECTS)

    def leave(state: RendezvousState, node: NodeDesc, s: object) -> RendezvousState:
        left = state.evolve(participants=state.participants.delete(node))
        return actions.remove_participant_epilogue(left, s)  # type: ignore[arg-type]

    effects[Action.REMOVE_FROM_PARTICIPANTS] = leave
    monkeypatch.setattr(actions, "_EFFECTS", effects)
    return ""


@pytest.mark.parametrize(
    "plant", [_skip_the_last_call, _phase_without_the_last_call, _exit_that_keeps_its_heartbeat]
)
def test_checking_once_finds_the_bugs_checking_every_time_finds(
    monkeypatch: pytest.MonkeyPatch, plant: object
) -> None:
    """Bugs seen by the checks that read other nodes' local states (conformance of
    peers, missed wake-ups) or by a step's own checks: found either way."""
    expected = plant(monkeypatch)  # type: ignore[operator]
    once = check(SMALL)
    with monkeypatch.context() as patch:
        _checking_every_time(patch)
        every = check(SMALL)
    assert once.violation is not None and every.violation is not None
    assert any(expected in p for p in once.violation.problems)
    assert any(expected in p for p in every.violation.problems)


class _NothingConformed(Memo[object, None]):
    """A memo of conformed steps that keeps none: every step is conformed."""

    def __contains__(self, key: object) -> bool:
        return False


def _conforming_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    init = Steps.__init__

    def forgetful(self: Steps, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self._conformed = _NothingConformed()

    monkeypatch.setattr(Steps, "__init__", forgetful)


def _changes_judged(monkeypatch: pytest.MonkeyPatch) -> set[tuple[object, ...]]:
    """Every (conformance number, lifecycle change) a search judges, filled as it
    runs. The numbers name what a step's conformance reads of the step and the
    stepping node, in the order the search makes them, which does not depend on
    which steps are conformed: they match between two searches of one space."""
    judged: set[tuple[object, ...]] = set()
    conform = Steps._conform

    def recording(self: Steps, *args: object) -> None:
        conformed = args[-1]
        number = conformed[0] if isinstance(conformed, tuple) else conformed
        expect = self.conformance.expect

        def noted(src: str, trigger: str, dst: str, guards: Guards, who: NodeDesc) -> None:
            judged.add((number, src, trigger, dst, who))
            expect(src, trigger, dst, guards, who)

        self.conformance.expect = noted  # type: ignore[method-assign]
        try:
            conform(self, *args)  # type: ignore[arg-type]
        finally:
            del self.conformance.expect

    monkeypatch.setattr(Steps, "_conform", recording)
    return judged


@pytest.mark.slow
@pytest.mark.parametrize("config", [CRASHING, SMALL], ids=["crashing", "small"])
def test_conforming_once_judges_every_change_conforming_every_step_does(
    monkeypatch: pytest.MonkeyPatch,
    config: CheckConfig,
    reduced_searches: Callable[[CheckConfig], _Reduced],
) -> None:
    """A step is conformed once per what its conformance reads: its own local
    state's pid, phase and operation (not its deadline before the step), and the
    phases and pids of only the nodes it removes, admits or moves on. Every
    lifecycle change of every step is judged as if each were conformed."""
    _, once, _, once_judged = reduced_searches(config)
    with monkeypatch.context() as patch:
        every_judged = _changes_judged(patch)
        _conforming_every_step(patch)
        every = check(config)
    assert once.ok and every.ok
    assert_same_space(once, every)
    assert once_judged == every_judged and len(once_judged) > 1_000


def test_a_declared_dead_change_the_model_refuses_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model that refuses one change the core makes of a dead node only (a
    trained member evicted), in steps whose conformance reads the dead nodes'
    phases alone: found when conformed once as when conformed every step."""
    allows = LifecycleModel.allows

    def refusing(
        self: LifecycleModel, source: object, trigger: str, dest: object, guards: Guards
    ) -> bool:
        if trigger == "declared_dead" and source == Lifecycle.TRAINING:
            return False
        return allows(self, source, trigger, dest, guards)  # type: ignore[arg-type]

    monkeypatch.setattr(LifecycleModel, "allows", refusing)
    once = check(SMALL)
    with monkeypatch.context() as patch:
        _conforming_every_step(patch)
        every = check(SMALL)
    for result in (once, every):
        assert result.violation is not None
        assert any("training --declared_dead-->" in p for p in result.violation.problems)


@pytest.mark.slow
def test_plans_make_the_successors_the_step_rules_make(
    reduced_searches: Callable[[CheckConfig], _Reduced],
) -> None:
    checker, result, states, _ = reduced_searches(CRASHING)
    assert result.ok
    steps, symmetry = checker.steps, checker.symmetry
    compared = 0
    for g in states:
        phases = tuple((loc.phase, loc.incarnation) for loc in g.locals)
        for event in steps.events(g):
            templates, _, checks = steps.plan(g, event)
            stored, checked = steps.choices(g, event)
            assert [t.event for t in templates] == stored and checks == len(checked)
            for template in templates:
                fast = steps.follow(g, template, phases)
                slow, _ = steps.successor(g, template.event)
                assert symmetry.normalize(fast) == symmetry.normalize(slow), template.event
                compared += 1
    assert compared > 10_000


@pytest.mark.slow
def test_fingerprints_tell_states_apart_exactly_up_to_relabelling() -> None:
    """A state's fingerprint and representative are those of each of its
    relabellings (ties in the slots' signatures included: the initial state's
    slots all tie), a stored state is its own representative, and no two stored
    states are relabellings of each other."""
    config = CheckConfig(nodes=3, max_crashes=1, max_states=4_000)
    checker, result, states = _search(config)
    assert len(states) == result.states >= 4_000
    fresh = Symmetry(config)  # its memo tables start empty
    perms = list(itertools.permutations(range(config.nodes)))
    owner: dict[Global, int] = {}
    for index, g in enumerate(states):
        fp = checker.symmetry.fingerprint(g)[1]
        assert fresh.canonical(g)[0] == g
        for perm in perms:
            moved = relabel(g, perm)
            assert fresh.fingerprint(moved)[1] == fp
            assert checker.symmetry.canonical(moved)[0] == g
            assert owner.setdefault(moved, index) == index


def test_one_construction_paths_build_what_the_constructors_build() -> None:
    """The inner loop builds named tuples from every field in order
    (``model.built``); a field added or moved would shift them silently."""
    timers = Timers(frozenset({NodeDesc("n1", 100, 0)}), Age.DUE, True, Deadline.PAST)
    assert built(Timers, (*timers[:4], True)) == timers._replace(contended=True)
    assert Timers._fields[-1] == "contended"
    assert built(Local, (2, Phase.CLOSED, None, None, False)) == Local(2, Phase.CLOSED, None, None)
    assert Local._fields == ("incarnation", "phase", "op", "deadline", "round_ended")
    assert Local(0, Phase.JOINING, Op.JOIN, Deadline.BEFORE).round_ended is False
    assert Global._fields == ("shared", "locals", "crashes", "intents", "failures", "exclusions")
    assert View._fields == (
        "node", "state", "settings", "now", "own", "last_call", "deadline", "pending"
    )  # fmt: skip
    assert len(Guards._fields) == 13
    assert Guards._fields[-3:] == ("announced", "excluded", "all_back")


@pytest.mark.slow
@pytest.mark.parametrize("config", [CRASHING, SMALL], ids=["crashing", "small"])
def test_subsumption_steps_fewer_states_and_loses_none(
    config: CheckConfig, reduced_searches: Callable[[CheckConfig], _Reduced]
) -> None:
    """Every state the search without subsumption steps has a stand-in (itself,
    or itself with some deadlines earlier) that the search with it stored, and
    both exercise the same lifecycle edges; the subsuming search steps fewer
    states, and counts the others as subsumed."""
    reducing, reduced, stored, _ = reduced_searches(config)
    _, full, every = _search(dataclasses.replace(config, subsumption=False))
    assert reduced.ok and full.ok and reduced.complete and full.complete
    fingerprints = {reducing.fingerprint(g)[1] for g in stored}
    assert len(fingerprints) == reduced.states == len(stored)
    lost = [g for g in every if fingerprints.isdisjoint(reducing.stand_ins(g))]
    assert not lost, lost[0]
    assert reduced.lifecycle_edges == full.lifecycle_edges
    assert reduced.states < full.states and reduced.subsumed > 0
    assert full.subsumed == 0


def _timeout_reported_as_closed(monkeypatch: pytest.MonkeyPatch) -> str:
    """A join whose deadline passed (past the rollback period too) ends as if
    the rendezvous were closed: found only on paths where a deadline runs out,
    the paths whose later states subsumption leaves out."""
    rows = tuple(
        dataclasses.replace(row, action=Action.ERROR_CLOSED)
        if row.action is Action.ERROR_TIMEOUT
        else row
        for row in operators.JOIN_TABLE
    )
    monkeypatch.setattr(operators, "JOIN_TABLE", rows)
    return "closed"


@pytest.mark.parametrize(
    "plant",
    [_skip_the_last_call, _phase_without_the_last_call, _timeout_reported_as_closed],
)
def test_subsumption_finds_the_bugs_the_full_search_finds(
    monkeypatch: pytest.MonkeyPatch, plant: object
) -> None:
    expected = plant(monkeypatch)  # type: ignore[operator]
    reduced = check(SMALL)
    full = check(dataclasses.replace(SMALL, subsumption=False))
    for result in (reduced, full):
        assert result.violation is not None
        assert any(expected in p for p in result.violation.problems)


def test_a_state_made_the_way_another_was_is_its_instance_only_when_equal() -> None:
    """CoreSteps._one_made guesses a made state's one instance from how it was
    made, and takes the guess only when it is equal: a driver whose writes
    depend on more than the guess's key gets the instance of what it wrote."""
    core = Checker(SMALL).steps.core
    base = RendezvousState()
    node = NodeDesc("n0", 100, 0)
    made = (id(base), node, Action.ADD_TO_PARTICIPANTS, frozenset(), (), ())
    first = base.evolve(participants={node: 0}, heartbeats={node: 1})
    assert core._one_made(first, made, base) is first
    copy = base.evolve(participants={node: 0}, heartbeats={node: 1})
    assert core._one_made(copy, made, base) is first
    other = base.evolve(participants={node: 0}, heartbeats={node: 2})
    taken = core._one_made(other, made, base)
    assert taken == other and taken != first
