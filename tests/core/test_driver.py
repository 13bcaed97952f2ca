"""The driver: one node's loop as a pure function. Each of its rules, one test each."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.core_scenarios import FAR, joined, node, settings, step
from helpers.core_strategies import (
    POOL,
    any_settings,
    any_states,
    counters,
    nodes,
    nodes_and_views,
    times,
)
from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st
from immutables import Map

from rallypoint.core import (
    Action,
    Announce,
    Beat,
    CloseOp,
    Decision,
    Done,
    ExitOp,
    InvalidTransitionError,
    JoinOp,
    KeepAliveOp,
    Membership,
    NodeDesc,
    NodeView,
    Read,
    RendezvousState,
    Settings,
    Verdict,
    Wait,
    Write,
    after_announce,
    after_beat,
    after_read,
    after_wait,
    after_write,
    decide,
    driver,
    heartbeat_of,
    phase_of,
    watch,
)
from rallypoint.core.driver import _VIEW_SLOTS, MemberResponse, member_response

S = settings(2, 3)  # keep-alive 1 s, liveness window 3 s, last call 10 s


def _counters(state: RendezvousState, value: int = 0) -> dict:
    return dict.fromkeys(state.heartbeats, value)


def _decision(decider, view: NodeView, *args) -> Decision:  # type: ignore[no-untyped-def]
    """What ``decider`` (decide or watch) decides on ``view``, and on what."""
    return Decision.of(decider(view, *args), view)


def _view(
    state: RendezvousState,
    now: float = 0.0,
    counters: dict | None = None,
    me: NodeDesc | None = None,
) -> NodeView:
    """A view (of node ``me``, default node(0)) that read ``state`` and its counters
    at ``now``."""
    side = _counters(state) if counters is None else counters
    return after_read(NodeView(), me or node(0), state, side, now)


def test_a_new_view_reads_the_state_first_without_the_counters() -> None:
    d = _decision(decide, NodeView(), node(0), S, JoinOp(), FAR, 0.0)
    assert d.instruction == Read(False)
    assert d.action is None


def test_routine_reads_fetch_the_counters_every_half_liveness_window() -> None:
    view = _view(RendezvousState(), now=0.0)  # read with counters at 0
    waited = after_wait(view)
    assert decide(waited, node(0), S, JoinOp(), FAR, 1.5) == Read(False)
    assert decide(waited, node(0), S, JoinOp(), FAR, 1.6) == Read(True)
    # A view that never read counters counts from its first read.
    first = after_wait(after_read(NodeView(), node(0), RendezvousState(), None, 10.0))
    assert decide(first, node(0), S, JoinOp(), FAR, 11.0) == Read(False)
    assert decide(first, node(0), S, JoinOp(), FAR, 11.6) == Read(True)


def test_due_counters_are_read_even_on_a_view_that_is_not_stale() -> None:
    """A view kept fresh by reads without counters (an agent's closed-check, a
    keep-alive on the cached view) must still see its peers' counters every half
    window, or a killed peer goes unnoticed until its state entry ages out."""
    state = joined([node(0), node(1), node(2)], S)
    view = _view(state, now=0.0)
    membership = decide(view, node(0), S, JoinOp(), FAR, 0.0).joined
    # re-read without counters at 1.4: fresh, but its counters were read at 0
    refreshed = after_read(view, node(0), state, None, 1.4)
    assert watch(refreshed, node(0), S, membership, 1.5) == Verdict(0, frozenset())
    assert watch(refreshed, node(0), S, membership, 1.6) == Read(True)
    assert decide(refreshed, node(0), S, KeepAliveOp(), FAR, 1.6) == Read(True)


def test_join_writes_the_core_action_in_blob_form() -> None:
    d = _decision(decide, _view(RendezvousState()), node(0), S, JoinOp(), FAR, 0.0)
    assert isinstance(d.instruction, Write)
    assert d.instruction.action is Action.ADD_TO_PARTICIPANTS
    blob = d.instruction.state
    assert node(0) in blob.participants
    # Blob counters are small: the side counter is not folded into them.
    assert blob.heartbeats[node(0)] == blob.heartbeat_seq == 1


def test_a_write_win_then_sync_waits_until_the_next_local_timer() -> None:
    view = _view(RendezvousState(), now=0.0)
    write = decide(view, node(0), S, JoinOp(), FAR, 0.0)
    assert isinstance(write, Write)
    view = after_write(view, node(0), True, write.state, 0.0)
    d = _decision(decide, view, node(0), S, JoinOp(), FAR, 0.0)
    # Alone below min_nodes: wait for a change or the own keep-alive (1 s).
    assert d.instruction == Wait(1.0, view.state.phase)


def test_a_due_keep_alive_of_a_member_beats_instead_of_rewriting_the_blob() -> None:
    state = joined([node(0)], S)
    view = _view(state, now=0.0)
    assert decide(view, node(0), S, KeepAliveOp(), FAR, 0.5) == Done(Action.FINISH, view.state)
    assert decide(view, node(0), S, KeepAliveOp(), FAR, 1.0) == Beat()


def test_a_beat_moves_the_watched_counter_and_restarts_the_own_timer() -> None:
    state = joined([node(0)], S)
    view = _view(state, now=0.0)
    before = view.own.counter
    beaten = after_beat(view, node(0), 1, 1.0)
    assert beaten.own.counter == before + 1
    assert beaten.own.since == 1.0
    assert decide(beaten, node(0), S, KeepAliveOp(), FAR, 1.5).action is Action.FINISH


def test_a_peer_is_never_declared_dead_on_cached_counters() -> None:
    state = joined([node(0), node(1)], S)
    view = _view(state, now=0.0)
    # 5 s later node(1) looks silent, but the counters are 5 s old: read them first.
    d = _decision(decide, view, node(0), S, JoinOp(), FAR, 5.0)
    assert d.instruction == Read(True)
    assert d.dead == frozenset()


def test_a_peer_whose_counter_moved_meanwhile_is_alive() -> None:
    state = joined([node(0), node(1)], S)
    view = _view(state, now=0.0)
    view = after_beat(view, node(0), 5, 4.9)  # our own beat keeps us fresh
    fresh = after_read(view, node(0), state, {node(0): 5, node(1): 7}, 5.0)
    d = _decision(decide, fresh, node(0), S, JoinOp(), FAR, 5.0)
    assert d.dead == frozenset()
    assert not isinstance(d.instruction, Write) or not d.instruction.dead


def test_dead_peers_found_on_fresh_counters_are_published_even_when_the_op_waits() -> None:
    state = joined([node(0), node(1)], S)
    view = _view(state, now=0.0)
    view = after_beat(view, node(0), 3, 5.0)  # node(0) renewed at 5
    view = after_read(view, node(0), state, {node(0): 3, node(1): 0}, 5.0)
    d = _decision(decide, view, node(0), S, JoinOp(), FAR, 5.0)
    assert d.action is Action.SYNC
    assert isinstance(d.instruction, Write)
    assert d.instruction.action is None and d.instruction.dead == {node(1)}
    assert node(1) not in d.instruction.state.participants
    assert node(1) not in d.instruction.state.heartbeats


def test_dead_peers_are_published_before_a_terminal_answer() -> None:
    state = joined([node(0), node(1)], S)
    view = after_read(_view(state), node(0), state, {node(0): 3, node(1): 0}, 5.0)
    d = _decision(decide, view, node(0), S, CloseOp(), 0.0, 5.0)  # close timed out
    assert d.action is Action.ERROR_TIMEOUT
    assert isinstance(d.instruction, Write) and d.instruction.dead == {node(1)}


def test_a_rejoining_node_never_repeats_a_watched_counter() -> None:
    """Leave and rejoin without beating in between: an observer that missed both
    must still see the counter move (the side counter did not)."""
    first = joined([node(0), node(1)], S)
    seen = heartbeat_of(first.heartbeats[node(1)], 2)
    view = _view(first, counters={node(0): 0, node(1): 2}, me=node(1))
    exit_write = decide(view, node(1), S, ExitOp(), FAR, 0.0)
    assert isinstance(exit_write, Write)
    left = after_write(view, node(1), True, exit_write.state, 0.0)
    join_write = decide(left, node(1), S, JoinOp(), FAR, 0.0)
    assert isinstance(join_write, Write)
    assert heartbeat_of(join_write.state.heartbeats[node(1)], 2) != seen


def test_only_a_write_that_changes_what_waiters_decide_on_publishes_a_phase() -> None:
    s = settings(3, 5)
    state = joined([node(0)], s)
    view = _view(state, me=node(1))
    second = decide(view, node(1), s, JoinOp(), FAR, 0.0)
    # One more participant below min_nodes: nobody waiting decides differently.
    assert isinstance(second, Write) and second.phase is None
    assert second.state.phase == state.phase
    view = after_write(view, node(1), True, second.state, 0.0)
    third = decide(_view(second.state, me=node(2)), node(2), s, JoinOp(), FAR, 0.0)
    # The third arms the last call: every participant must start its timer.
    assert isinstance(third, Write) and third.state.last_call is not None
    assert third.phase == third.state.phase == state.phase + 1
    assert phase_of(third.state, s) != phase_of(second.state, s)


def test_a_waiting_node_waits_for_the_phase_it_read() -> None:
    state = joined([node(0), node(1)], settings(3, 5)).evolve(phase=7)
    d = _decision(decide, _view(state), node(0), settings(3, 5), JoinOp(), FAR, 0.0)
    assert isinstance(d.instruction, Wait) and d.instruction.phase == 7


def test_a_contended_joiner_announces_then_admits_every_logged_joiner_in_one_write() -> None:
    s = settings(2, 5)
    state = joined([node(0)], s)
    view = _view(state, me=node(3))
    first = decide(view, node(3), s, JoinOp(), FAR, 0.0)
    assert isinstance(first, Write)
    # The CAS lost: another joiner wrote first (same state, for the test).
    lost = after_write(view, node(3), False, state, 0.0)
    assert decide(lost, node(3), s, JoinOp(), FAR, 0.0) == Announce(0)
    announced = after_announce(lost, 0)
    read = decide(announced, node(3), s, JoinOp(), FAR, 0.0)
    # Read the state again with the log (a batch on the state the lost CAS returned
    # would lose to single joiners).
    assert read == Read(False, intents=True)
    log = [node(2), node(3), node(1), node(2)]
    with_log = after_read(announced, node(3), state, None, 0.0, log)
    d = _decision(decide, with_log, node(3), s, JoinOp(), FAR, 0.0)
    write = d.instruction
    assert isinstance(write, Write) and write.action is Action.ADD_TO_PARTICIPANTS
    assert set(write.admitted) == {node(1), node(2)}
    assert set(write.state.participants) == {node(0), node(1), node(2), node(3)}
    assert write.state.intent_cursor == len(log)
    # The batch armed the last call: a new phase for the waiters.
    assert write.phase == state.phase + 1
    # A later batch starts past the cursor: nobody is admitted twice.
    later = after_read(NodeView(), node(4), write.state, {}, 0.0, [*log, node(5), node(4)])
    later.contended = True
    later = after_announce(later, 0)
    later = after_read(later, node(4), write.state, {}, 0.0, [*log, node(5), node(4)])
    batch = decide(later, node(4), s, JoinOp(), FAR, 0.0)
    assert isinstance(batch, Write) and batch.admitted == (node(5),)
    assert batch.state.intent_cursor == len(log) + 2


def test_a_batch_admits_a_waiting_node_only_through_its_entry_in_the_log() -> None:
    """A waiting node takes a place in the open round only by acting: its own write
    or its entry in the round's log. From the wait list alone, a node that never
    acts again (its agent stuck, its heartbeat alive) would hold a place in a round
    it never trains in, and every peer would wait on it."""
    s = settings(2, 5)
    state = joined([node(0), node(1)], s)
    state = step(state, node(0), Action.MARK_RENDEZVOUS_COMPLETE, s)
    state = step(state, node(4), Action.ADD_TO_WAIT_LIST, s)
    state = step(state, node(5), Action.ADD_TO_WAIT_LIST, s)
    for n in (node(0), node(1)):  # both leave the round to rejoin: the next one opens
        state = step(state, n, Action.REMOVE_FROM_PARTICIPANTS, s)
    assert not state.complete and state.wait_list == {node(4), node(5)}
    view = after_write(_view(state, me=node(2)), node(2), False, state, 0.0)
    view = after_announce(view, state.round)
    view = after_read(view, node(2), state, None, 0.0, [node(5)])
    write = decide(view, node(2), s, JoinOp(), FAR, 0.0)
    assert isinstance(write, Write) and write.admitted == (node(5),)
    assert node(5) in write.state.participants
    assert node(4) in write.state.wait_list and node(4) not in write.state.participants


def test_a_batch_stops_admitting_participants_at_max_nodes() -> None:
    s = settings(2, 3)
    state = RendezvousState()
    view = after_write(_view(state, me=node(0)), node(0), False, state, 0.0)
    view = after_announce(view, 0)
    view = after_read(view, node(0), state, None, 0.0, [node(1), node(2), node(3), node(4)])
    write = decide(view, node(0), s, JoinOp(), FAR, 0.0)
    assert isinstance(write, Write)
    final = write.state
    assert final.complete and set(final.participants) == {node(0), node(1), node(2)}
    # The round filled: the rest stand by as torch's join rule says.
    assert final.redundancy_list == {node(3), node(4)}


def test_a_finished_join_reports_its_membership() -> None:
    state = joined([node(0), node(1), node(2)], S)  # max_nodes reached: complete
    d = _decision(decide, _view(state), node(1), S, JoinOp(), FAR, 0.0)
    assert isinstance(d.instruction, Done)
    assert d.instruction.action is Action.FINISH and not d.instruction.rejoin
    membership = d.instruction.joined
    assert membership is not None
    assert (membership.round, membership.rank, membership.world_size) == (0, 1, 3)
    assert membership.members == {node(0), node(1), node(2)}


def test_a_round_that_lost_its_rank_0_is_rejoined() -> None:
    state = joined([node(0), node(1), node(2)], S)
    without_rank0 = step(state, node(0), Action.REMOVE_FROM_PARTICIPANTS, S)
    d = _decision(decide, _view(without_rank0), node(1), S, JoinOp(), FAR, 0.0)
    assert isinstance(d.instruction, Done) and d.instruction.rejoin


def test_a_redundant_node_that_becomes_a_joiner_gets_a_fresh_deadline() -> None:
    s = settings(1, 1, join_timeout=50.0)
    state = joined([node(0)], s)
    state = step(state, node(1), Action.ADD_TO_REDUNDANCY_LIST, s)
    state = step(state, node(0), Action.REMOVE_FROM_PARTICIPANTS, s)  # room again
    d = _decision(decide, _view(state, now=7.0), node(1), s, JoinOp(), 9.0, 7.0)
    assert isinstance(d.instruction, Write)
    assert d.instruction.action is Action.REMOVE_FROM_REDUNDANCY_LIST
    assert d.instruction.deadline == 57.0


def test_watch_reports_waiting_nodes_and_lost_participants() -> None:
    state = joined([node(0), node(1), node(2)], S)
    membership = decide(_view(state), node(0), S, JoinOp(), FAR, 0.0).joined
    assert watch(_view(state), node(0), S, membership, 0.0) == Verdict(0, frozenset())
    left = step(state, node(2), Action.REMOVE_FROM_PARTICIPANTS, S)
    waiting = step(left, node(3), Action.ADD_TO_WAIT_LIST, S)
    verdict = watch(_view(waiting), node(0), S, membership, 0.0)
    assert verdict == Verdict(1, frozenset({node(2)}))


def test_watch_publishes_a_dead_participant_then_reports_it_lost() -> None:
    state = joined([node(0), node(1), node(2)], S)
    membership = decide(_view(state), node(0), S, JoinOp(), FAR, 0.0).joined
    assert membership is not None
    # node(0) and node(2) moved at t=5, node(1) stood still since t=0.
    view = after_read(_view(state), node(0), state, {node(0): 3, node(1): 0, node(2): 4}, 5.0)
    d = _decision(watch, view, node(0), S, membership, 5.0)
    assert isinstance(d.instruction, Write) and d.instruction.dead == {node(1)}
    after = after_write(view, node(0), True, d.instruction.state, 5.0)
    verdict = watch(after, node(0), S, membership, 5.0)
    assert verdict == Verdict(0, frozenset({node(1)}))


def test_watch_of_a_round_that_moved_on_loses_everyone() -> None:
    state = joined([node(0), node(1), node(2)], S)
    membership = decide(_view(state), node(0), S, JoinOp(), FAR, 0.0).joined
    later = state.evolve(round=1, complete=False, world_size=0, participants=Map())
    later = later.evolve(heartbeats=Map({node(0): 1}))
    verdict = watch(_view(later), node(0), S, membership, 0.0)
    assert verdict == Verdict(0, membership.members)


def test_a_member_regroups_on_waiting_or_lost_nodes_and_stops_on_a_close() -> None:
    state = joined([node(0), node(1)], S)
    quiet, lost, waiting = (
        Verdict(0, frozenset()),
        Verdict(0, frozenset({node(1)})),
        Verdict(2, frozenset()),
    )
    assert member_response(quiet, state) is MemberResponse.CARRY_ON
    assert member_response(lost, state) is MemberResponse.REGROUP
    assert member_response(waiting, state) is MemberResponse.REGROUP
    closed = state.evolve(closed=True)
    for verdict in (quiet, lost, waiting):
        assert member_response(verdict, closed) is MemberResponse.CLOSED


# --- properties over views of every shape ----------------------------------------


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


def test_a_copy_of_a_view_changes_apart_from_it():
    view = after_read(NodeView(), POOL[0], RendezvousState(), {}, 1.0)
    kept = view.copy()
    assert kept == view and kept is not view
    after_wait(view)
    assert view.stale and not kept.stale
    assert dataclasses.replace(kept, stale=True) == view


def _outcome(view: NodeView, node: NodeDesc, s: Settings, op: object, deadline: float, now: float):  # type: ignore[no-untyped-def]
    """The decision, or the error it raised (states of every shape are drawn, and
    applying an action to some of them is refused)."""
    try:
        return Decision.of(decide(view, node, s, op, deadline, now), view)  # type: ignore[arg-type]
    except Exception as error:  # compared below, not swallowed
        return type(error), str(error)


@examples(1000)
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


@examples(300)
@given(nodes_and_views(), any_settings(), times, times, st.booleans())
def test_decide_changes_nothing_in_the_view_but_the_record_of_the_decision(
    node_view, s, now, deadline, leaving
):
    """decide and watch only read the view, and leave in it what they decided on
    (Decision.of): a copy taken before compares equal after, field by field."""
    node, view = node_view
    op = ExitOp() if leaving else JoinOp()
    for decider in (
        lambda: decide(view, node, s, op, deadline, now),
        lambda: driver.watch(view, node, s, None, now),
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


_DECISION_RECORD = {"decided_action", "decided_on", "declared_dead", "_removal"}


@examples(300)
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
    s = Settings("properties", 1, 3)
    me, moved, silent = POOL[:3]
    state = RendezvousState(wait_list={me, moved, silent}, heartbeats={me: 1, moved: 1, silent: 1})
    view = after_read(NodeView(), me, state, {moved: 0, silent: 0}, 0.0)
    now = s.liveness_window + 1  # both peers silent since 0, the counters read now
    after_read(view, me, state, {moved: 0, silent: 0}, now)
    driver.watch(view, me, s, None, now)
    assert view.declared_dead == {moved, silent}
    after_read(view, me, state, {moved: 1, silent: 0}, now)
    driver.watch(view, me, s, None, now)
    assert view.declared_dead == {silent}


def _monitored(view: NodeView, node: NodeDesc, s: Settings, now: float):  # type: ignore[no-untyped-def]
    """watch's decision, or the error it raised (see _outcome)."""
    try:
        return Decision.of(driver.watch(view, node, s, None, now), view)
    except Exception as error:  # compared below, not swallowed
        return type(error), str(error)


def test_the_phase_parts_in_force_decide_what_a_write_publishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write publishes a phase when it changes a part of PHASE_PARTS: with the
    parts edited down to the round, arming the last call wakes nobody."""
    s = Settings("properties", 1, 3)
    view = after_read(NodeView(), POOL[0], RendezvousState(), None, 0.0)
    write = decide(view, POOL[0], s, JoinOp(), 10.0, 0.0)
    assert isinstance(write, Write) and write.phase == 1  # the join arms the last call
    monkeypatch.setattr(driver, "PHASE_PARTS", ("state.round",))
    write = decide(view, POOL[0], s, JoinOp(), 10.0, 0.0)
    assert isinstance(write, Write) and write.phase is None and write.state.phase == 0
    assert phase_of(write.state, s) == (0,)


@given(any_states(), any_states(), any_settings())
def test_two_states_have_the_same_phase_when_their_parts_are_equal(first, second, s):
    """The write's part-by-part comparison agrees with phase_of's tuples (both
    compiled from PHASE_PARTS), for states of every shape and equal ones."""
    same = driver._phase_rules()[1]
    assert same(first, second, s) is (phase_of(first, s) == phase_of(second, s))
    assert same(first, first.evolve(phase=first.phase + 1, heartbeat_seq=9), s)
