"""Operators: (context, deadline) -> Action. The decisions of the rendezvous.

An operator looks at one node's view (the shared state it last read, its settings,
its local observations, and the local time ``now``) and names the next action. The
caller (an adapter, the simulator, the model checker) applies the action, writes the
state with compare-and-set, re-reads on conflict and asks again, until the operator
answers a terminal action.

The join operator is a decision table (:data:`JOIN_TABLE`): ordered rows, the first
row whose guard holds gives the action. It is torch's ``_RendezvousJoinOp`` with the
wall-clock comparisons replaced by local observations (docs/design.md, decision 2).

``deadline`` and ``now`` are on the node's own monotonic clock; nothing here reads
a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from immutables import Map

from .actions import Action
from .state import (
    Context,
    HeartbeatSighting,
    LastCallSighting,
    NodeDesc,
    Observations,
    RendezvousState,
    Settings,
)

__all__ = [
    "JOIN_TABLE",
    "ChargeRestartOp",
    "CloseOp",
    "Context",
    "ExcludeOp",
    "ExitOp",
    "JoinOp",
    "JoinRow",
    "KeepAliveOp",
    "LeaveOp",
    "Operator",
    "everyone_back",
    "join_row",
    "keep_alive_due",
    "last_call_passed",
    "wake_at",
]


Operator = Callable[[Context, float], Action]


def keep_alive_due(ctx: Context) -> bool:
    """The node has a heartbeat entry whose counter it last saw move at least
    ``keep_alive_interval`` ago (its own beat included)."""
    sighting = ctx.observations.heartbeats.get(ctx.node)
    return _beat_due(ctx.node, ctx.state, ctx.settings, ctx.now, sighting)


def last_call_passed(ctx: Context) -> bool:
    """The last call is armed and this node saw it armed over ``last_call_timeout`` ago."""
    return _last_call_over(ctx.state, ctx.settings, ctx.now, ctx.observations.last_call)


def everyone_back(state: RendezvousState) -> bool:
    """The open round is a regroup that expects nobody else: every participant of
    the last complete round that is not known gone has joined it, and nobody
    else did (:attr:`RendezvousState.regroup`), nobody waits, and no spare may
    join (a redundant node whose exclusion is not running). A last call would
    only wait for nodes that are known not to come: the round completes at
    quorum. A round that may still see a newcomer (the first one, or one a
    newcomer joined or waits for) keeps its last call."""
    if state.complete or not state.regroup or state.returning or state.wait_list:
        return False
    spares = state.redundancy_list
    if not spares:
        return True
    excluded, round_ = state.excluded, state.round
    return all(excluded.get(node, 0) > round_ for node in spares)


def _timed_out(ctx: Context, deadline: float) -> bool:
    return ctx.now > deadline


def _within_rollback(ctx: Context, deadline: float) -> bool:
    return ctx.now <= deadline + ctx.settings.rollback_period


def _full(ctx: Context) -> bool:
    return len(ctx.state.participants) >= ctx.settings.max_nodes


def _quorum(ctx: Context) -> bool:
    return ctx.settings.min_nodes <= len(ctx.state.participants) <= ctx.settings.max_nodes


@dataclass(frozen=True)
class JoinRow:
    """One row of the join decision table: if ``guard(ctx, deadline)`` then ``action``."""

    name: str
    guard: Callable[[Context, float], bool]
    action: Action


#: torch's join decision, top to bottom; the first row whose guard holds decides.
JOIN_TABLE: tuple[JoinRow, ...] = (
    JoinRow(
        "closed while redundant: leave quietly",
        lambda c, d: c.state.closed and c.is_redundant,
        Action.ERROR_GRACEFUL_EXIT,
    ),
    JoinRow("closed", lambda c, d: c.state.closed, Action.ERROR_CLOSED),
    JoinRow(
        "excluded: stand by as redundant",
        lambda c, d: c.is_excluded and not (c.is_redundant or c.is_participant or c.is_waiting),
        Action.ADD_TO_REDUNDANCY_LIST,
    ),
    JoinRow(
        "redundant, round full or excluded, keep-alive due",
        lambda c, d: c.is_redundant and (_full(c) or c.is_excluded) and keep_alive_due(c),
        Action.KEEP_ALIVE,
    ),
    JoinRow(
        "redundant, round full or excluded",
        lambda c, d: c.is_redundant and (_full(c) or c.is_excluded),
        Action.SYNC,
    ),
    JoinRow(
        "redundant, round has room: become a regular joiner",
        lambda c, d: c.is_redundant,
        Action.REMOVE_FROM_REDUNDANCY_LIST,
    ),
    JoinRow(
        "complete and a participant: done",
        lambda c, d: c.state.complete and c.is_participant,
        Action.FINISH,
    ),
    JoinRow(
        "timed out, within rollback, participant: withdraw",
        lambda c, d: _timed_out(c, d) and _within_rollback(c, d) and c.is_participant,
        Action.REMOVE_FROM_PARTICIPANTS,
    ),
    JoinRow(
        "timed out, within rollback, waiting: withdraw",
        lambda c, d: _timed_out(c, d) and _within_rollback(c, d) and c.is_waiting,
        Action.REMOVE_FROM_WAIT_LIST,
    ),
    JoinRow("timed out", _timed_out, Action.ERROR_TIMEOUT),
    JoinRow(
        "complete with capacity: wait for the next round",
        lambda c, d: c.state.complete and not _full(c) and not c.is_waiting,
        Action.ADD_TO_WAIT_LIST,
    ),
    JoinRow(
        "complete and full: stand by as redundant",
        lambda c, d: c.state.complete and _full(c) and not c.is_waiting,
        Action.ADD_TO_REDUNDANCY_LIST,
    ),
    JoinRow(
        "participant, quorum, last call passed: complete the round",
        lambda c, d: (
            not c.state.complete and c.is_participant and _quorum(c) and last_call_passed(c)
        ),
        Action.MARK_RENDEZVOUS_COMPLETE,
    ),
    JoinRow(
        "participant, quorum, everyone expected back: complete the round",
        lambda c, d: (
            not c.state.complete and c.is_participant and _quorum(c) and everyone_back(c.state)
        ),
        Action.MARK_RENDEZVOUS_COMPLETE,
    ),
    JoinRow(
        "round open, not a participant: join",
        lambda c, d: not c.state.complete and not c.is_participant,
        Action.ADD_TO_PARTICIPANTS,
    ),
    JoinRow("keep-alive due", lambda c, d: keep_alive_due(c), Action.KEEP_ALIVE),
    JoinRow("otherwise: wait for a change", lambda c, d: True, Action.SYNC),
)


def join_row(ctx: Context, deadline: float) -> JoinRow:
    """The row of :data:`JOIN_TABLE` that decides for ``ctx`` (for tests and tracing)."""
    for row in JOIN_TABLE:
        if row.guard(ctx, deadline):
            return row
    raise AssertionError("the last row of JOIN_TABLE always matches")  # pragma: no cover


_JOIN_TABLE_AS_DEFINED = JOIN_TABLE
# A member read off its enum class goes through EnumType's __getattr__ hook, several
# times the cost of a global: the operators, run on every step, return these.
_ERROR_GRACEFUL_EXIT = Action.ERROR_GRACEFUL_EXIT
_ERROR_CLOSED = Action.ERROR_CLOSED
_KEEP_ALIVE = Action.KEEP_ALIVE
_SYNC = Action.SYNC
_REMOVE_FROM_REDUNDANCY_LIST = Action.REMOVE_FROM_REDUNDANCY_LIST
_FINISH = Action.FINISH
_REMOVE_FROM_PARTICIPANTS = Action.REMOVE_FROM_PARTICIPANTS
_REMOVE_FROM_WAIT_LIST = Action.REMOVE_FROM_WAIT_LIST
_ERROR_TIMEOUT = Action.ERROR_TIMEOUT
_ADD_TO_REDUNDANCY_LIST = Action.ADD_TO_REDUNDANCY_LIST
_ADD_TO_WAIT_LIST = Action.ADD_TO_WAIT_LIST
_ADD_TO_PARTICIPANTS = Action.ADD_TO_PARTICIPANTS
_MARK_RENDEZVOUS_COMPLETE = Action.MARK_RENDEZVOUS_COMPLETE


class JoinOp:
    """Join the next round: become a participant and wait until the round completes."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        """:data:`JOIN_TABLE`'s answer (see :func:`_join_answer`)."""
        seen = ctx.observations
        sighting = seen.heartbeats.get(ctx.node)
        return _join_answer(
            ctx.node, ctx.state, ctx.settings, ctx.now, sighting, seen.last_call, deadline
        )


def _join_answer(
    node: NodeDesc,
    state: RendezvousState,
    settings: Settings,
    now: float,
    sighting: HeartbeatSighting | None,
    last_call: LastCallSighting | None,
    deadline: float,
) -> Action:
    """:data:`JOIN_TABLE`'s answer for the context of these fields, reached without
    walking it: the same rows in the same order, with each fact the guards share
    read once instead of once per row (tests/test_core_speedups.py checks that both
    agree). ``sighting`` is the deciding node's sighting of its own counter and
    ``last_call`` the last-call sighting (the two sightings the table reads). The
    driver calls it with the fields, building no :class:`Context`."""
    if JOIN_TABLE is not _JOIN_TABLE_AS_DEFINED:
        # A table swapped in (the checker's mutation tests do) is walked as given.
        beats = Map() if sighting is None else Map({node: sighting})
        seen = Observations(heartbeats=beats, last_call=last_call)
        return join_row(Context(node, state, settings, now, seen), deadline).action
    # (An empty set is told apart without hashing the node.)
    redundancy = state.redundancy_list
    redundant = node in redundancy if redundancy else False
    if state.closed:
        return _ERROR_GRACEFUL_EXIT if redundant else _ERROR_CLOSED
    participants = state.participants
    full = len(participants) >= settings.max_nodes
    participant = node in participants
    excluded = bool(state.excluded) and state.excluded.get(node, 0) > state.round
    if excluded and not (redundant or participant or node in state.wait_list):
        return _ADD_TO_REDUNDANCY_LIST
    if redundant:
        if full or excluded:
            return _KEEP_ALIVE if _beat_due(node, state, settings, now, sighting) else _SYNC
        return _REMOVE_FROM_REDUNDANCY_LIST
    complete = state.complete
    if complete and participant:
        return _FINISH
    if now > deadline:
        if now <= deadline + settings.rollback_period:
            if participant:
                return _REMOVE_FROM_PARTICIPANTS
            if node in state.wait_list:
                return _REMOVE_FROM_WAIT_LIST
        return _ERROR_TIMEOUT
    if complete:
        if node not in state.wait_list:
            return _ADD_TO_REDUNDANCY_LIST if full else _ADD_TO_WAIT_LIST
    elif not participant:
        return _ADD_TO_PARTICIPANTS
    elif settings.min_nodes <= len(participants) <= settings.max_nodes and (
        _last_call_over(state, settings, now, last_call) or everyone_back(state)
    ):
        return _MARK_RENDEZVOUS_COMPLETE
    return _KEEP_ALIVE if _beat_due(node, state, settings, now, sighting) else _SYNC


def _beat_due(
    node: NodeDesc,
    state: RendezvousState,
    settings: Settings,
    now: float,
    sighting: HeartbeatSighting | None,
) -> bool:
    """:func:`keep_alive_due` of the context of these fields, ``sighting`` being
    the node's sighting of its own counter (the operators take the fields from the
    driver, which builds no :class:`Context` for them)."""
    # (The sighting first: most decisions find it recent, and look no further.)
    if sighting is None or now - sighting.since < settings.keep_alive_interval:
        return False
    return node in state.heartbeats


def _last_call_over(
    state: RendezvousState, settings: Settings, now: float, sighting: LastCallSighting | None
) -> bool:
    """:func:`last_call_passed` of the context of these fields, ``sighting`` being
    the last-call sighting (its arming and round, compared one by one: no tuples
    built)."""
    if state.last_call is None or sighting is None:
        return False
    if sighting.arming != state.last_call or sighting.round != state.round:
        return False
    return now - sighting.since > settings.last_call_timeout


class ExitOp:
    """Leave the current round to join the next one (called before the join): the
    next round expects this node back (see :class:`LeaveOp`)."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        return _exit_answer(ctx.node, ctx.state, ctx.now, deadline)


def _exit_answer(node: NodeDesc, state: RendezvousState, now: float, deadline: float) -> Action:
    """:class:`ExitOp`'s answer for the context of these fields (the driver calls
    it with the fields, building no :class:`Context`)."""
    if node in state.participants:
        return _ERROR_TIMEOUT if now > deadline else _REMOVE_FROM_PARTICIPANTS
    return _FINISH


def _unless_done(done: bool, ctx: Context, deadline: float, action: Action) -> Action:
    """The answer of a one-write operator: FINISH once ``done``, else ``action``
    unless the deadline passed."""
    if done:
        return _FINISH
    if _timed_out(ctx, deadline):
        return _ERROR_TIMEOUT
    return action


class LeaveOp:
    """Leave the rendezvous for good (an agent stopping on a signal): out of
    whichever list this node is in, and not expected back, so the next round
    does not wait for it."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        state, node = ctx.state, ctx.node
        done = node not in state.members() and node not in state.returning
        return _unless_done(done, ctx, deadline, Action.LEAVE)


class CloseOp:
    """Close the rendezvous: the job is over."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        return _unless_done(ctx.state.closed, ctx, deadline, Action.MARK_RENDEZVOUS_CLOSED)


class ChargeRestartOp:
    """Count a failure of the workers of round ``round_`` in the job-wide restarts.

    Once per round: when several nodes' workers fail in one round, the first
    node's charge counts and the others' find it done. A failure reported after
    its round ended (every participant left) is not counted: those who left over
    it counted it, or they left because the membership changed, which is free.
    """

    def __init__(self, round_: int) -> None:
        self.round = round_

    def __call__(self, ctx: Context, deadline: float) -> Action:
        state = ctx.state
        done = state.closed or state.round != self.round or state.charged_through > self.round
        return _unless_done(done, ctx, deadline, Action.CHARGE_RESTART)


class ExcludeOp:
    """Exclude this node for ``exclusion_rounds`` rounds (it leaves its round)."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        return _unless_done(ctx.state.closed or ctx.is_excluded, ctx, deadline, Action.EXCLUDE)


class KeepAliveOp:
    """Bump this node's heartbeat if it is due."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        return _unless_done(not keep_alive_due(ctx), ctx, deadline, _KEEP_ALIVE)


def wake_at(ctx: Context, deadline: float | None = None) -> float | None:
    """The earliest local time at which a decision may change with no state change.

    After a SYNC the caller waits for the shared state to change *or* until this
    time, whichever comes first: the operation deadline (and the end of its
    rollback window), this node's next heartbeat, the end of the last call, and the
    moment a silent peer would be declared dead. None: only a state change matters.
    """
    seen = ctx.observations
    own = seen.heartbeats.get(ctx.node)
    return _wake_at(
        ctx.node,
        ctx.state,
        ctx.settings,
        ctx.now,
        own,
        seen.last_call,
        seen.heartbeats,
        seen.oldest,
        deadline,
    )


def _wake_at(
    me: NodeDesc,
    state: RendezvousState,
    s: Settings,
    now: float,
    own: HeartbeatSighting | None,
    last_call: LastCallSighting | None,
    sightings: Map[NodeDesc, HeartbeatSighting],
    oldest: float | None,
    deadline: float | None,
) -> float | None:
    """:func:`wake_at` of the context of these fields: ``own`` is the node's own
    sighting, ``sightings`` those of its peers (its own among them or not) and
    ``oldest`` the earliest ``since`` of them all, its own included."""
    heartbeats = state.heartbeats
    window = s.liveness_window
    times: list[float] = []
    if deadline is not None:
        times.append(deadline)
        times.append(deadline + s.rollback_period)
    if own is not None and me in heartbeats:
        times.append(own.since + s.keep_alive_interval)
    if last_call is not None and state.last_call is not None:
        times.append(last_call.since + s.last_call_timeout)
    if oldest is not None and oldest + window > now:
        # No sighting has expired yet: the oldest one expires first. Waking for it
        # when it is this node's own costs one early wake, not a per-peer walk.
        times.append(oldest + window)
    else:
        for node, seen in sightings.items():
            if node != me and node in heartbeats:
                times.append(seen.since + window)
    earliest = None  # the earliest time in the future (one pass: no list, no min call)
    for at in times:
        if at > now and (earliest is None or at < earliest):
            earliest = at
    return earliest
