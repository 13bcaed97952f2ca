"""The driver: one node's driving loop as a pure function, view -> next instruction.

An adapter, the simulator and the model checker all run a node the same way: they
hold its :class:`NodeView` (what it last read, and when it saw what), ask
:func:`decide` (or :func:`monitor`, for a node whose workers run) for the next
:class:`Instruction`, carry it out, and feed the result back with
:func:`after_read`, :func:`after_write`, :func:`after_beat` or :func:`after_wait`.
Carrying out is IO, clocks, threads and backoff; every decision is made here
(etcd-io/raft's ``Ready``, dask's ``handle_stimulus -> Instructions``)::

    Read(counters)   read the state blob (and, if asked, every member's heartbeat
                     counter), then after_read()
    Write(state)     compare-and-set the blob over the one last read, then
                     after_write(); on a loss decide again (after a backoff)
    Beat()           bump this node's own heartbeat counter, then after_beat()
    Wait(until)      block until the blob changes or local time ``until`` (None:
                     only a change), then after_wait()
    Done(action)     the operation is over: FINISH or an ERROR_* action
    Verdict(...)     (monitor only) what the agent must know: waiting nodes, and
                     the participants of its round that are gone

The rules that make the loop safe, decided here and nowhere else:

* a peer is declared dead only on heartbeat counters read within the last quarter
  keep-alive interval (a cached counter may have moved since): otherwise
  ``Read(counters=True)`` first;
* a node that finds peers dead publishes their removal before anything else, even
  when its own operator would only wait or return, so that every node converges on
  it at once instead of each waiting out the liveness window;
* a keep-alive of a member bumps its side counter (O(1) bytes) instead of
  rewriting the blob; the merge rule (:mod:`rallypoint.core.liveness`) makes that
  move the counter the core sees;
* a join that returns on a round whose rank 0 was declared dead meanwhile cannot
  bootstrap its workers: :attr:`Done.rejoin` tells the caller to leave it and join
  the next round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from immutables import Map

from .actions import Action, apply
from .liveness import merge_heartbeats, observe, sanitize, split_heartbeats
from .operators import JoinOp, Operator, wake_at
from .state import Context, NodeDesc, Observations, RendezvousState, Settings

__all__ = [
    "Beat",
    "Decision",
    "Done",
    "Instruction",
    "Membership",
    "NodeView",
    "Read",
    "Verdict",
    "Wait",
    "Write",
    "after_beat",
    "after_read",
    "after_wait",
    "after_write",
    "decide",
    "monitor",
]


class Membership(NamedTuple):
    """What a node was told when its join returned: its round, rank and peers."""

    round: int
    rank: int
    world_size: int
    members: frozenset[NodeDesc]


# -- instructions ----------------------------------------------------------------


class Read(NamedTuple):
    """Read the state blob; with ``counters``, every member's heartbeat counter too."""

    counters: bool


class Write(NamedTuple):
    """Compare-and-set ``state`` (blob form) over the blob last read.

    ``action`` is the operator's action it carries out (None: the write only
    publishes the removal of ``dead``). ``deadline``: after a win, the operation's
    new deadline (a redundant node that became a joiner starts a fresh join
    timeout); None keeps the current one.
    """

    state: RendezvousState
    action: Action | None
    dead: frozenset[NodeDesc]
    deadline: float | None = None


class Beat(NamedTuple):
    """Bump this node's own heartbeat counter (the blob is not rewritten)."""


class Wait(NamedTuple):
    """Wait for the blob to change, or until local time ``until`` (None: a change).

    A decision changes strictly after ``until``: wake just past it.
    """

    until: float | None


class Done(NamedTuple):
    """The operation is over with ``action`` (FINISH or an ERROR_* action).

    ``state`` is the view it ended on; ``joined`` what a finished join returns;
    ``rejoin``: the finished round has lost its rank 0, so it cannot bootstrap its
    workers: leave it and join the next round.
    """

    action: Action
    state: RendezvousState
    joined: Membership | None = None
    rejoin: bool = False


class Verdict(NamedTuple):
    """What a node whose workers run must act on (see :func:`monitor`).

    ``waiting``: nodes in the wait list; ``lost``: participants of the node's round
    that left it or were declared dead (the node itself when it was removed).
    """

    waiting: int
    lost: frozenset[NodeDesc]


Instruction = Read | Write | Beat | Wait | Done | Verdict


class Decision(NamedTuple):
    """One decision: the instruction, and what it was decided on (for tracing,
    accounting and the model checker)."""

    instruction: Instruction
    #: the operator's action (None when the driver reads before asking it)
    action: Action | None
    #: the view the operator saw: heartbeats merged, dead nodes removed
    state: RendezvousState
    #: nodes this decision declared dead
    dead: frozenset[NodeDesc]


# -- the view ----------------------------------------------------------------------


class NodeView(NamedTuple):
    """Everything one node knows: the blob and counters it last read, and what its
    own clock saw of them. Immutable; the ``after_*`` functions return new views."""

    #: the state blob as stored (blob heartbeat counters)
    blob: RendezvousState = RendezvousState()
    #: side heartbeat counters as last read (or bumped, for this node)
    counters: Map[NodeDesc, int] = Map()
    #: the blob with the counters merged in: the state the core decides on
    merged: RendezvousState = RendezvousState()
    #: the counters were read together with this blob
    counters_fresh: bool = False
    #: local time of the last counter read (None: never)
    counters_at: float | None = None
    observations: Observations = Observations()
    #: the blob must be read before the next decision (nothing read yet, or a wait
    #: ended, or a new operation starts)
    stale: bool = True


def _adopt(
    view: NodeView,
    blob: RendezvousState,
    counters: Map[NodeDesc, int],
    now: float,
    **changes: object,
) -> NodeView:
    merged = merge_heartbeats(blob, counters)
    return view._replace(
        blob=blob,
        counters=counters,
        merged=merged,
        observations=observe(view.observations, merged, now),
        **changes,
    )


def after_read(
    view: NodeView,
    blob: RendezvousState | None,
    counters: Mapping[NodeDesc, int] | None,
    now: float,
) -> NodeView:
    """The view after a read: ``blob`` (None: nothing stored yet) and, if they were
    read with it, the heartbeat counters (None: keep the cached ones)."""
    blob = RendezvousState() if blob is None else blob
    if counters is None:
        return _adopt(view, blob, view.counters, now, counters_fresh=False, stale=False)
    return _adopt(
        view, blob, Map(counters), now, counters_fresh=True, counters_at=now, stale=False
    )


def after_write(
    view: NodeView, won: bool, stored: RendezvousState | None, now: float
) -> NodeView:
    """The view after a compare-and-set: ``stored`` is what the backend holds now
    (the written blob after a win; after a loss, what beat it, None if nothing)."""
    blob = RendezvousState() if stored is None else stored
    return _adopt(view, blob, view.counters, now, counters_fresh=False, stale=False)


def after_beat(view: NodeView, node: NodeDesc, counter: int, now: float) -> NodeView:
    """The view after this node's heartbeat counter became ``counter``."""
    return _adopt(
        view, view.blob, view.counters.set(node, counter), now, counters_fresh=view.counters_fresh
    )


def after_wait(view: NodeView) -> NodeView:
    """The view after a wait ended (changed or not): read before deciding again."""
    return view._replace(stale=True)


# -- decisions ---------------------------------------------------------------------


def _counters_stale(view: NodeView, settings: Settings, now: float) -> bool:
    """Whether the counters in the view are too old to judge liveness on.

    They only feed liveness, which acts on windows of whole keep-alive intervals:
    counters read within the last quarter interval are current enough (so a node
    woken by every write costs one read, not two); a member whose counter was never
    read makes them stale too.
    """
    if view.counters_at is None or now - view.counters_at > settings.keep_alive_interval / 4:
        return True
    counters = view.counters
    return any(node not in counters for node in view.blob.heartbeats)


def _must_reread(
    view: NodeView, dead: frozenset[NodeDesc], settings: Settings, now: float
) -> bool:
    """Never declare a peer dead on cached counters: it may have beaten since."""
    return bool(dead) and _counters_stale(view, settings, now)


def _publish(view: NodeView, sanitized: RendezvousState, dead: frozenset[NodeDesc]) -> Write:
    """Write the removal of ``dead`` so that every node converges on it at once."""
    return Write(split_heartbeats(sanitized, view.merged, view.blob), None, dead)


def decide(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    op: Operator,
    deadline: float,
    now: float,
) -> Decision:
    """The next instruction of ``node`` running ``op`` (with ``deadline``) at
    local time ``now``."""
    if view.stale:
        return Decision(Read(_counters_stale(view, settings, now)), None, view.merged, frozenset())
    obs = view.observations
    sanitized, dead = sanitize(view.merged, obs, settings, now)
    if _must_reread(view, dead, settings, now):
        return Decision(Read(True), None, sanitized, frozenset())
    ctx = Context(node, sanitized, settings, now, obs)
    action = op(ctx, deadline)
    if action.is_terminal or action is Action.SYNC:
        if dead:
            return Decision(_publish(view, sanitized, dead), action, sanitized, dead)
        if action is Action.SYNC:
            return Decision(Wait(wake_at(ctx, deadline)), action, sanitized, dead)
        return Decision(_done(node, op, action, sanitized), action, sanitized, dead)
    if action is Action.KEEP_ALIVE and not dead and node in view.blob.heartbeats:
        return Decision(Beat(), action, sanitized, dead)
    new = apply(sanitized, action, ctx)
    reset = now + settings.join_timeout if action.resets_deadline else None
    write = Write(split_heartbeats(new, view.merged, view.blob), action, dead, reset)
    return Decision(write, action, sanitized, dead)


def _done(node: NodeDesc, op: Operator, action: Action, state: RendezvousState) -> Done:
    if action is not Action.FINISH or not isinstance(op, JoinOp):
        return Done(action, state)
    ranks = state.participants
    joined = Membership(state.round, ranks[node], state.world_size, frozenset(ranks))
    # The round completed, but its rank-0 node was declared dead before this node
    # saw it complete: nobody can host the workers' store for it.
    rejoin = 0 not in set(ranks.values())
    return Done(action, state, joined, rejoin)


def monitor(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    joined: Membership | None,
    now: float,
) -> Decision:
    """The next instruction of a node whose workers run in the round ``joined``
    (None: it has not joined one): read, publish removals, or a :class:`Verdict`.

    The agent regroups on a verdict with waiting nodes or lost participants.
    """
    if view.stale:
        return Decision(Read(_counters_stale(view, settings, now)), None, view.merged, frozenset())
    sanitized, dead = sanitize(view.merged, view.observations, settings, now)
    if _must_reread(view, dead, settings, now):
        return Decision(Read(True), None, sanitized, frozenset())
    if dead:
        return Decision(_publish(view, sanitized, dead), None, sanitized, dead)
    lost: frozenset[NodeDesc] = frozenset()
    if joined is not None:
        if sanitized.round != joined.round:
            lost = joined.members
        else:
            lost = joined.members.difference(sanitized.participants)
    verdict = Verdict(len(sanitized.wait_list), lost)
    return Decision(verdict, None, sanitized, dead)
