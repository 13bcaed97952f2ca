"""Actions and their effects: every change to the shared state happens here.

``apply(state, action, ctx)`` is the only function that produces a new
:class:`RendezvousState` from a decision. It is pure: it returns a new value and
never modifies its input. What time does to the state (observing heartbeats,
removing silent nodes) lives in :mod:`rallypoint.core.liveness`.

The effect of each action (torch's ``_DistributedRendezvousOpExecutor`` methods,
minus the wall-clock deadline and heartbeat times):

======================== ==================================================================
action                   effect on the shared state
======================== ==================================================================
KEEP_ALIVE               bump this node's heartbeat counter (a new entry starts above
                         every counter ever handed out: it never repeats a stale value)
ADD_TO_PARTICIPANTS      leave the wait list, join the participants, heartbeat; arm the last
                         call when min_nodes is reached; complete at once at max_nodes.
                         Of a regroup: a returning node is back; anybody else ends
                         the regroup (a newcomer: others may be coming) and its
                         record of who returns
ADD_TO_WAIT_LIST         leave the redundancy list, join the wait list, heartbeat
ADD_TO_REDUNDANCY_LIST   join the redundancy list, heartbeat
REMOVE_FROM_PARTICIPANTS leave the participants, drop the heartbeat, then the epilogue; a
                         participant of a complete round leaves it to join the next
                         one: it is returning
REMOVE_FROM_WAIT_LIST    leave the wait list, drop the heartbeat, no longer returning (it
                         gave up on a timeout)
REMOVE_FROM_REDUNDANCY   leave the redundancy list, drop the heartbeat
MARK_RENDEZVOUS_COMPLETE complete the round, disarm the last call, assign ranks; whoever
                         still waits did not join the round that formed without it and
                         stands by in the redundancy list instead (waiting, it would
                         make the new round regroup at once, and again each round it
                         does not join); the next round is a regroup of this one
MARK_RENDEZVOUS_CLOSED   close the rendezvous
CHARGE_RESTART           count this round's failure in the job-wide restarts (once per
                         round); the failure after the budget is spent closes the rendezvous
EXCLUDE                  leave whichever list the node is in (then the epilogue) and sit out
                         ``exclusion_rounds`` rounds; no longer returning
LEAVE                    leave the rendezvous for good: whichever list the node is in
                         (then the epilogue), and no longer returning
======================== ==================================================================

The epilogue after a participant leaves (by itself or declared dead): a complete
round with no participant left advances to the next, incomplete round (dropping the
exclusions that end there); an incomplete round that drops below min_nodes disarms
its last call.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import NoReturn

from immutables import Map

from .errors import InvalidTransitionError
from .state import Context, NodeDesc, RendezvousState, Settings

__all__ = ["Action", "apply", "assign_ranks", "remove_participant_epilogue"]

_NOBODY: frozenset[NodeDesc] = frozenset()

_NO_RANKS: Map[NodeDesc, int] = Map()


class Action(enum.Enum):
    """What an operator decided a node should do next."""

    KEEP_ALIVE = "keep_alive"
    ADD_TO_PARTICIPANTS = "add_to_participants"
    ADD_TO_WAIT_LIST = "add_to_wait_list"
    ADD_TO_REDUNDANCY_LIST = "add_to_redundancy_list"
    REMOVE_FROM_PARTICIPANTS = "remove_from_participants"
    REMOVE_FROM_WAIT_LIST = "remove_from_wait_list"
    REMOVE_FROM_REDUNDANCY_LIST = "remove_from_redundancy_list"
    MARK_RENDEZVOUS_COMPLETE = "mark_rendezvous_complete"
    MARK_RENDEZVOUS_CLOSED = "mark_rendezvous_closed"
    CHARGE_RESTART = "charge_restart"
    EXCLUDE = "exclude"
    #: Leave the rendezvous for good (an agent stopping): not expected back.
    LEAVE = "leave"
    #: Nothing to write: wait for the shared state to change (or for a local timer).
    SYNC = "sync"
    #: The operator is done.
    FINISH = "finish"
    #: The rendezvous is closed: raise RendezvousClosedError.
    ERROR_CLOSED = "error_closed"
    #: The rendezvous closed while this node was redundant: exit without error.
    ERROR_GRACEFUL_EXIT = "error_graceful_exit"
    #: The operation's deadline passed: raise RendezvousTimeoutError.
    ERROR_TIMEOUT = "error_timeout"

    # Members are singletons compared by identity: hash them by identity too, in C
    # (Enum's own __hash__ is a Python-level call, and apply looks every action up
    # in the effect table).
    __hash__ = object.__hash__

    @property
    def changes_state(self) -> bool:
        """True for the actions that :func:`apply` turns into a new shared state."""
        return self in _EFFECTS

    @property
    def is_terminal(self) -> bool:
        """True when the operator loop stops (successfully or with an error)."""
        return self in _TERMINAL

    @property
    def resets_deadline(self) -> bool:
        """True when the caller must restart its join deadline after applying it.

        A redundant node waits without a deadline; once it leaves the redundancy
        list it starts a fresh join timeout, as torch does.
        """
        return self in _RESETTING_DEADLINE


#: Read once: reading a member off the class goes through EnumType's __getattr__
#: hook (on every decision).
_TERMINAL = frozenset(
    {Action.FINISH, Action.ERROR_CLOSED, Action.ERROR_GRACEFUL_EXIT, Action.ERROR_TIMEOUT}
)
#: The actions that reset the deadline (see :attr:`Action.resets_deadline`; the
#: driver tests a write's action against this set, a property costs a call).
_RESETTING_DEADLINE = frozenset({Action.REMOVE_FROM_REDUNDANCY_LIST})


def _beat(state: RendezvousState, node: NodeDesc, changes: dict[str, object]) -> dict[str, object]:
    """``changes`` (a dictionary of changes, or the fields of the new state) plus
    what a keep-alive of ``node`` changes (a new entry starts above every counter
    ever handed out)."""
    heartbeats = state.heartbeats
    current = heartbeats.get(node)
    seq = state.heartbeat_seq
    counter = seq + 1 if current is None else current + 1
    changes["heartbeats"] = heartbeats.set(node, counter)
    if counter > seq:
        changes["heartbeat_seq"] = counter
    return changes


def _keep_alive(state: RendezvousState, node: NodeDesc) -> RendezvousState:
    return state._derive(_beat(state, node, {}))


def remove_participant_epilogue(state: RendezvousState, settings: Settings) -> RendezvousState:
    """What a participant's departure does to the round (see the module docstring)."""
    if state.complete:
        if not state.participants:
            # A new round has a new (empty) intent log.
            changes: dict[str, object] = {
                "complete": False,
                "world_size": 0,
                "round": state.round + 1,
                "intent_cursor": 0,
            }
            if state.excluded:
                changes["excluded"] = _exclusions_after(state.excluded, state.round + 1)
            return state._derive(changes)
        return state
    if len(state.participants) < settings.min_nodes and state.last_call is not None:
        return state._derive({"last_call": None})
    return state


def _exclusions_after(excluded: Map[NodeDesc, int], round_: int) -> Map[NodeDesc, int]:
    """The exclusions still running in ``round_``."""
    ended = [node for node, until in excluded.items() if until <= round_]
    for node in ended:
        excluded = excluded.delete(node)
    return excluded


def assign_ranks(
    participants: Iterable[NodeDesc], previous: dict[NodeDesc, int] | None = None
) -> dict[NodeDesc, int]:
    """Ranks 0..n-1 for the participants.

    Without ``previous`` (torch's rule), ranks follow the node order. With it
    (the stable-ranks option), a node keeps its previous rank when that rank is
    still below n; the other nodes fill the free ranks in node order.
    """
    ordered = sorted(participants)
    size = len(ordered)
    if not previous:
        return {node: rank for rank, node in enumerate(ordered)}
    members = set(ordered)
    kept = {n: r for n, r in previous.items() if n in members and 0 <= r < size}
    taken = set(kept.values())
    free = iter(r for r in range(size) if r not in taken)
    return {node: kept[node] if node in kept else next(free) for node in ordered}


def _mark_complete(state: RendezvousState, settings: Settings) -> RendezvousState:
    previous = dict(state.last_ranks.items()) if settings.stable_ranks else None
    # The ranks set into the participants map, whose keys they share: twice as
    # fast as a new map from the dictionary.
    mutation = state.participants.mutate()
    for node, rank in assign_ranks(state.participants, previous).items():
        mutation[node] = rank
    ranks = mutation.finish()
    changes: dict[str, object] = {
        "complete": True,
        "last_call": None,
        "world_size": len(ranks),
        "participants": ranks,
        "last_ranks": ranks if settings.stable_ranks else _NO_RANKS,
        "returning": _NOBODY,
        "regroup": not state.closed,
    }
    if state.wait_list:
        # A node still waiting did not join the round that formed without it:
        # it stands by (and asks again when it acts). Left waiting, it would make
        # the participants regroup at once for it, and again every round it did
        # not join: a restart storm for a node stuck after announcing itself.
        changes["wait_list"] = _NOBODY
        changes["redundancy_list"] = state.redundancy_list | state.wait_list
    return state._derive(changes)


def _refuse(action: Action, node: NodeDesc, why: str) -> NoReturn:
    raise InvalidTransitionError(f"{action.name} by {node} is not allowed: {why}")


def _add_to_participants(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    before = state.participants
    count = len(before)
    # (A node already joined leaves the count as it was: no separate lookup.)
    participants = before.set(node, 0)
    if state.closed or state.complete or count >= s.max_nodes or len(participants) == count:
        _refuse(Action.ADD_TO_PARTICIPANTS, node, _why_not_joining(state, node, s))
    count += 1
    # One copy of the state for the whole join: its keep-alive, and the arming of
    # the last call at min_nodes, go into the same fields.
    fields = state._fields()
    fields["participants"] = participants
    # (An empty set is told apart without hashing the node.)
    if state.wait_list and node in state.wait_list:
        fields["wait_list"] = state.wait_list - {node}
    if state.redundancy_list and node in state.redundancy_list:
        fields["redundancy_list"] = state.redundancy_list - {node}
    returning = state.returning
    if returning and node in returning:
        fields["returning"] = returning - {node}
    elif state.regroup:
        # A newcomer: others may be coming too. Who else returns no longer
        # matters to this round (a completion starts the record afresh).
        fields["regroup"] = False
        fields["returning"] = _NOBODY
    if count == s.min_nodes:
        arming = state.last_call_seq + 1
        fields["last_call"] = arming
        fields["last_call_seq"] = arming
    state = RendezvousState._of(_beat(state, node, fields))
    if count == s.max_nodes:
        state = _mark_complete(state, s)
    return state


def _why_not_joining(state: RendezvousState, node: NodeDesc, s: Settings) -> str:
    """Why ``node`` may not join ``state`` (the first reason, in the order checked)."""
    if state.closed:
        return "the rendezvous is closed"
    if state.complete:
        return "the round is complete"
    if node in state.participants:
        return "already joined"
    return "round is full"  # the only refusal left (see _add_to_participants)


def _add_to_wait_list(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    if node in state.participants:
        _refuse(Action.ADD_TO_WAIT_LIST, node, "is a participant")
    changes: dict[str, object] = {"wait_list": state.wait_list | {node}}
    if node in state.redundancy_list:
        changes["redundancy_list"] = state.redundancy_list - {node}
    return state._derive(_beat(state, node, changes))


def _add_to_redundancy_list(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    if node in state.participants or node in state.wait_list:
        _refuse(Action.ADD_TO_REDUNDANCY_LIST, node, "is a participant or waiting")
    return state._derive(_beat(state, node, {"redundancy_list": state.redundancy_list | {node}}))


def _remove_from_participants(
    state: RendezvousState, node: NodeDesc, s: Settings
) -> RendezvousState:
    try:
        participants = state.participants.delete(node)
    except KeyError:
        _refuse(Action.REMOVE_FROM_PARTICIPANTS, node, "not a participant")
    fields = state._fields()
    fields["participants"] = participants
    fields["heartbeats"] = _without(state, node)
    if state.complete and not state.closed:
        # It leaves its round to join the next one (a node leaving for good
        # says so: LEAVE): the next round waits for it. (A closed rendezvous has
        # no next round: see _CLOSING.)
        fields["returning"] = state.returning | {node}
    return remove_participant_epilogue(RendezvousState._of(fields), s)


_Effect = Callable[[RendezvousState, NodeDesc, Settings], RendezvousState]


def _leaving(name: str, action: Action, why: str) -> _Effect:
    """The effect of leaving the node list ``name`` (the wait or redundancy list):
    out of it, and its heartbeat entry dropped."""

    def leave(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
        members: frozenset[NodeDesc] = getattr(state, name)
        if node not in members:
            _refuse(action, node, why)
        return state._derive({name: members - {node}, "heartbeats": _without(state, node)})

    return leave


_withdraw_from_wait_list = _leaving("wait_list", Action.REMOVE_FROM_WAIT_LIST, "not waiting")


def _remove_from_wait_list(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    """A waiting node gives up (its join timed out): it is not coming back."""
    state = _withdraw_from_wait_list(state, node, s)
    if node in state.returning:
        return state._derive({"returning": state.returning - {node}})
    return state


_remove_from_redundancy_list = _leaving(
    "redundancy_list", Action.REMOVE_FROM_REDUNDANCY_LIST, "not redundant"
)


def _mark_rendezvous_complete(
    state: RendezvousState, node: NodeDesc, s: Settings
) -> RendezvousState:
    if state.complete:
        _refuse(Action.MARK_RENDEZVOUS_COMPLETE, node, "already complete")
    if not s.min_nodes <= len(state.participants) <= s.max_nodes:
        _refuse(
            Action.MARK_RENDEZVOUS_COMPLETE,
            node,
            f"{len(state.participants)} participants is outside [{s.min_nodes}, {s.max_nodes}]",
        )
    return _mark_complete(state, s)


#: What closing writes. A closed rendezvous forms no next round, so nobody is
#: expected back to one: who would return, and the regroup mark, are forgotten.
#: Once closed they decide nothing (every join ends closed; a leaving node has
#: nobody waiting for it), and states that differ only there are one: the
#: default 3-node check holds a quarter fewer states.
_CLOSING: dict[str, object] = {"closed": True, "returning": _NOBODY, "regroup": False}


def _mark_rendezvous_closed(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    return state._derive(dict(_CLOSING))


def _charge_restart(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    if state.charged_through > state.round:
        _refuse(Action.CHARGE_RESTART, node, f"round {state.round}'s failure is already counted")
    restarts = state.restarts + 1
    changes: dict[str, object] = {"restarts": restarts, "charged_through": state.round + 1}
    if s.restart_budget is not None and restarts > s.restart_budget:
        changes.update(_CLOSING)
    return state._derive(changes)


def _exclude(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    # A node leaving a complete round sits out the rounds after it; one leaving an
    # open round sits out that round too.
    until = state.round + s.exclusion_rounds + (1 if state.complete else 0)
    changes: dict[str, object] = {
        "excluded": state.excluded.set(node, max(until, state.excluded.get(node, 0))),
        "heartbeats": _without(state, node),
        **_off_the_lists(state, node),
    }
    if node not in state.participants:
        return state._derive(changes)
    changes["participants"] = state.participants.delete(node)
    return remove_participant_epilogue(state._derive(changes), s)


def _off_the_lists(state: RendezvousState, node: NodeDesc) -> dict[str, object]:
    """The changes that take ``node`` off the wait, redundancy and returning lists."""
    changes: dict[str, object] = {}
    if node in state.wait_list:
        changes["wait_list"] = state.wait_list - {node}
    if node in state.redundancy_list:
        changes["redundancy_list"] = state.redundancy_list - {node}
    if node in state.returning:
        changes["returning"] = state.returning - {node}
    return changes


def _leave(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    changes = _off_the_lists(state, node)
    if node in state.participants:
        changes["participants"] = state.participants.delete(node)
    if not changes:
        _refuse(Action.LEAVE, node, "neither a member nor returning")
    if node in state.heartbeats:
        changes["heartbeats"] = state.heartbeats.delete(node)
    left = state._derive(changes)
    if node in state.participants:
        return remove_participant_epilogue(left, s)
    return left


def _heartbeat(state: RendezvousState, node: NodeDesc, s: Settings) -> RendezvousState:
    if node not in state.heartbeats:
        _refuse(Action.KEEP_ALIVE, node, "has no heartbeat entry")
    return _keep_alive(state, node)


def _without(state: RendezvousState, node: NodeDesc) -> Map[NodeDesc, int]:
    """The heartbeats of ``state`` without ``node``'s entry (if it has one)."""
    try:
        return state.heartbeats.delete(node)  # (one lookup, where a test and a delete are two)
    except KeyError:
        return state.heartbeats


#: The action -> effect table. An action not in it changes nothing and may not be
#: applied (h2's rule: a pair outside the map is a protocol error, not a no-op).
_EFFECTS: dict[Action, _Effect] = {
    Action.KEEP_ALIVE: _heartbeat,
    Action.ADD_TO_PARTICIPANTS: _add_to_participants,
    Action.ADD_TO_WAIT_LIST: _add_to_wait_list,
    Action.ADD_TO_REDUNDANCY_LIST: _add_to_redundancy_list,
    Action.REMOVE_FROM_PARTICIPANTS: _remove_from_participants,
    Action.REMOVE_FROM_WAIT_LIST: _remove_from_wait_list,
    Action.REMOVE_FROM_REDUNDANCY_LIST: _remove_from_redundancy_list,
    Action.MARK_RENDEZVOUS_COMPLETE: _mark_rendezvous_complete,
    Action.MARK_RENDEZVOUS_CLOSED: _mark_rendezvous_closed,
    Action.CHARGE_RESTART: _charge_restart,
    Action.EXCLUDE: _exclude,
    Action.LEAVE: _leave,
}


def apply(state: RendezvousState, action: Action, ctx: Context) -> RendezvousState:
    """The shared state after ``ctx.node`` performs ``action`` on ``state``.

    Raises:
        InvalidTransitionError: ``action`` changes nothing (SYNC, FINISH, errors) or
            does not fit ``state`` (e.g. removing a node that is not there).
    """
    return _apply(state, action, ctx.node, ctx.settings)


def _apply(state: RendezvousState, action: Action, node: NodeDesc, s: Settings) -> RendezvousState:
    """:func:`apply` with the two fields of the context it reads (the driver calls
    it so, building no :class:`Context`)."""
    effect = _EFFECTS.get(action)
    if effect is None:
        raise InvalidTransitionError(f"{action.name} does not change the rendezvous state")
    return effect(state, node, s)
