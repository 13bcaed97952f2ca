"""The model checker: it explores without violation, and finds planted bugs."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
from helpers.checker_plants import (
    assert_same_space,
    phase_without_the_last_call,
    replace_row,
    skip_the_last_call,
)

from rallypoint.core import (
    Announce,
    Context,
    Decision,
    Done,
    Instruction,
    NodeDesc,
    Read,
    RendezvousState,
    Wait,
    Write,
    actions,
    driver,
)
from rallypoint.core.actions import Action
from rallypoint.spec.check import (
    Age,
    CheckConfig,
    Checker,
    CheckerConfigError,
    CheckResult,
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
from rallypoint.spec.cli import spec_main
from rallypoint.spec.model.invariants import check_admissions, check_removal_published
from rallypoint.spec.model.lifecycle import Lifecycle

#: Three nodes, every round, no crashes or close: the full space in seconds.
SMALL = CheckConfig(nodes=3, max_crashes=0, allow_close=False)


@pytest.mark.slow
def test_two_nodes_full_state_space_has_no_violation() -> None:
    result = check(CheckConfig(nodes=2, min_nodes=1, max_nodes=2))
    assert result.ok, result.summary()
    assert result.complete and result.states > 100 and result.depth > 5
    # The search drove nodes through most of the model's edges.
    triggers = {t for _, t, _ in result.lifecycle_edges}
    assert {"add_to_participants", "finish", "declared_dead", "crash", "closed"} <= triggers


@pytest.fixture(scope="module")
def small_search() -> CheckResult:
    """The search of SMALL with the real core, run once for the module."""
    return check(SMALL)


@pytest.mark.slow
def test_three_nodes_every_round_full_state_space_has_no_violation(
    small_search: CheckResult,
) -> None:
    result = small_search
    assert result.ok, result.summary()
    assert result.complete and result.states > 1000 and result.depth > 8
    # Contended joiners went through the intent log, and peers admitted them.
    admitted = {(src, dst) for src, t, dst in result.lifecycle_edges if t == "admitted"}
    assert {("joining", "participant"), ("joining", "complete"), ("waiting", "participant")} <= (
        admitted
    )


def test_the_search_is_reproducible() -> None:
    config = dataclasses.replace(SMALL, max_states=800)
    a, b = check(config), check(config)
    assert (a.states, a.transitions, a.depth) == (b.states, b.transitions, b.depth)


@pytest.mark.slow
def test_the_round_abstraction_covers_every_concrete_round() -> None:
    """Every state of a search with concrete round numbers (rounds 0..2, every
    state stepped), once renumbered, is a state the abstract search stored or
    one it subsumed: the abstraction and the subsumption lose no behaviour of
    the real core there."""
    base = CheckConfig(nodes=2, min_nodes=1, max_nodes=2, stable_ranks=True)
    abstract = Checker(base)
    stored: set[int] = set()
    result = abstract.run(on_state=lambda g, fp: stored.add(fp))
    assert result.complete and result.subsumed > 0

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


def _keep_previous_ranks_blindly(
    participants: object, previous: dict[object, int] | None = None
) -> dict[object, int]:
    """A stable-ranks bug: keeps a previous rank even where a newcomer took it."""
    ordered = sorted(participants)  # type: ignore[call-overload]
    return {node: (previous or {}).get(node, i) for i, node in enumerate(ordered)}


@pytest.mark.slow
def test_a_bug_of_later_rounds_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug needs a second round to show: round 0 alone misses it, the round
    abstraction finds it, and the trace shows the concrete round numbers."""
    monkeypatch.setattr(actions, "assign_ranks", _keep_previous_ranks_blindly)
    config = dataclasses.replace(SMALL, stable_ranks=True)
    first_round = check(dataclasses.replace(config, max_round=0))
    assert first_round.ok and first_round.complete
    result = check(config)
    assert result.violation is not None
    assert any("complete round 1 has ranks" in p for p in result.violation.problems)
    assert "round=1" in result.violation.format()


def test_mutation_duplicate_ranks_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        actions, "assign_ranks", lambda parts, prev=None: dict.fromkeys(sorted(parts), 0)
    )
    result = check(SMALL)
    assert result.violation is not None
    assert any("duplicate ranks" in p for p in result.violation.problems)
    text = result.violation.format()
    assert "0. initial" in text and "ADD_TO_PARTICIPANTS" in text and "VIOLATES" in text


def test_mutation_complete_below_min_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    replace_row(
        monkeypatch,
        Action.MARK_RENDEZVOUS_COMPLETE,
        "not complete and participant",
    )
    effects = dict(actions._EFFECTS)
    effects[Action.MARK_RENDEZVOUS_COMPLETE] = lambda st, node, s: actions._mark_complete(st, s)
    monkeypatch.setattr(actions, "_EFFECTS", effects)
    result = check(SMALL)
    assert result.violation is not None
    assert any("world size 1, outside [2, 3]" in p for p in result.violation.problems)


def test_mutation_skipping_the_last_call_breaks_conformance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Invariants still hold; only the model's guard catches the early completion."""
    skip_the_last_call(monkeypatch)
    result = check(SMALL)
    assert result.violation is not None
    (problem,) = result.violation.problems
    assert "conformance" in problem and "mark_rendezvous_complete" in problem


def test_config_errors_name_the_field() -> None:
    with pytest.raises(CheckerConfigError, match="nodes"):
        CheckConfig(nodes=0)
    with pytest.raises(CheckerConfigError, match="max_nodes"):
        CheckConfig(min_nodes=3, max_nodes=2)
    with pytest.raises(CheckerConfigError, match="max_states must be a number >= 1, got 0"):
        CheckConfig(max_states=0)
    with pytest.raises(CheckerConfigError, match="max_crashes must be a number >= 0"):
        CheckConfig(max_crashes=-1)
    with pytest.raises(CheckerConfigError, match="nodes must be a number >= 1, got '3'"):
        CheckConfig(nodes="3")  # type: ignore[arg-type]


# -- the vocabulary of states, events and timers ------------------------------------


def test_states_events_and_timers_are_enums() -> None:
    """Phases, operations, event kinds, timer values and deadlines are enum
    members (compared by identity in the search), and print as the words traces
    use."""
    checker = Checker(SMALL)
    g = checker.initial()
    assert all(loc.phase is Phase.IDLE and loc.op is None for loc in g.locals)
    (join,) = [e for e in checker.events(g) if e.slot == 0]
    assert join.kind is EventKind.JOIN and f"{join.kind}" == "join"
    concrete = list(checker.expand(g, join))
    assert {e.timers.own for e in concrete if e.timers} == {Age.FRESH}
    uncontended = [e.timers for e in concrete if e.timers and not e.timers.contended]
    assert [t.deadline for t in uncontended] == list(Deadline)
    after, _ = checker.successor(g, concrete[0])
    started = after.locals[0]
    assert started.phase is Phase.JOINING and started.op is Op.JOIN
    assert started.deadline is Deadline.BEFORE
    assert describe(after).endswith("n0=joining/join; n1=idle; n2=idle")
    assert all(isinstance(src, Lifecycle) for src, _, _ in checker.edges)


def test_deadlines_stand_for_the_times_the_core_compares() -> None:
    settings = SMALL.settings()
    assert Deadline.BEFORE.relative(settings) > 0
    assert Deadline.TIMED_OUT.relative(settings) == -settings.rollback_period
    assert Deadline.PAST.relative(settings) < -settings.rollback_period
    assert Deadline.in_time_order(settings) == (Deadline.BEFORE, Deadline.TIMED_OUT, Deadline.PAST)
    no_rollback = dataclasses.replace(settings, rollback_period=0.0)
    assert Deadline.in_time_order(no_rollback) == (Deadline.BEFORE, Deadline.PAST)
    # States that differ only in a deadline timed out or past are told apart
    # (as floats, -1.0 and -2.0 hash alike in CPython).
    checker = Checker(SMALL)
    g = checker.initial()
    a, b = (
        g._replace(locals=(Local(0, Phase.JOINING, Op.JOIN, d), *g.locals[1:]))
        for d in (Deadline.TIMED_OUT, Deadline.PAST)
    )
    assert checker.fingerprint(a)[1] != checker.fingerprint(b)[1]
    assert "timed-out" in describe(a) and "past-rollback" in describe(b)


def _fingerprints(states: list[Global]) -> list[int]:
    checker = Checker(SMALL)
    return [checker.fingerprint(g)[1] for g in states]


def test_a_forked_worker_fingerprints_states_as_the_main_process_does() -> None:
    """Workers hand back fingerprints: enum members must hash by value, the same
    in every fork."""
    checker = Checker(SMALL)
    g = checker.initial()
    states = [g]
    for event in checker.events(g):
        for concrete in list(checker.expand(g, event))[:3]:
            states.append(checker.normalize(checker.successor(g, concrete)[0]))
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(_fingerprints, (states,)) == _fingerprints(states)


def test_relabelling_moves_slots_and_renames_nodes() -> None:
    checker = Checker(SMALL)
    g = checker.initial()
    joined, _ = checker.successor(g, next(checker.expand(g, Event(EventKind.JOIN, 0))))
    moved = relabel(joined, (2, 0, 1))
    assert moved.locals[2].phase is Phase.JOINING
    assert node_of(2, 0) in moved.shared.participants
    assert checker.fingerprint(moved)[1] == checker.fingerprint(joined)[1]


def test_cli_check_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    args = "check --nodes 2 --min 1 --max 2 --max-round 0 --no-close --max-crashes 0"
    status = spec_main(args.split())
    out = capsys.readouterr().out
    assert status == 0
    for figure in ("states explored", "transitions", "depth", "seconds", "no violation"):
        assert figure in out


# -- the checker runs the driver ----------------------------------------------------


def _without_publishing(real: object) -> object:
    """A driver bug: a node that finds peers dead but whose operator would only wait
    or return does so, without publishing their removal (each peer would wait out
    the liveness window on its own)."""

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        instruction = real(view, node, settings, op, deadline, now)  # type: ignore[operator]
        if isinstance(instruction, Write) and instruction.action is None:
            action = view.decided_action
            if action is Action.SYNC:
                return Wait(None)
            if action is not None and action.is_terminal:
                return driver._done(node, op, action, view.decided_on)
        return instruction

    return decide


def test_a_driver_that_does_not_publish_a_removal_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(driver, "decide", _without_publishing(driver.decide))
    result = check(SMALL)
    assert result.violation is not None
    (problem,) = result.violation.problems
    assert "did not publish their removal" in problem
    text = result.violation.format()
    assert "0. initial" in text and "silent too long" in text and "declares dead" in text
    assert "(wait)" in text or "(done" in text
    assert "VIOLATES" in text


def test_a_driver_that_rereads_a_fresh_view_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker's view is read at the instant of the step: a Read then would be
    answered with the same view, and asked for again, forever."""
    real = driver.decide

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        instruction = real(view, node, settings, op, deadline, now)
        return Read(True) if isinstance(instruction, Wait) else instruction

    monkeypatch.setattr(driver, "decide", decide)
    result = check(SMALL)
    assert result.violation is not None
    assert any("re-read a fresh view" in p for p in result.violation.problems)


def test_a_driver_that_joins_a_closed_rendezvous_through_the_log_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search forgets a closed rendezvous's intent log: a driver that would
    announce itself in it is reported, not hidden by what the search forgot."""
    real = driver.decide

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        instruction = real(view, node, settings, op, deadline, now)
        if view.state.closed and isinstance(instruction, Done):
            return Announce(view.state.round)
        return instruction

    monkeypatch.setattr(driver, "decide", decide)
    result = check(CheckConfig(nodes=2, max_crashes=0))
    assert result.violation is not None
    assert any("intent log of closed round" in p for p in result.violation.problems)


def test_the_removal_property_reads_the_timers_not_only_the_driver() -> None:
    a, b, c = (NodeDesc(f"n{i}", 100, 0) for i in range(3))
    before = RendezvousState().evolve(
        participants={a: 0, b: 0, c: 0}, heartbeats={a: 1, b: 1, c: 1}, heartbeat_seq=1
    )
    removed = before.evolve(participants={a: 0, c: 0}, heartbeats={a: 1, c: 1})
    assert check_removal_published(a, before, {b}, {b}, removed) == []
    # b silent, but the driver declared nothing and wrote nothing
    problems = check_removal_published(a, before, {b}, set(), before)
    assert any("did not declare them dead" in p for p in problems)
    assert any("did not publish their removal" in p for p in problems)
    # c's heartbeat moved: declaring it dead is a false death
    problems = check_removal_published(a, before, {b}, {b, c}, removed)
    assert any("whose heartbeats it saw move" in p for p in problems)
    # the node found itself dead and joined again as a new entry in the same write
    again = before.evolve(participants={a: 0, b: 0, c: 0}, heartbeats={a: 2, b: 1, c: 1})
    assert check_removal_published(a, before, {a}, {a}, again) == []
    assert check_removal_published(a, before, {a}, {a}, before) != []


def test_the_checker_decides_through_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step asks rallypoint.core.driver.decide, looked up at call time."""
    real, calls = driver.decide, []

    def decide(*args: object) -> Instruction:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(driver, "decide", decide)
    result = check(dataclasses.replace(SMALL, max_states=200))
    assert result.ok and calls
    view = calls[0][0]
    assert not view.stale and view.counters_at == 0.0  # type: ignore[attr-defined]


# -- phases and batched admission ------------------------------------------------------


def test_a_phase_that_misses_the_last_call_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase without the last call: the write that arms it wakes nobody, and a
    participant already waiting sleeps past the end of the last call."""
    phase_without_the_last_call(monkeypatch)
    result = check(SMALL)
    assert result.violation is not None
    (problem,) = result.violation.problems
    assert "missed wake-up" in problem and "publishes no new phase" in problem
    text = result.violation.format()
    assert "0. initial" in text and "last-call armed" not in text.split("VIOLATES")[0]
    assert "ADD_TO_PARTICIPANTS (write)" in text and "VIOLATES" in text


def _admit_past_max_nodes(view, node, settings, op, state, now):  # type: ignore[no-untyped-def]
    """A batching bug: once the round has filled up, the remaining logged joiners
    are still made participants (the room check is skipped)."""
    log = view.intents or ()
    admitted = []
    for other in sorted({n for n in log[state.intent_cursor :] if n != node}):
        if other in state.members():
            continue
        if not state.complete:
            state = actions.apply(
                state, Action.ADD_TO_PARTICIPANTS, Context(other, state, settings, now)
            )
        else:
            seq = state.heartbeat_seq + 1
            state = state.evolve(
                participants=state.participants.set(other, len(state.participants)),
                heartbeats=state.heartbeats.set(other, seq),
                heartbeat_seq=seq,
            )
        admitted.append(other)
    return state.evolve(intent_cursor=len(log)), tuple(admitted)


def test_a_batch_past_max_nodes_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "_admit_batch", _admit_past_max_nodes)
    result = check(CheckConfig(nodes=3, min_nodes=1, max_nodes=2, max_crashes=0, allow_close=False))
    assert result.violation is not None
    assert any("exceed max_nodes 2" in p for p in result.violation.problems)
    text = result.violation.format()
    assert "announces itself in the intent log of round 0" in text
    assert "reads the intent log" in text and "admitting" in text


def test_a_batch_that_keeps_the_cursor_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cursor must move past the entries a batch admitted, or a later batch
    admits them again."""
    real = driver._admit_batch

    def keep_cursor(view, node, settings, op, state, now):  # type: ignore[no-untyped-def]
        new, admitted = real(view, node, settings, op, state, now)
        return new.evolve(intent_cursor=state.intent_cursor), admitted

    monkeypatch.setattr(driver, "_admit_batch", keep_cursor)
    result = check(SMALL)
    assert result.violation is not None
    assert any("stays past the cursor" in p for p in result.violation.problems)
    assert "I{" in result.violation.format()


def test_the_admission_properties_read_the_states() -> None:
    a, b, c, d = (NodeDesc(f"n{i}", 100, 0) for i in range(4))
    before = RendezvousState().evolve(participants={a: 0}, heartbeats={a: 1}, heartbeat_seq=1)
    # a joins b and c, both logged past the cursor; the cursor moves past them
    batch = before.evolve(
        participants={a: 0, b: 0, c: 0}, heartbeats={a: 1, b: 2, c: 3}, intent_cursor=2
    )
    assert check_admissions(a, before, before, batch, (b, c), (b, c)) == []
    # d never announced itself
    sneaky = batch.evolve(
        participants={a: 0, b: 0, c: 0, d: 0}, heartbeats={a: 1, b: 2, c: 3, d: 4}
    )
    problems = check_admissions(a, before, before, sneaky, (b, c, d), (b, c))
    assert any("did not announce" in p for p in problems)
    # the write admits c without saying so
    assert any("names" in p for p in check_admissions(a, before, before, batch, (b,), (b, c)))
    # the cursor stays: b and c could be admitted again
    kept = batch.evolve(intent_cursor=0)
    problems = check_admissions(a, before, before, kept, (b, c), (b, c))
    assert sum("stays past the cursor" in p for p in problems) == 2
    # the cursor goes back, or past the end of the log
    moved = before.evolve(intent_cursor=1)
    assert any("went back" in p for p in check_admissions(a, moved, moved, before, (), (b,)))
    assert any("past the end" in p for p in check_admissions(a, before, before, moved, (), ()))
    # a waiting node is admitted through its entry, never from the wait list alone
    waiting = before.evolve(wait_list={d}, heartbeats={a: 1, d: 2})
    promoted = waiting.evolve(participants={a: 0, d: 0}, wait_list=set(), intent_cursor=1)
    assert check_admissions(a, waiting, waiting, promoted, (d,), (d,)) == []
    unasked = waiting.evolve(participants={a: 0, d: 0}, wait_list=set())
    problems = check_admissions(a, waiting, waiting, unasked, (d,), ())
    assert any("did not announce" in p for p in problems)
    # a new round's cursor counts the new round's log, from 0
    advanced = before.evolve(round=1, participants={}, heartbeats={}, intent_cursor=2)
    assert any(
        "past the end" in p for p in check_admissions(a, before, before, advanced, (), (b, c))
    )


def test_a_joiner_that_announces_before_publishing_a_removal_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A contended joiner that finds a peer dead must publish the removal first,
    not announce itself (and read the log) while the dead peer stays in the state."""
    real = driver.decide

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        instruction = real(view, node, settings, op, deadline, now)
        decision = Decision.of(instruction, view)
        if (
            view.contended
            and decision.dead
            and decision.action is Action.ADD_TO_PARTICIPANTS
            and view.announced != decision.state.round
            and isinstance(instruction, Write)
        ):
            return Announce(decision.state.round)
        return instruction

    monkeypatch.setattr(driver, "decide", decide)
    result = check(SMALL)
    assert result.violation is not None
    assert any("did not publish their removal" in p for p in result.violation.problems)
    text = result.violation.format()
    assert "(contended)" in text and "announces itself" in text and "declares dead" in text


# -- each reduction of the search keeps finding the bugs it could hide ---------------


def test_a_bug_past_the_deadline_after_a_removal_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deadline subsumption stores a step's successor only with the earliest
    deadline that makes the same step: a joiner that published a removal with its
    deadline long past is stored with its deadline still ahead. A bug that shows
    only on such a joiner's next step is still found: that step may choose the
    passed deadline."""
    real = driver.decide

    def decide(view, node, settings, op, deadline, now):  # type: ignore[no-untyped-def]
        instruction = real(view, node, settings, op, deadline, now)
        decision = Decision.of(instruction, view)
        state = decision.state
        if (
            isinstance(instruction, Done)
            and decision.action is Action.FINISH
            and deadline < now - settings.rollback_period
            and state.complete
            and len(state.participants) < state.world_size
        ):
            # the bug: a late joiner of a round that lost a member grows its world
            bad = state.evolve(world_size=state.world_size + 1)
            return Write(bad, Action.SYNC, frozenset())
        return instruction

    monkeypatch.setattr(driver, "decide", decide)
    result = check(SMALL)
    assert result.violation is not None
    assert any("world size of complete round" in p for p in result.violation.problems)
    text = result.violation.format()
    assert "rollback over" in text and "declares dead" in text


def test_a_wrong_return_is_found_without_keeping_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Returns are checked against the state they return on, not kept for a later
    agreement check: a join that returns a rank the state does not give is found
    where it returns."""
    real = driver._done

    def done(node, op, action, state):  # type: ignore[no-untyped-def]
        result = real(node, op, action, state)
        if result.joined is not None and result.joined.rank == 0:
            return result._replace(joined=result.joined._replace(rank=1))
        return result

    monkeypatch.setattr(driver, "_done", done)
    result = check(SMALL)
    assert result.violation is not None
    assert any("returned rank 1; the state gives it 0" in p for p in result.violation.problems)


def test_a_round_that_completes_twice_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without kept returns, agreement between two returns of one round rests on
    the step property that a complete round stays complete (with its ranks) until
    it advances. A round that reopens after an exit, and may complete again with
    other members under the same number, is found."""
    real = actions.remove_participant_epilogue

    def epilogue(state, settings):  # type: ignore[no-untyped-def]
        state = real(state, settings)
        if state.complete:
            return state.evolve(complete=False, world_size=0)
        return state

    monkeypatch.setattr(actions, "remove_participant_epilogue", epilogue)
    result = check(SMALL)
    assert result.violation is not None
    assert any("became incomplete without advancing" in p for p in result.violation.problems)


def test_the_cli_is_quiet_off_a_terminal_and_with_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ([], ["--quiet"]):
        code = spec_main(["check", "--nodes", "2", "--max", "2", "--max-states", "300", *extra])
        out, err = capsys.readouterr()
        assert code == 0 and "states explored: 300" in out
        assert err == ""


@pytest.mark.slow
def test_parallel_workers_explore_the_same_space_and_find_planted_bugs(
    monkeypatch: pytest.MonkeyPatch, small_search: CheckResult
) -> None:
    sequential, parallel = small_search, check(SMALL, workers=2)
    assert parallel.ok and parallel.complete
    assert_same_space(parallel, sequential)
    # a bug planted before the search is in every worker (they are forks)
    monkeypatch.setattr(
        actions, "assign_ranks", lambda parts, prev=None: dict.fromkeys(sorted(parts), 0)
    )
    result = check(SMALL, workers=2)
    assert result.violation is not None
    assert any("duplicate ranks" in p for p in result.violation.problems)
    assert "0. initial" in result.violation.format()


def test_a_lease_that_outlives_the_liveness_window_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Self-fencing: a node declared dead while it trains must already have been
    told to stop its workers. A lease longer than the window its peers wait is
    found the first time a training node is declared dead."""
    from rallypoint.core import liveness

    monkeypatch.setattr(liveness, "fence_after", lambda s: s.liveness_window + 1.0)
    result = check(SMALL)
    assert result.violation is not None
    assert any(p.startswith("lease: ") for p in result.violation.problems)
    assert any("declared dead" in line for line in result.violation.trace)
