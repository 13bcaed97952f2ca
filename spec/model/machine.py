"""The rendezvous protocol as a formal model: the lifecycle of one node.

This is the specification the model checker holds the core to. It is written from
the protocol (docs/design.md, torch's dynamic rendezvous), not from ``rallypoint.core``:
the guards below restate the protocol's conditions over the fields of the shared
state and the node's own sightings, so a bug in the core's decision table shows up
as a step that no edge of this model allows.

A node is in exactly one lifecycle state, derived from what it is doing locally and
from its membership in the shared state (:func:`lifecycle_state`)::

    idle/exited --join--> joining --add_to_participants--> participant --complete--> complete
                               \\--add_to_wait_list--> waiting      (round complete, room)
                               \\--add_to_redundancy_list--> redundant (round complete, full)
    joining / waiting [announced] --admitted (a peer's batch)--> the same destinations
    complete --finish--> training --remove_from_participants (exit)--> exited
    training --leave (for good)--> exited
    participant --complete [quorum, last call over or everyone back]--> complete
    waiting --round_completed (formed without it)--> redundant
    training/evicted --exclude--> exited; joining [excluded] --add_to_redundancy_list--> redundant
    training/evicted --charge_restart--> (stays): the workers failed, the budget counts it
    any live state --crash--> crashed; --timeout--> failed; --closed--> closed

Two kinds of triggers exist. *Own* triggers are named after the core's actions (an
action the stepping node performed, e.g. ``add_to_participants``, ``finish``) or the
node's own lifecycle events (``join``, ``crash``). *Peer* triggers change a node's
lifecycle state through another node's step: ``round_completed`` (a peer marked the
round complete or filled it), ``declared_dead`` (a sanitize, a peer's or the node's
own, removed it from the shared state) and ``admitted`` (a peer's write admitted it
in a batch: it had announced itself in the round's intent log, waiting or not).

Every edge has guards; the guards of one step are evaluated once into a
:class:`Guards` tuple from a :class:`View` of the node before the step, so the
checker can memoize conformance checks (:meth:`LifecycleModel.allows`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

from transitions import Machine, MachineError

from ...core import HeartbeatSighting, LastCallSighting, NodeDesc, RendezvousState, Settings
from .lifecycle import LOCAL_PHASES, TERMINAL_PHASES, Lifecycle, Phase

#: ``built(Cls, (every field, in order))``: a named tuple made without the
#: Python-level ``__new__`` that calling the class runs. The model checker's inner
#: loop makes millions of states, local states and guards; its paths build them so.
built = tuple.__new__

__all__ = [
    "LIVE_STATES",
    "LOCAL_PHASES",
    "MODEL_STATES",
    "MODEL_TRANSITIONS",
    "PEER_TRIGGERS",
    "TERMINAL_STATES",
    "Guards",
    "Lifecycle",
    "LifecycleModel",
    "ModelUnavailableError",
    "Phase",
    "View",
    "diagram_source",
    "lifecycle_state",
    "write_diagram",
]

#: Lifecycle states of one node, in diagram order.
MODEL_STATES: tuple[Lifecycle, ...] = tuple(Lifecycle)
TERMINAL_STATES: frozenset[Lifecycle] = frozenset(
    {Lifecycle.CLOSED, Lifecycle.FAILED, Lifecycle.CRASHED}
)
LIVE_STATES: tuple[Lifecycle, ...] = tuple(s for s in MODEL_STATES if s not in TERMINAL_STATES)
#: Triggers caused by another node's step (or by a sanitize).
PEER_TRIGGERS: frozenset[str] = frozenset({"round_completed", "declared_dead", "admitted"})


def _edge(
    trigger: str,
    source: Lifecycle | Iterable[Lifecycle],
    dest: Lifecycle | None,
    conditions: Iterable[str] = (),
    unless: Iterable[str] = (),
) -> dict[str, Any]:
    """One edge for the ``transitions`` library, its states as plain strings (it
    would name an enum member's state by the member's name)."""
    return {
        "trigger": trigger,
        "source": str(source) if isinstance(source, Lifecycle) else [str(s) for s in source],
        "dest": None if dest is None else str(dest),
        "conditions": list(conditions),
        "unless": list(unless),
    }


#: The edges of the model. ``dest=None`` is an internal edge (the state stays).
MODEL_TRANSITIONS: tuple[dict[str, Any], ...] = (
    # Lifecycle events the node's agent starts.
    _edge("join", [Lifecycle.IDLE, Lifecycle.EXITED, Lifecycle.EVICTED], Lifecycle.JOINING),
    _edge("crash", LIVE_STATES, Lifecycle.CRASHED),
    # Joining a round that is still open; the arrival that fills it completes it.
    # A node that excluded itself joins no round, nor waits for one, while excluded.
    _edge(
        "add_to_participants",
        [Lifecycle.JOINING, Lifecycle.WAITING],
        Lifecycle.COMPLETE,
        conditions=["round_open", "fills_round"],
        unless=["excluded"],
    ),
    _edge(
        "add_to_participants",
        [Lifecycle.JOINING, Lifecycle.WAITING],
        Lifecycle.PARTICIPANT,
        conditions=["round_open"],
        unless=["fills_round", "excluded"],
    ),
    # A complete round with room: wait for the next one; without room: stand by.
    _edge(
        "add_to_wait_list",
        [Lifecycle.JOINING, Lifecycle.REDUNDANT],
        Lifecycle.WAITING,
        conditions=["round_complete", "not_closed"],
        unless=["round_full", "excluded"],
    ),
    _edge(
        "add_to_redundancy_list",
        Lifecycle.JOINING,
        Lifecycle.REDUNDANT,
        conditions=["round_complete", "round_full", "not_closed"],
    ),
    # An excluded node stands by as a spare whatever the round, until its
    # exclusion runs out (a new round past it opens).
    _edge(
        "add_to_redundancy_list",
        Lifecycle.JOINING,
        Lifecycle.REDUNDANT,
        conditions=["excluded", "not_closed"],
    ),
    _edge(
        "remove_from_redundancy_list",
        Lifecycle.REDUNDANT,
        Lifecycle.JOINING,
        conditions=["not_closed"],
        unless=["round_full", "excluded"],
    ),
    # The last call: min_nodes reached and this node saw the last call run out.
    _edge(
        "mark_rendezvous_complete",
        Lifecycle.PARTICIPANT,
        Lifecycle.COMPLETE,
        conditions=["quorum", "last_call_over", "not_closed"],
    ),
    # A regroup that expects nobody else (every participant of the last round not
    # known gone is back, and nobody else joined, waits or may join as a spare):
    # the last call would wait for nobody.
    _edge(
        "mark_rendezvous_complete",
        Lifecycle.PARTICIPANT,
        Lifecycle.COMPLETE,
        conditions=["quorum", "all_back", "not_closed"],
    ),
    _edge("round_completed", Lifecycle.PARTICIPANT, Lifecycle.COMPLETE),
    # A node still waiting when a round forms without it stands by: waiting, it
    # would make every round it does not join regroup at once for it.
    _edge("round_completed", Lifecycle.WAITING, Lifecycle.REDUNDANT),
    # Batched admission: a peer's write admits a joiner that announced itself in the
    # round's intent log (and is not a member yet), or a waiting node that announced
    # itself in the open round's log, with the decision the node's own join would
    # make. Never a waiting node from the wait list alone: one that never acts again
    # would hold a place in a round it never trains in.
    _edge(
        "admitted",
        [Lifecycle.JOINING, Lifecycle.WAITING],
        Lifecycle.PARTICIPANT,
        conditions=["announced", "round_open"],
        unless=["fills_round", "excluded"],
    ),
    _edge(
        "admitted",
        [Lifecycle.JOINING, Lifecycle.WAITING],
        Lifecycle.COMPLETE,
        conditions=["announced", "round_open", "fills_round"],
        unless=["excluded"],
    ),
    _edge(
        "admitted",
        Lifecycle.JOINING,
        Lifecycle.WAITING,
        conditions=["announced", "round_complete", "not_closed"],
        unless=["round_full", "round_open", "excluded"],
    ),
    _edge(
        "admitted",
        Lifecycle.JOINING,
        Lifecycle.REDUNDANT,
        conditions=["announced", "round_complete", "round_full", "not_closed"],
        unless=["round_open"],
    ),
    _edge(
        "admitted",
        Lifecycle.JOINING,
        Lifecycle.REDUNDANT,
        conditions=["announced", "excluded", "not_closed"],
    ),
    _edge("finish", Lifecycle.COMPLETE, Lifecycle.TRAINING),
    _edge("finish", Lifecycle.EVICTED, Lifecycle.EXITED),
    # Heartbeats: only a member beats, and only when its interval has passed (a
    # joiner of a complete round renews a lease that is running out before its
    # join returns: see core.driver.decide).
    _edge(
        "keep_alive",
        [
            Lifecycle.WAITING,
            Lifecycle.REDUNDANT,
            Lifecycle.PARTICIPANT,
            Lifecycle.COMPLETE,
            Lifecycle.TRAINING,
        ],
        None,
        conditions=["keep_alive_due"],
    ),
    # Leaving: a join that timed out rolls back within the rollback period; a
    # trained node exits its round before the next join.
    _edge(
        "remove_from_participants",
        Lifecycle.PARTICIPANT,
        Lifecycle.JOINING,
        conditions=["timed_out", "within_rollback"],
    ),
    _edge(
        "remove_from_wait_list",
        Lifecycle.WAITING,
        Lifecycle.JOINING,
        conditions=["timed_out", "within_rollback"],
    ),
    _edge("remove_from_participants", Lifecycle.TRAINING, Lifecycle.EXITED, unless=["timed_out"]),
    # An agent that stops leaves for good: the next round does not wait for it.
    _edge("leave", [Lifecycle.TRAINING, Lifecycle.EXITED], Lifecycle.EXITED, unless=["timed_out"]),
    # A failed health check: the node leaves its round (its workers stop) and sits
    # out the next rounds; a node in no round only records its exclusion.
    _edge(
        "exclude",
        [Lifecycle.TRAINING, Lifecycle.EVICTED],
        Lifecycle.EXITED,
        unless=["rendezvous_closed", "timed_out", "excluded"],
    ),
    _edge(
        "exclude",
        [Lifecycle.IDLE, Lifecycle.EXITED],
        None,
        unless=["rendezvous_closed", "timed_out", "excluded"],
    ),
    # Its workers failed: the node counts the failure in the job-wide restart
    # budget (the failure after the budget is spent closes the rendezvous); its
    # exit and join follow as for any re-rendezvous.
    _edge(
        "charge_restart",
        [Lifecycle.TRAINING, Lifecycle.EVICTED],
        None,
        unless=["rendezvous_closed", "timed_out"],
    ),
    # An operation whose deadline passed fails; a redundant node waits without a
    # deadline, and a complete round returns before its deadline is looked at.
    _edge(
        "timeout",
        [
            Lifecycle.IDLE,
            Lifecycle.JOINING,
            Lifecycle.WAITING,
            Lifecycle.PARTICIPANT,
            Lifecycle.TRAINING,
            Lifecycle.EVICTED,
            Lifecycle.EXITED,
        ],
        Lifecycle.FAILED,
        conditions=["timed_out"],
    ),
    # Failure detection: a member whose heartbeat did not move is removed.
    _edge(
        "declared_dead",
        [Lifecycle.WAITING, Lifecycle.REDUNDANT, Lifecycle.PARTICIPANT, Lifecycle.COMPLETE],
        Lifecycle.JOINING,
    ),
    _edge("declared_dead", Lifecycle.TRAINING, Lifecycle.EVICTED),
    # Closing: any live node may close; every live node then stops.
    _edge("mark_rendezvous_closed", LIVE_STATES, None, unless=["rendezvous_closed"]),
    _edge("closed", LIVE_STATES, Lifecycle.CLOSED, conditions=["rendezvous_closed"]),
)


class View(NamedTuple):
    """One node's view before a step: what the model's guards may look at.

    ``now`` and ``deadline`` are on the node's own clock; ``deadline`` is None when
    the node runs no operation with a deadline. ``own`` is the node's sighting of
    its own counter, ``last_call`` its sighting of the last call. ``pending``: the
    joiners in the intent log of the state's round past its cursor (announced, not
    yet admitted).
    """

    node: NodeDesc
    state: RendezvousState
    settings: Settings
    now: float
    own: HeartbeatSighting | None = None
    last_call: LastCallSighting | None = None
    deadline: float | None = None
    pending: frozenset[NodeDesc] = frozenset()


class Guards(NamedTuple):
    """The protocol's conditions, evaluated on one :class:`View` (hashable; a
    named tuple, because guards are keys of the checker's memo tables and tuple
    hashing and comparison run in C)."""

    closed: bool
    round_complete: bool
    round_full: bool
    round_open: bool
    fills_round: bool
    quorum: bool
    last_call_over: bool
    keep_alive_due: bool
    timed_out: bool
    within_rollback: bool
    #: the node is in the round's intent log past the cursor (it announced itself)
    announced: bool = False
    #: the node excluded itself, and its exclusion runs past this round
    excluded: bool = False
    #: the open round is a regroup that expects nobody else
    all_back: bool = False

    @classmethod
    def of(cls, view: View) -> Guards:
        """Evaluate every guard from the protocol's definitions."""
        state, s, node, now = view.state, view.settings, view.node, view.now
        count = len(state.participants)
        # A heartbeat is due once the node's own counter has not moved for an interval.
        own = view.own
        beat_due = (
            node in state.heartbeats
            and own is not None
            and now - own.since >= s.keep_alive_interval
        )
        # The last call ends last_call_timeout after this node first saw it armed.
        sighting = view.last_call
        lc_over = (
            state.last_call is not None
            and sighting is not None
            and sighting.round == state.round
            and sighting.arming == state.last_call
            and now - sighting.since > s.last_call_timeout
        )
        deadline = view.deadline
        closed, complete = state.closed, state.complete
        # A regroup expects nobody else once every participant of the last complete
        # round that is not known gone is back and nobody else joined (the state
        # keeps both: returning, regroup), nobody waits, and no redundant node may
        # join (only one whose exclusion runs past this round may not).
        spare_may_join = any(state.excluded.get(n, 0) <= state.round for n in state.redundancy_list)
        all_back = (
            not complete
            and state.regroup
            and not state.returning
            and not state.wait_list
            and not spare_may_join
        )
        round_full = count >= s.max_nodes
        # (every field in order, one construction: the checker evaluates the
        # guards of each new step)
        return built(
            cls,
            (
                closed,
                complete,
                round_full,
                not closed and not complete and not round_full,  # round_open
                node not in state.participants and count + 1 == s.max_nodes,  # fills_round
                s.min_nodes <= count <= s.max_nodes,  # quorum
                lc_over,
                beat_due,  # keep_alive_due
                deadline is not None and now > deadline,  # timed_out
                deadline is not None and now <= deadline + s.rollback_period,  # within_rollback
                node in view.pending,  # announced
                bool(state.excluded) and state.excluded.get(node, 0) > state.round,  # excluded
                all_back,
            ),
        )


class ModelUnavailableError(RuntimeError):
    """Rendering the diagram needs graphviz's ``dot`` program, which is not installed."""


class _Node:
    """The model object the machine drives: its conditions read the current guards."""

    state: str

    def __init__(self) -> None:
        self.guards: Guards | None = None

    def _g(self, name: str) -> bool:
        if self.guards is None:
            raise RuntimeError("guards must be set before firing a trigger")
        return bool(getattr(self.guards, name))

    def rendezvous_closed(self) -> bool:
        return self._g("closed")

    def not_closed(self) -> bool:
        return not self._g("closed")

    def round_complete(self) -> bool:
        return self._g("round_complete")

    def round_full(self) -> bool:
        return self._g("round_full")

    def round_open(self) -> bool:
        return self._g("round_open")

    def fills_round(self) -> bool:
        return self._g("fills_round")

    def quorum(self) -> bool:
        return self._g("quorum")

    def last_call_over(self) -> bool:
        return self._g("last_call_over")

    def keep_alive_due(self) -> bool:
        return self._g("keep_alive_due")

    def timed_out(self) -> bool:
        return self._g("timed_out")

    def within_rollback(self) -> bool:
        return self._g("within_rollback")

    def announced(self) -> bool:
        return self._g("announced")

    def excluded(self) -> bool:
        return self._g("excluded")

    def all_back(self) -> bool:
        return self._g("all_back")


def _machine_kwargs() -> dict[str, Any]:
    return {
        "states": [str(s) for s in MODEL_STATES],
        "transitions": [dict(t) for t in MODEL_TRANSITIONS],
        "initial": str(Lifecycle.IDLE),
        "auto_transitions": False,
        "ignore_invalid_triggers": False,
        "send_event": False,
    }


class LifecycleModel:
    """The executable model: does an edge allow ``source --trigger--> dest``?

    Answers are memoized on (source, trigger, dest, guards): the model is a pure
    function of them, and the checker asks the same question many times.
    """

    def __init__(self) -> None:
        self._node = _Node()
        self._machine = Machine(model=self._node, **_machine_kwargs())
        self._memo: dict[tuple[str, str, str, Guards], bool] = {}

    @property
    def triggers(self) -> list[str]:
        return list(self._machine.get_triggers(*(str(s) for s in MODEL_STATES)))

    def allows(
        self, source: Lifecycle | str, trigger: str, dest: Lifecycle | str, guards: Guards
    ) -> bool:
        """True when the model has an edge from ``source`` on ``trigger`` whose guards
        hold and which lands in ``dest``."""
        key = (source, trigger, dest, guards)
        known = self._memo.get(key)
        if known is not None:
            return known
        self._machine.set_state(str(source), model=self._node)
        self._node.guards = guards
        try:
            fired = bool(getattr(self._node, trigger)())
        except (MachineError, AttributeError):
            fired = False
        allowed = fired and self._node.state == dest
        self._memo[key] = allowed
        return allowed


#: The lifecycle state a local phase stands for when membership does not refine it.
_AS_LIFECYCLE: dict[Phase, Lifecycle] = {p: Lifecycle(p.value) for p in LOCAL_PHASES}
#: The phases that stand for themselves outside the shared state.
_UNREFINED = frozenset({Phase.IDLE, Phase.JOINING, Phase.EXITED})


def lifecycle_state(phase: Phase, node: NodeDesc | None, state: RendezvousState) -> Lifecycle:
    """The model state of a node from its local phase and the shared state.

    ``phase`` is what the node is doing locally: one of :data:`LOCAL_PHASES`
    (``idle``, ``joining`` (runs the join operation), ``training`` (its join
    returned), ``exited``, ``closed``, ``failed``, ``crashed``; the strings do too).
    Membership in the shared state refines it.
    """
    if phase in TERMINAL_PHASES:
        return _AS_LIFECYCLE[phase]
    if node is not None:
        if node in state.wait_list:
            return Lifecycle.WAITING
        if node in state.redundancy_list:
            return Lifecycle.REDUNDANT
        if node in state.participants:
            if not state.complete:
                return Lifecycle.PARTICIPANT
            return Lifecycle.COMPLETE if phase == Phase.JOINING else Lifecycle.TRAINING
    if phase == Phase.TRAINING:
        return Lifecycle.EVICTED
    if phase not in _UNREFINED:
        raise ValueError(f"unknown local phase {phase!r}")
    return _AS_LIFECYCLE[phase]


#: Edges from every live state, left out of the drawing (they would cross it all)
#: and named in its title instead.
_UNIVERSAL_TRIGGERS = ("crash", "closed", "mark_rendezvous_closed")
_DIAGRAM_TITLE = (
    "rallypoint: lifecycle of one rendezvous node\n"
    "(from every live state: crash -> crashed; closed [rendezvous_closed] -> closed; "
    "mark_rendezvous_closed [!rendezvous_closed] internal)"
)


_Engine = Literal["graphviz", "mermaid"]


def _graph_machine(engine: _Engine) -> Any:
    from transitions.extensions import GraphMachine

    kwargs = _machine_kwargs()
    kwargs["transitions"] = [
        t for t in kwargs["transitions"] if t["trigger"] not in _UNIVERSAL_TRIGGERS
    ]
    kwargs["initial"] = str(Lifecycle.IDLE)
    return GraphMachine(
        model=_Node(),
        title=_DIAGRAM_TITLE,
        graph_engine=engine,
        show_conditions=True,
        **kwargs,
    )


def diagram_source(engine: str = "graphviz") -> str:
    """The diagram's source: graphviz ``dot`` text, or ``mermaid`` text for Markdown."""
    if engine not in ("graphviz", "mermaid"):
        raise ValueError(f"engine must be 'graphviz' or 'mermaid', got {engine!r}")
    return str(_graph_machine(cast(_Engine, engine)).get_graph().source)  # checked just above


def write_diagram(path: str | Path) -> Path:
    """Render the state diagram to ``path`` (format from the suffix, e.g. ``.png``).

    Raises:
        ModelUnavailableError: graphviz's ``dot`` is not on PATH (install the
            ``graphviz`` system package, e.g. ``apt-get install graphviz``).
    """
    target = Path(path)
    if shutil.which("dot") is None:
        raise ModelUnavailableError(
            "rendering the diagram needs graphviz's 'dot' program: install the graphviz "
            "system package (Debian/Ubuntu: apt-get install graphviz), or write the "
            "source with 'rallypoint spec diagram --source'"
        )
    fmt = target.suffix.lstrip(".") or "png"
    target.parent.mkdir(parents=True, exist_ok=True)
    _graph_machine("graphviz").get_graph().draw(str(target), format=fmt, prog="dot")
    return target
