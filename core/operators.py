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

import ast
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeAlias

from immutables import Map

from .actions import Action
from .codegen import CompiledForms, run_source
from .state import (
    Context,
    HeartbeatSighting,
    LastCallSighting,
    NodeDesc,
    RendezvousState,
    Settings,
)

__all__ = [
    "JOIN_FACTS",
    "JOIN_TABLE",
    "ChargeRestartOp",
    "CloseOp",
    "Context",
    "ExcludeOp",
    "ExitOp",
    "JoinDecision",
    "JoinOp",
    "JoinRow",
    "KeepAliveOp",
    "LeaveOp",
    "Operator",
    "compile_join_table",
    "everyone_back",
    "join_row",
    "join_source",
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


#: The facts the guards of :data:`JOIN_TABLE` are written in: each a Python
#: expression over the fields one join decision reads, ``node``, ``state``,
#: ``settings``, ``now``, ``deadline``, ``own`` (the node's sighting of its own
#: heartbeat counter) and ``last_call`` (its sighting of the last call).
JOIN_FACTS: Mapping[str, str] = MappingProxyType(
    {
        "closed": "state.closed",
        "complete": "state.complete",
        "participant": "node in state.participants",
        "waiting": "node in state.wait_list",
        # (an empty set is told apart without hashing the node)
        "redundant": "bool(state.redundancy_list) and node in state.redundancy_list",
        "excluded": "bool(state.excluded) and state.excluded.get(node, 0) > state.round",
        "full": "len(state.participants) >= settings.max_nodes",
        "quorum": "settings.min_nodes <= len(state.participants) <= settings.max_nodes",
        "timed_out": "now > deadline",
        "within_rollback": "now <= deadline + settings.rollback_period",
        "keep_alive_due": "_beat_due(node, state, settings, now, own)",
        "last_call_passed": "_last_call_over(state, settings, now, last_call)",
        "everyone_back": "everyone_back(state)",
    }
)


@dataclass(frozen=True)
class JoinRow:
    """One row of the join decision table: if ``guard`` holds then ``action``.

    ``guard`` is a boolean expression (``and``, ``or``, ``not``, parentheses,
    ``True``) over the names of :data:`JOIN_FACTS`."""

    name: str
    guard: str
    action: Action


#: torch's join decision, top to bottom; the first row whose guard holds decides.
#: This is what runs: :func:`compile_join_table` turns it into the decision
#: function the driver calls (again whenever the table is replaced).
JOIN_TABLE: tuple[JoinRow, ...] = (
    JoinRow(
        "closed while redundant: leave quietly",
        "closed and redundant",
        Action.ERROR_GRACEFUL_EXIT,
    ),
    JoinRow("closed", "closed", Action.ERROR_CLOSED),
    JoinRow(
        "excluded: stand by as redundant",
        "excluded and not (redundant or participant or waiting)",
        Action.ADD_TO_REDUNDANCY_LIST,
    ),
    JoinRow(
        "redundant, round full or excluded, keep-alive due",
        "redundant and (full or excluded) and keep_alive_due",
        Action.KEEP_ALIVE,
    ),
    JoinRow(
        "redundant, round full or excluded",
        "redundant and (full or excluded)",
        Action.SYNC,
    ),
    JoinRow(
        "redundant, round has room: become a regular joiner",
        "redundant",
        Action.REMOVE_FROM_REDUNDANCY_LIST,
    ),
    JoinRow("complete and a participant: done", "complete and participant", Action.FINISH),
    JoinRow(
        "timed out, within rollback, participant: withdraw",
        "timed_out and within_rollback and participant",
        Action.REMOVE_FROM_PARTICIPANTS,
    ),
    JoinRow(
        "timed out, within rollback, waiting: withdraw",
        "timed_out and within_rollback and waiting",
        Action.REMOVE_FROM_WAIT_LIST,
    ),
    JoinRow("timed out", "timed_out", Action.ERROR_TIMEOUT),
    JoinRow(
        "complete with capacity: wait for the next round",
        "complete and not full and not waiting",
        Action.ADD_TO_WAIT_LIST,
    ),
    JoinRow(
        "complete and full: stand by as redundant",
        "complete and full and not waiting",
        Action.ADD_TO_REDUNDANCY_LIST,
    ),
    JoinRow(
        "participant, quorum, last call passed: complete the round",
        "not complete and participant and quorum and last_call_passed",
        Action.MARK_RENDEZVOUS_COMPLETE,
    ),
    JoinRow(
        "participant, quorum, everyone expected back: complete the round",
        "not complete and participant and quorum and everyone_back",
        Action.MARK_RENDEZVOUS_COMPLETE,
    ),
    JoinRow(
        "round open, not a participant: join",
        "not complete and not participant",
        Action.ADD_TO_PARTICIPANTS,
    ),
    JoinRow("keep-alive due", "keep_alive_due", Action.KEEP_ALIVE),
    JoinRow("otherwise: wait for a change", "True", Action.SYNC),
)


#: A join decision: (node, state, settings, now, own, last_call, deadline) -> the
#: deciding row (see :data:`JOIN_FACTS` for the fields).
JoinDecision = Callable[
    [
        NodeDesc,
        RendezvousState,
        Settings,
        float,
        HeartbeatSighting | None,
        LastCallSighting | None,
        float,
    ],
    JoinRow,
]

# A guard parsed: a fact's name, True, or (op, operands) with op "not", "and", "or".
_Formula: TypeAlias = "str | bool | tuple[str, tuple[_Formula, ...]]"


def _parse_guard(row: JoinRow) -> _Formula:
    if not isinstance(row.guard, str):
        raise TypeError(f"join row {row.name!r}: a guard is an expression string over JOIN_FACTS")
    try:
        tree = ast.parse(row.guard, mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"join row {row.name!r}: guard {row.guard!r}: {error.msg}") from None

    def formula(node: ast.expr) -> _Formula:
        if isinstance(node, ast.Name) and node.id in JOIN_FACTS:
            return node.id
        if isinstance(node, ast.Constant) and node.value is True:
            return True
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ("not", (formula(node.operand),))
        if isinstance(node, ast.BoolOp):
            op = "and" if isinstance(node.op, ast.And) else "or"
            return (op, tuple(formula(value) for value in node.values))
        raise ValueError(
            f"join row {row.name!r}: {ast.unparse(node)!r} in its guard is not a fact "
            f"of JOIN_FACTS, 'True', or and/or/not of them"
        )

    return formula(tree)


def _evaluate(formula: _Formula, known: Mapping[str, bool]) -> bool | str:
    """``formula``'s value under the facts ``known``, or the fact it reads next
    (short-circuit order) when that one is not known yet."""
    if isinstance(formula, bool):
        return formula
    if isinstance(formula, str):
        return known.get(formula, formula)
    op, operands = formula
    if op == "not":
        value = _evaluate(operands[0], known)
        return value if isinstance(value, str) else not value
    for operand in operands:
        value = _evaluate(operand, known)
        if isinstance(value, str) or value is (op == "or"):
            return value
    return op == "and"


def _decision_tree(guards: tuple[_Formula, ...], first: int, known: dict[str, bool]) -> list[str]:
    """The source lines that return the first row from ``first`` on whose guard
    holds: each fact is evaluated when a guard first reads it, at most once (and
    not at all where both of its outcomes lead to the same answer)."""
    for index in range(first, len(guards)):
        value = _evaluate(guards[index], known)
        if value is True:
            return [f"return _row_{index}"]
        if isinstance(value, str):
            holds = _decision_tree(guards, index, {**known, value: True})
            fails = _decision_tree(guards, index, {**known, value: False})
            if holds == fails:
                return holds
            return [
                f"if {JOIN_FACTS[value]}:  # {value}",
                *("    " + line for line in holds),
                "else:",
                *("    " + line for line in fails),
            ]
    return ["raise _no_row()"]


def _no_row() -> AssertionError:
    return AssertionError("no row of the join table holds: its last row must be 'True'")


def join_source(table: tuple[JoinRow, ...]) -> str:
    """The Python source of :func:`compile_join_table`'s decision function for
    ``table`` (for reading and tracing what runs)."""
    guards = tuple(_parse_guard(row) for row in table)
    body = "".join(f"    {line}\n" for line in _decision_tree(guards, 0, {}))
    return "def join_decision(node, state, settings, now, own, last_call, deadline):\n" + body


def compile_join_table(table: tuple[JoinRow, ...]) -> JoinDecision:
    """``table`` as a decision function: it returns the first row whose guard
    holds, evaluating each fact once, when a guard first reads it, in the
    table's order (the table walked, with every fact the guards share read once).

    Raises:
        ValueError: a guard is not an expression over :data:`JOIN_FACTS`.
    """
    namespace: dict[str, object] = {
        "_beat_due": _beat_due,
        "_last_call_over": _last_call_over,
        "everyone_back": everyone_back,
        "_no_row": _no_row,
    }
    namespace.update({f"_row_{index}": row for index, row in enumerate(table)})
    decision: JoinDecision = run_source(join_source(table), "<JOIN_TABLE>", namespace)[
        "join_decision"
    ]
    return decision


_JOIN_FORMS: CompiledForms[tuple[JoinRow, ...], JoinDecision] = CompiledForms(compile_join_table)


def _compiled_join() -> JoinDecision:
    """The decision function of the :data:`JOIN_TABLE` in force."""
    return _JOIN_FORMS.of(JOIN_TABLE)


def join_row(ctx: Context, deadline: float) -> JoinRow:
    """The row of :data:`JOIN_TABLE` that decides for ``ctx``."""
    seen = ctx.observations
    own = seen.heartbeats.get(ctx.node)
    return _compiled_join()(
        ctx.node, ctx.state, ctx.settings, ctx.now, own, seen.last_call, deadline
    )


# A member read off its enum class goes through EnumType's __getattr__ hook, several
# times the cost of a global: the operators, run on every step, return these.
_ERROR_TIMEOUT = Action.ERROR_TIMEOUT
_KEEP_ALIVE = Action.KEEP_ALIVE
_FINISH = Action.FINISH
_REMOVE_FROM_PARTICIPANTS = Action.REMOVE_FROM_PARTICIPANTS


class JoinOp:
    """Join the next round: become a participant and wait until the round completes."""

    def __call__(self, ctx: Context, deadline: float) -> Action:
        """:data:`JOIN_TABLE`'s answer."""
        return join_row(ctx, deadline).action


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


_compiled_join()  # (a table that does not compile fails the import)
