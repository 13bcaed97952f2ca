"""The driver: one node's driving loop, view -> next instruction, with no IO.

An adapter, the simulator and the model checker all run a node the same way: they
hold its :class:`NodeView` (what it last read, and when it saw what), ask
:func:`decide` (or :func:`watch`, for a node whose workers run) for the next
:class:`Instruction`, carry it out, and feed the result back with
:func:`after_read`, :func:`after_write`, :func:`after_beat`, :func:`after_announce`
or :func:`after_wait`, which update the view. Carrying out is IO, clocks, threads
and backoff; every decision is made here (etcd-io/raft's ``Ready``, dask's
``handle_stimulus -> Instructions``)::

    Read(counters, intents)  read the state (and, if asked, every member's side
                     heartbeat counter, and the round's intent log), then after_read()
    Write(state)     compare-and-set the state over the one last read, publishing
                     its phase if it moved, then after_write(); on a loss decide
                     again (after a backoff)
    Beat()           bump this node's own side heartbeat counter, then after_beat()
    Announce(round)  append this node to the round's intent log, then after_announce()
    Wait(until, phase)  block until a phase above ``phase`` is published or local
                     time ``until`` (None: only a phase), then after_wait()
    Done(action)     the operation is over: FINISH or an ERROR_* action
    Verdict(...)     (watch only) what the agent must know: waiting nodes, and
                     the participants of its round that are gone

The rules that make the loop safe and cheap, decided here and nowhere else:

* a peer is declared dead only on side counters read within the last quarter
  keep-alive interval (a cached counter may have moved since): otherwise
  ``Read(counters=True)`` first;
* a node that finds peers dead publishes their removal before anything else, even
  when its own operator would only wait or return, so that every node converges on
  it at once instead of each waiting out the liveness window;
* a keep-alive of a member bumps its side counter (O(1) bytes) instead of
  rewriting the state;
* waiters wake on the *phase*, not on every write (docs/design.md, decision 8): a write
  bumps ``state.phase`` exactly when it changes :func:`phase_of`, which holds
  everything a waiting node's decision reads from the state; admissions of
  further joiners to an open round do not wake anybody;
* joiners are admitted in batches: a node that lost a compare-and-set announces
  itself in the round's intent log, and whoever writes an admission next admits,
  in node order, every logged joiner (a waiting node only by its own entry) with
  the decision the join operator makes for that node;
* a join that returns on a round whose rank 0 was declared dead meanwhile cannot
  bootstrap its workers: :attr:`Done.rejoin` tells the caller to leave it and join
  the next round.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from immutables import Map

from . import operators as _operators
from .actions import _RESETTING_DEADLINE, _TERMINAL, Action, _apply, apply
from .codegen import CompiledForms, current_form, inlining, renamed, run_source
from .deprecation import moved_names as _moved_names
from .liveness import (
    _fence_due,
    _last_call_seen,
    _none_expired,
    _observe_sightings,
    _oldest,
    _own_read,
    _own_renewed,
    heartbeat_of,
    sanitize,
)
from .operators import (
    _JOIN_FORMS,
    ExitOp,
    JoinOp,
    Operator,
    _beat_due,
    _exit_answer,
    _wake_at,
    everyone_back,
)
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
    "PHASE_PARTS",
    "Announce",
    "Beat",
    "Decision",
    "Done",
    "Instruction",
    "MemberResponse",
    "Membership",
    "NodeView",
    "Read",
    "Verdict",
    "Wait",
    "Write",
    "admission_stages",
    "after_announce",
    "after_beat",
    "after_outage",
    "after_read",
    "after_wait",
    "after_write",
    "decide",
    "member_response",
    "must_fence",
    "phase_of",
    "watch",
]


_NOBODY: frozenset[NodeDesc] = frozenset()
# A member read off its enum class goes through EnumType's __getattr__ hook: the
# actions every decision compares against are read once.
_SYNC = Action.SYNC
_KEEP_ALIVE = Action.KEEP_ALIVE
_FINISH = Action.FINISH
#: ``_built(Cls, (every field, in order))``: a named tuple made without the
#: Python-level ``__new__`` that calling the class runs. Each of Write, Wait,
#: Done, Membership and Decision is built in exactly one place of the driver,
#: this way (tests/core/test_driver.py pins the field orders they rely on).
_built = tuple.__new__


class Membership(NamedTuple):
    """What a node was told when its join returned: its round, rank and peers.

    ``participants`` is the round's node -> rank map, shared with the state it came
    from (no copy per node); :attr:`members` gives its nodes as a set.
    """

    round: int
    rank: int
    world_size: int
    participants: Map[NodeDesc, int]

    @property
    def members(self) -> frozenset[NodeDesc]:
        return frozenset(self.participants)


# -- instructions ----------------------------------------------------------------


class Read(NamedTuple):
    """Read the state; with ``counters``, every member's side heartbeat counter too;
    with ``intents``, the intent log of the state's round too. Without ``state``,
    keep the state in the view (it was just returned by a lost compare-and-set)
    and read only what else is asked."""

    counters: bool
    intents: bool = False
    state: bool = True


class Write(NamedTuple):
    """Compare-and-set ``state`` over the state last read.

    ``action`` is the operator's action it carries out (None: the write only
    publishes the removal of ``dead``). ``phase``: the phase to publish after a
    win (None: the write does not move it). ``deadline``: after a win, the
    operation's new deadline (a redundant node that became a joiner starts a fresh
    join timeout); None keeps the current one. ``admitted``: other nodes this write
    admits from the intent log and the wait list.
    """

    state: RendezvousState
    action: Action | None
    dead: frozenset[NodeDesc]
    phase: int | None = None
    deadline: float | None = None
    admitted: tuple[NodeDesc, ...] = ()


class Beat(NamedTuple):
    """Bump this node's own side heartbeat counter (the state is not rewritten)."""


class Announce(NamedTuple):
    """Append this node to the intent log of ``round``: the next admitting write
    takes it in."""

    round: int


class Wait(NamedTuple):
    """Wait for a phase above ``phase`` to be published, or until local time
    ``until`` (None: a phase only). A decision changes strictly after ``until``:
    wake just past it."""

    until: float | None
    phase: int = 0


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
    """What a node whose workers run must act on (see :func:`watch`).

    ``waiting``: nodes in the wait list; ``lost``: participants of the node's round
    that left it or were declared dead (the node itself when it was removed).
    """

    waiting: int
    lost: frozenset[NodeDesc]


Instruction = Read | Write | Beat | Announce | Wait | Done | Verdict


class MemberResponse(enum.Enum):
    """What a node whose workers run does after a look at its round
    (:func:`member_response`)."""

    #: nothing changed: the workers go on; look again at the next phase or interval
    CARRY_ON = "carry on"
    #: nodes wait to join, or participants are gone: stop the workers and join the
    #: next round
    REGROUP = "regroup"
    #: the rendezvous is closed (the job ended, or its restart budget is spent):
    #: stop the workers for good
    CLOSED = "closed"


def member_response(verdict: Verdict, state: RendezvousState) -> MemberResponse:
    """The response to ``verdict``, decided on ``state`` (the view it came from)."""
    if state.closed:
        return MemberResponse.CLOSED
    if verdict.waiting or verdict.lost:
        return MemberResponse.REGROUP
    return MemberResponse.CARRY_ON


#: The two plain reads a decision asks for, and the beat (immutable: one
#: instance each).
_READ = Read(False)
_READ_COUNTERS = Read(True)
_BEAT = Beat()


class Decision(NamedTuple):
    """One decision: the instruction, and what it was decided on (for tracing,
    accounting and the model checker; see :meth:`of`)."""

    instruction: Instruction
    #: the operator's action (None when the driver reads first)
    action: Action | None
    #: the view the operator saw: dead nodes removed
    state: RendezvousState
    #: nodes this decision declared dead
    dead: frozenset[NodeDesc]

    @classmethod
    def of(cls, instruction: Instruction, view: NodeView) -> Decision:
        """The decision that gave ``instruction``, from the record of it that
        :func:`decide` or :func:`watch` left in ``view``."""
        assert view.decided_on is not None, "the view has decided nothing yet"
        return _built(cls, (instruction, view.decided_action, view.decided_on, view.declared_dead))


# -- the view ----------------------------------------------------------------------


@dataclass(slots=True)
class NodeView:
    """Everything one node knows: the state and counters it last read, and what
    its own clock saw of them.

    A view belongs to the one node it is driven for, and changes in place: the
    ``after_*`` functions update its knowledge and return it; :func:`decide` and
    :func:`watch` write in it what they decided on (``decided_*``, for
    :meth:`Decision.of`) and the last removal of dead peers they judged (a memo),
    and change nothing else; :func:`must_fence` only reads it. (Views change on
    every read and write of every node: setting the few fields that moved costs a
    fraction of building a new record each time.) :meth:`copy` keeps one as it is.
    :class:`rallypoint.core.RendezvousNode` holds a view with the compare-and-set
    token of its state.

    The node's sightings are kept in three parts, because they change at different
    rates: its own (``own``, its lease: on nearly every write), the last call's
    (``last_call``: once per arming) and its peers' (``peers``: only when the side
    counters are read). :meth:`observations` puts them together.
    """

    #: the state as last read or written
    state: RendezvousState = field(default_factory=RendezvousState)
    #: side heartbeat counters as last read (or bumped, for this node)
    counters: Map[NodeDesc, int] = field(default_factory=Map)
    #: local time of the last side-counter read (None: never)
    counters_at: float | None = None
    #: local time of the view's first read (None: never read)
    since: float | None = None
    #: the node's sighting of its own counter pair; its ``since`` is the start of
    #: its lease (None: it holds no heartbeat entry)
    own: HeartbeatSighting | None = None
    #: the sighting of the state's last call (None: none armed)
    last_call: LastCallSighting | None = None
    #: the sightings of the other members' counters, taken when the side counters
    #: are read
    peers: Map[NodeDesc, HeartbeatSighting] = field(default_factory=Map)
    #: the state must be read before the next decision (nothing read yet, or a
    #: wait ended, or a new operation starts)
    stale: bool = True
    #: the intent log of ``intents_round`` as read with the state (None: not read
    #: since the last write)
    intents: tuple[NodeDesc, ...] | None = None
    intents_round: int = -1
    #: a compare-and-set of this node lost since it last read: others are joining
    #: too, so join through the intent log
    contended: bool = False
    #: the round whose intent log this node is in (-1: none)
    announced: int = -1
    #: the earliest ``since`` of ``peers`` (None: no peer sighted), so that "is
    #: anybody dead?" is one comparison
    peers_oldest: float | None = field(default=None, init=False, repr=False)
    #: the state counters and side counters ``peers`` were last taken from:
    #: observing them again costs one identity comparison
    _source: object = field(default=None, init=False, repr=False, compare=False)
    _source_side: object = field(default=None, init=False, repr=False, compare=False)
    #: the last removal of dead peers judged on this view: (the state, the peers'
    #: sightings, settings, now, node, the state without the dead, the dead); see
    #: _dead_removed
    _removal: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    #: what the last decision on this view was made on (see :meth:`Decision.of`):
    #: the operator's action (None when the driver reads first), the state it
    #: saw (the view's, the dead removed; None: no decision yet) and the peers it
    #: declared dead
    decided_action: Action | None = field(default=None, init=False, repr=False, compare=False)
    decided_on: RendezvousState | None = field(default=None, init=False, repr=False, compare=False)
    declared_dead: frozenset[NodeDesc] = field(
        default=_NOBODY, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.peers_oldest = _oldest(self.peers)

    def copy(self) -> NodeView:
        """A view that changes apart from this one."""
        twin = _blank_view(NodeView)
        for name in _VIEW_SLOTS:
            setattr(twin, name, getattr(self, name))
        return twin

    def observations(self, node: NodeDesc) -> Observations:
        """``node``'s sightings as one record (``node`` being the view's own): its
        own, its peers' and the last call's."""
        peers, own = self.peers, self.own
        oldest = self.peers_oldest
        if own is not None:
            peers = peers.set(node, own)
            if oldest is None or own.since < oldest:
                oldest = own.since
        return _observations(peers, self.last_call, None, None, oldest)


_blank_view = object.__new__
_VIEW_SLOTS = NodeView.__slots__
#: Observations made of parts already of the stored types (see Observations._derived).
_observations = Observations._derived


def _dead_removed(
    view: NodeView, settings: Settings, now: float, node: NodeDesc
) -> tuple[RendezvousState, frozenset[NodeDesc]]:
    """:func:`sanitize` of the view's state on its peers' sightings, judged once
    per view, instant and node: the model checker decides each view under every
    deadline it may have (a 4-node search judged each view about five times).
    The entry holds the state and sightings it was judged on, so a view changed
    since misses it (by identity: both are immutable, and the entry keeps them
    alive). The sightings are the peers' alone: the node itself is never
    declared dead."""
    state, peers = view.state, view.peers
    memo = view._removal
    if (
        memo is not None
        and memo[0] is state
        and memo[1] is peers
        and memo[2] is settings
        and memo[3] == now
        and memo[4] == node
    ):
        return memo[5], memo[6]
    judged_on = _observations(peers, None, None, None, view.peers_oldest)
    sanitized, dead = sanitize(state, judged_on, settings, now, node)
    view._removal = (state, peers, settings, now, node, sanitized, dead)
    return sanitized, dead


@inlining(_own_read, _last_call_seen, heartbeat_of)
def after_read(
    view: NodeView,
    node: NodeDesc,
    state: RendezvousState | None,
    counters: Mapping[NodeDesc, int] | None,
    now: float,
    intents: Iterable[NodeDesc] | None = None,
) -> NodeView:
    """The view after a read: ``state`` (None: nothing stored yet); the side
    counters if they were read with it (None: keep the cached ones); the intent log
    of the state's round if it was read."""
    if state is None:
        state = RendezvousState()
    if view.since is None:
        view.since = now
    if counters is not None:
        _read_counters(view, node, state, counters, now)
    side = view.counters
    # (Most views never read the side counters: no lookup in an empty map.)
    side_counter = side.get(node, 0) if side else 0
    view.own = _own_read(view.own, state.heartbeats.get(node), side_counter, now)
    view.last_call = _last_call_seen(view.last_call, state, now)
    view.state = state
    view.stale = False
    if intents is None:
        view.intents = None
        view.intents_round = -1
    else:
        view.intents = tuple(intents)
        view.intents_round = state.round
    return view


def _read_counters(
    view: NodeView,
    node: NodeDesc,
    state: RendezvousState,
    counters: Mapping[NodeDesc, int],
    now: float,
) -> None:
    """The side counters and the peers' sightings of :func:`after_read` for a read
    with the side counters (the own sighting follows from the new counters)."""
    side = Map(counters)
    mine = view.counters.get(node)
    if mine is not None and node not in side:
        side = side.set(node, mine)  # never forget the own beats
    counts = state.heartbeats
    if view._source is not counts or view._source_side is not side:
        view.peers, view.peers_oldest = _observe_sightings(
            view.peers, view.peers_oldest, counts, side, now, node
        )
        view._source, view._source_side = counts, side
    view.counters = side
    view.counters_at = now


@inlining(_own_read, _own_renewed, _last_call_seen, heartbeat_of)
def after_write(
    view: NodeView,
    node: NodeDesc,
    won: bool,
    stored: RendezvousState | None,
    now: float,
    started: float | None = None,
) -> NodeView:
    """The view after a compare-and-set: ``stored`` is what the backend holds now
    (the written state after a win; after a loss, what beat it, None if nothing).

    ``started``: the local time the compare-and-set was sent (None: ``now``). A won
    write that moved this node's own heartbeat counter renews its lease from then
    (see :func:`rallypoint.core.liveness.renew_own`): pass it, or the node fences
    itself up to one round trip late.
    """
    if stored is None:
        stored = RendezvousState()
    old = view.state.heartbeats
    beats = stored.heartbeats
    mine = beats.get(node)
    side = view.counters.get(node, 0) if view.counters else 0
    # (the view's own heartbeats: the own counter did not move)
    if won and mine is not None and beats is not old and mine != old.get(node):
        at = now if started is None else started
        view.own = _own_renewed(view.own, heartbeat_of(mine, side), at)
    else:
        view.own = _own_read(view.own, mine, side, now)
    view.last_call = _last_call_seen(view.last_call, stored, now)
    view.state = stored
    view.stale = False
    view.intents = None
    view.intents_round = -1
    if not won:
        view.contended = True
    return view


def after_beat(
    view: NodeView, node: NodeDesc, counter: int, now: float, started: float | None = None
) -> NodeView:
    """The view after this node's side heartbeat counter became ``counter``.

    ``started``: the local time the beat was sent (None: ``now``); the beat renews
    this node's lease from then (see :func:`after_write`)."""
    view.counters = view.counters.set(node, counter)
    own = view.state.heartbeats.get(node)
    if own is None:
        view.own = None
    else:
        at = now if started is None else started
        view.own = _own_renewed(view.own, heartbeat_of(own, counter), at)
    return view


def after_outage(view: NodeView, node: NodeDesc) -> NodeView:
    """The view after the backend was unreachable for a while (an adapter that
    rides out outages reports one): nobody could write a counter, and this node
    could not read any, so the sightings of its peers are dropped and each is timed
    afresh from the next read, instead of being declared dead for time nobody could
    reach the backend. The own sighting (the lease, see :func:`must_fence`) is
    kept: the outage did not renew it. The next decision reads, with the counters.
    """
    view.peers = Map()
    view.peers_oldest = None
    view._source = view._source_side = None
    view.counters_at = None
    view.stale = True
    return view


def must_fence(view: NodeView, node: NodeDesc, settings: Settings, now: float) -> bool:
    """Whether ``node`` must stop its workers now: it has not renewed its lease
    (a keep-alive or a write of its own that took effect) for
    :func:`rallypoint.core.liveness.fence_after`, so its peers may soon declare it
    dead and regroup without it. Nothing is read: a node cut off from the store
    decides this alone, on its own clock (docs/design.md, decision 7)."""
    return _fence_due(view.own, settings, now)


def after_announce(view: NodeView, round_: int) -> NodeView:
    """The view after this node appended itself to the intent log of ``round_``."""
    view.announced = round_
    view.intents = None
    view.intents_round = -1
    return view


def after_wait(view: NodeView) -> NodeView:
    """The view after a wait ended (or a new operation starts): read before
    deciding again."""
    view.stale = True
    view.contended = False
    return view


# -- phases --------------------------------------------------------------------------


#: Everything in a state that a node waiting on it (a joiner whose operator
#: answered SYNC, a redundant or waiting node, an agent monitoring its round) may
#: decide on, one expression over ``state`` and ``settings`` a part: a write that
#: changes any part publishes a new phase and wakes them (see :func:`phase_of`).
PHASE_PARTS: tuple[str, ...] = (
    "state.round",
    "state.complete",
    "state.closed",
    "state.last_call",
    "len(state.participants) >= settings.max_nodes",
    "bool(state.wait_list)",
    # Only the first departure from a complete round matters to its monitors
    # (they regroup); counting every one would wake everybody per exit.
    "state.complete and len(state.participants) < state.world_size",
    # A regroup whose last returning node arrived (or was found gone) completes
    # without its last call: its participants must see it.
    "not state.complete and everyone_back(state)",
)

_PhaseOf = Callable[[RendezvousState, Settings], tuple[object, ...]]
_SamePhase = Callable[[RendezvousState, RendezvousState, Settings], bool]


def _compile_phase(parts: tuple[str, ...]) -> tuple[_PhaseOf, _SamePhase]:
    """``parts`` as two functions: the phase of a state (the tuple of its parts),
    and whether two states have the same phase (part by part, ending at the first
    difference: no tuples built, run on every write)."""
    source = "def phase_of(state, settings):\n    return (" + "".join(f"{p}, " for p in parts)
    source += ")\n\ndef same_phase(a, b, settings):\n"
    for part in parts:
        a, b = renamed(part, {"state": "a"}), renamed(part, {"state": "b"})
        source += f"    if ({a}) != ({b}):\n        return False\n"
    source += "    return True\n"
    rules = run_source(source, "<PHASE_PARTS>", {"everyone_back": everyone_back})
    return rules["phase_of"], rules["same_phase"]


_PHASE_FORMS: CompiledForms[tuple[str, ...], tuple[_PhaseOf, _SamePhase]] = CompiledForms(
    _compile_phase
)


def _phase_rules() -> tuple[_PhaseOf, _SamePhase]:
    """The compiled :data:`PHASE_PARTS` in force."""
    return _PHASE_FORMS.of(PHASE_PARTS)


def phase_of(state: RendezvousState, settings: Settings) -> tuple[object, ...]:
    """The parts of ``state`` (:data:`PHASE_PARTS`) that a node waiting on it may
    decide on; a write that changes them publishes a new phase and wakes them.

    The participant count of an open round is left out on purpose: between
    min_nodes (the last call arms) and max_nodes (the round completes) it changes no
    decision, and leaving it out is what makes admissions wake nobody (the one
    admission that does, the last returning node's to a regroup, flips
    :func:`~rallypoint.core.operators.everyone_back`, which is in). Of a
    complete round only "someone left" counts, not how many: one phase per regroup,
    not one per exit.
    """
    return _phase_rules()[0](state, settings)


_phase_rules()  # (parts that do not compile fail the import)


@inlining(current_form)
def _phased(
    new: RendezvousState,
    base: RendezvousState,
    settings: Settings,
    action: Action | None = None,
    dead: frozenset[NodeDesc] = _NOBODY,
    deadline: float | None = None,
    admitted: tuple[NodeDesc, ...] = (),
    made: bool = False,
) -> Write:
    """A write of ``new`` over ``base``, publishing a new phase if it changes
    :data:`PHASE_PARTS`. ``made``: ``new`` was made for this write and nobody else
    holds it (see :meth:`RendezvousState._phase_set`)."""
    phase = None
    rules = current_form(_PHASE_FORMS, PHASE_PARTS)
    if not rules[1](new, base, settings):
        phase = base.phase + 1
        new = new._phase_set(phase) if made else new._derive({"phase": phase})
    return _built(Write, (new, action, dead, phase, deadline, admitted))


# -- decisions ---------------------------------------------------------------------


def _counters_stale(view: NodeView, settings: Settings, now: float) -> bool:
    """Whether the side counters in the view are too old to declare a death on:
    read over a quarter keep-alive interval ago (or never)."""
    return view.counters_at is None or now - view.counters_at > settings.keep_alive_interval / 4


def _counters_due(view: NodeView, settings: Settings, now: float) -> bool:
    """Whether the side counters are due: the next read fetches them, and a view
    that is not stale is read again for them.

    A death needs a sighting and, a liveness window later, counters that did not
    move; reading them every half window keeps detection within 1.5 windows while
    most reads (a node woken by a phase) stay one state read. A new view waits half
    a window before its first counter read: nobody it could declare dead has been
    silent longer than that from its point of view anyway. Due counters are read
    even on a view that is not stale: a view kept fresh by reads without counters
    (an agent's closed-check, a keep-alive on the cached view) would otherwise never
    see a peer's counter stand still, and a killed peer would go unnoticed until its
    state entry aged out (measured: 11 s to over 30 s instead of 2-3 s to regroup
    after a SIGKILL with a 2 s liveness window).
    """
    last = view.counters_at if view.counters_at is not None else view.since
    return last is not None and now - last > settings.liveness_window / 2


def _must_reread(view: NodeView, dead: frozenset[NodeDesc], settings: Settings, now: float) -> bool:
    """Never declare a peer dead on cached counters: it may have beaten since."""
    return bool(dead) and _counters_stale(view, settings, now)


def _publish(
    view: NodeView, sanitized: RendezvousState, dead: frozenset[NodeDesc], settings: Settings
) -> Write:
    """Write the removal of ``dead`` so that every node converges on it at once."""
    return _phased(sanitized, view.state, settings, dead=dead)


_ADMISSIONS = frozenset(
    {Action.ADD_TO_PARTICIPANTS, Action.ADD_TO_WAIT_LIST, Action.ADD_TO_REDUNDANCY_LIST}
)
#: A joiner admitted on another node's behalf has no deadline the admitter knows.
_NO_DEADLINE = float("inf")


def _admit_batch(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    op: Operator,
    state: RendezvousState,
    now: float,
) -> tuple[RendezvousState, tuple[NodeDesc, ...]]:
    """``state`` (this node's own admission applied) with every joiner of the intent
    log past the cursor admitted as the join operator decides for it; the cursor
    moves past the log.

    A waiting node is admitted only through its own entry in the open round's log,
    never from the wait list alone: a node that asked to wait and never acts again
    (its agent stuck, its heartbeat thread alive) would otherwise hold a place in a
    round it never trains in, and every peer would wait on it."""
    log = view.intents or ()
    pending = {n for n in log[state.intent_cursor :] if n != node}
    admitted = []
    obs = view.observations(node)
    for other in sorted(pending):
        if other in state.redundancy_list:
            continue
        ctx = Context(other, state, settings, now, obs)
        action = op(ctx, _NO_DEADLINE)
        if action in _ADMISSIONS:
            state = apply(state, action, ctx)
            admitted.append(other)
    if len(log) > state.intent_cursor:
        state = state.evolve(intent_cursor=len(log))
    return state, tuple(admitted)


def admission_stages(
    node: NodeDesc,
    settings: Settings,
    sanitized: RendezvousState,
    action: Action | None,
    admitted: tuple[NodeDesc, ...],
    written: RendezvousState,
) -> list[RendezvousState]:
    """A batch write taken apart, for checkers: the state after the writer's own
    action, then after each admission in turn (each node's action read off where
    ``written`` put it). Empty when the write admitted nobody else.

    Raises:
        InvalidTransitionError: the write is not such a sequence of admissions.
    """
    if not admitted:
        return []
    state = sanitized
    if action is not None and action.changes_state:
        state = apply(state, action, Context(node, state, settings, 0.0))
    stages = [state]
    for other in admitted:
        act = (
            Action.ADD_TO_PARTICIPANTS
            if other in written.participants
            else Action.ADD_TO_WAIT_LIST
            if other in written.wait_list
            else Action.ADD_TO_REDUNDANCY_LIST
        )
        state = apply(state, act, Context(other, state, settings, 0.0))
        stages.append(state)
    return stages


def _write(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    op: Operator,
    action: Action,
    sanitized: RendezvousState,
    dead: frozenset[NodeDesc],
    now: float,
) -> Instruction:
    """:func:`decide`'s instruction for an answer that writes: the write, or first
    the steps of a join through the intent log."""
    state = view.state
    admitted: tuple[NodeDesc, ...] = ()
    new = _apply(sanitized, action, node, settings)
    if action in _ADMISSIONS and (view.contended or view.announced == sanitized.round):
        # Others are joining too: join through the intent log, and admit them all
        # (a node in the log joins only with a batch that moves the cursor past
        # it, or a later batch could admit it again after it left). Dead peers'
        # removal goes out first.
        if dead:
            return _publish(view, sanitized, dead, settings)
        if view.announced != sanitized.round:
            return Announce(sanitized.round)
        if view.intents_round != state.round:
            # Read the state again with the log: the one the lost CAS returned is a
            # round trip old, and a batch based on it loses to single joiners.
            return Read(_counters_due(view, settings, now), intents=True)
        new, admitted = _admit_batch(view, node, settings, op, new, now)
    reset = now + settings.join_timeout if action in _RESETTING_DEADLINE else None
    # An effect returns its input or a state it made for this call.
    return _phased(new, state, settings, action, dead, reset, admitted, new is not sanitized)


def _no_write(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    op: Operator,
    action: Action,
    sanitized: RendezvousState,
    dead: frozenset[NodeDesc],
    deadline: float,
    now: float,
) -> Instruction:
    """:func:`decide`'s instruction for an answer that writes nothing (SYNC or a
    terminal action): publish the dead first, wait, renew a lease running out, or
    be done."""
    if dead:
        return _publish(view, sanitized, dead, settings)
    state = view.state
    own = view.own
    if action is _SYNC:
        oldest = view.peers_oldest
        if own is not None and (oldest is None or own.since < oldest):
            oldest = own.since
        until = _wake_at(
            node, sanitized, settings, now, own, view.last_call, view.peers, oldest, deadline
        )
        return _built(Wait, (until, state.phase))
    if (
        action is _FINISH
        and isinstance(op, JoinOp)
        and _fence_due(own, settings, now)
        and node in state.heartbeats
    ):
        # Never hand workers a lease that is running out (a node admitted by
        # another's batch after a long wait, or back from a partition): renew
        # it first, or the agent would fence them at once.
        return _BEAT
    return _done(node, op, action, sanitized)


def _done(node: NodeDesc, op: Operator, action: Action, state: RendezvousState) -> Done:
    joined = None
    rejoin = False
    if action is _FINISH and isinstance(op, JoinOp):
        ranks = state.participants
        joined = _built(Membership, (state.round, ranks[node], state.world_size, ranks))
        # The round completed, but its rank-0 node was declared dead before this
        # node saw it complete: nobody can host the workers' store for it. (While
        # nobody has left, ranks are exactly 0..world-1: no scan.)
        rejoin = len(ranks) != state.world_size and 0 not in set(ranks.values())
    return _built(Done, (action, state, joined, rejoin))


# The steps of a decision are inlined into it: a call costs about as much as a
# small step (see core/codegen.py).
@inlining(_counters_due, _none_expired, _exit_answer, _write, _no_write, _phased, current_form)
def decide(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    op: Operator,
    deadline: float,
    now: float,
) -> Instruction:
    """The next instruction of ``node`` running ``op`` (with ``deadline``) at
    local time ``now``. What it was decided on is recorded in ``view`` (see
    :meth:`Decision.of`); nothing else in the view changes."""
    state = view.state
    if _counters_due(view, settings, now):
        view.decided_action, view.decided_on, view.declared_dead = None, state, _NOBODY
        return _READ_COUNTERS
    if view.stale:
        view.decided_action, view.decided_on, view.declared_dead = None, state, _NOBODY
        return _READ
    if _none_expired(view.peers_oldest, settings, now):
        # No peer's sighting is old enough for it to be dead (nearly every
        # decision; a node never declares itself): nothing to judge.
        sanitized, dead = state, _NOBODY
    else:
        sanitized, dead = _dead_removed(view, settings, now, node)
        if _must_reread(view, dead, settings, now):
            view.decided_action, view.decided_on, view.declared_dead = None, sanitized, _NOBODY
            return _READ_COUNTERS
    # The join and exit operators answer from the context's fields: no Context is
    # built for them (an operator of another type, a subclass included, gets one).
    own = view.own
    kind = type(op)
    if kind is JoinOp:
        decision = current_form(_JOIN_FORMS, _operators.JOIN_TABLE)
        action = decision(node, sanitized, settings, now, own, view.last_call, deadline).action
    elif kind is ExitOp:
        action = _exit_answer(node, sanitized, now, deadline)
    else:
        action = op(Context(node, sanitized, settings, now, view.observations(node)), deadline)
    view.decided_action, view.decided_on, view.declared_dead = action, sanitized, dead
    if action is _SYNC or action in _TERMINAL:
        return _no_write(view, node, settings, op, action, sanitized, dead, deadline, now)
    if not dead and (
        (action is _KEEP_ALIVE and node in state.heartbeats)
        or _beat_due(node, state, settings, now, own)
    ):
        # A member beats when its keep-alive is due, also before another write: a
        # node that keeps losing compare-and-sets must not look dead meanwhile.
        return _BEAT
    return _write(view, node, settings, op, action, sanitized, dead, now)


def watch(
    view: NodeView,
    node: NodeDesc,
    settings: Settings,
    joined: Membership | None,
    now: float,
) -> Instruction:
    """The next instruction of a node whose workers run in the round ``joined``
    (None: it has not joined one): read, publish removals, or a :class:`Verdict`.
    What it was decided on is recorded in ``view`` (see :meth:`Decision.of`).

    The agent regroups on a verdict with waiting nodes or lost participants.
    """
    due = _counters_due(view, settings, now)
    if view.stale or due:
        view.decided_action, view.decided_on, view.declared_dead = None, view.state, _NOBODY
        return _READ_COUNTERS if due else _READ
    sanitized, dead = _dead_removed(view, settings, now, node)
    if _must_reread(view, dead, settings, now):
        view.decided_action, view.decided_on, view.declared_dead = None, sanitized, _NOBODY
        return _READ_COUNTERS
    view.decided_action, view.decided_on, view.declared_dead = None, sanitized, dead
    if dead:
        return _publish(view, sanitized, dead, settings)
    lost: frozenset[NodeDesc] = frozenset()
    if joined is not None:
        now_in = sanitized.participants
        if sanitized.round != joined.round:
            lost = joined.members
        elif len(now_in) != joined.world_size or not sanitized.complete:
            # Participants only leave a complete round: while the count holds,
            # nobody left (no scan of the members).
            lost = frozenset(n for n in joined.participants if n not in now_in)
    return Verdict(len(sanitized.wait_list), lost)


# Renamed in 0.2.0 (CHANGELOG.md): the alias warns, and goes in the next release.
__getattr__ = _moved_names(__name__, {"monitor": f"{__name__}:watch"})
