"""An explicit-state model checker of the real core, run by its driver.

Breadth-first search over every interleaving of node events in a small cluster:
nodes step their operations, their timers run out, they crash, restart, join, exit,
close and heartbeat, and silent peers expire. A step is one iteration of the
driving loop, carried out atomically: the node's view is the shared state and its
heartbeat counters read at that instant; :func:`rallypoint.core.driver.decide` (the
same driver StateSync and the simulator execute, looked up at call time so that a
test can plant a bug in it or in the core it calls) names the instruction, and the
checker carries it out:

* ``Write`` wins its compare-and-set: its state is the new shared state. A lost
  one changes nothing shared, and its node decides again on what beat it: that is
  another step of the search.
* ``Beat`` bumps the node's side heartbeat counter, ``Wait`` waits: neither
  changes the shared state. Side counters are not modelled: every step chooses the
  ages of the node's sightings afresh, which covers every way they could move.
* ``Announce`` appends the node to the current round's intent log (part of the
  shared state of the search). ``Read(intents=True)`` is carried out within the
  step: the log is read at the same instant as the state, and the driver decides
  again on it (a batch write admitting the logged joiners, usually).
* ``Done`` ends the operation (what a join returns must be what the state it
  returned on holds, which with the step properties implies agreement). A join
  done with ``rejoin`` (its round lost rank 0) also finishes into training: the
  handler then exits that round and joins the next, which a trained node's exit and
  join events explore with every deadline.
* ``Read`` on a view read at this instant is a violation: an executor would read
  the same view and be told to read again, forever.

In every reachable state the checker verifies :mod:`rallypoint.spec.invariants`
(state, step, removal, admission and agreement properties), that every node's
lifecycle change is an edge of the :mod:`rallypoint.spec.model` whose guards hold
(conformance), and that no write leaves a waiter asleep: a write that publishes no
new phase leaves the decision of every node waiting on the state as it was (see
:meth:`Checker._missed_wakeups`).

The state space is made finite and small the way TLA+ specs do it:

* **Time as coarse ticks of each timer.** Each node's clock is kept relative to its
  own ``now`` (= 0), and every timer the core can test is reduced to the few values
  its thresholds distinguish: a sighting of a peer is *fresh* or *expired* (older
  than the liveness window); the node's own sighting is *fresh*, *due* (a keep-alive
  interval old) or *expired*; a last call is *running* or *over*; an operation is
  *before* its deadline, *timed out* within the rollback period, or *past* it. Only
  the node itself reads its timers, so each step chooses how far they ran since the
  node last looked (a deadline only moves on). Every order of expiries is explored,
  so the search covers every clock offset and drift between nodes (it
  over-approximates real time, which is sound for safety properties).
* **Returns checked, not kept.** What a join returned is checked against the
  state it returned on when it returns, and not kept: with the step properties
  that implies agreement between any two returns of a round (see
  :func:`rallypoint.spec.invariants.check_return`).
* **Local events merged into steps.** Starting a join, exit or close changes only
  the node's own local state, which commutes with every other node's events, so it
  is taken together with the operation's first step.
* **Counters as equalities.** Only whether a sighting equals the counter matters, so
  heartbeat counters, ``heartbeat_seq`` and last-call armings are renumbered to a
  few canonical values that keep every equality the core can test (a step's
  sightings are made over the counters it reads, so no older value is compared).
  The phase number is 0 in every stored state: only whether a write publishes a
  new phase matters, and the step that writes tells that.
* **The intent log as a set.** Only the log's entries past ``intent_cursor`` matter
  to a decision, and the driver admits them in node order, so a stored state keeps
  them as a set with the cursor at 0; a new round's log is empty. (An Announce to a
  round other than the state's, the one case where the rest of a log would matter,
  is itself a violation.)
* **Contention as a choice.** A compare-and-set never loses here; a lost one changes
  nothing shared, so each join step that writes may also be taken as if the node
  had lost one since its last wait (see :meth:`Checker.expand`).
* **Symmetry.** Nodes are interchangeable: a state is stored under the least of its
  relabellings by node permutation (CockroachDB's TLA+ does the same). Ranks move
  with their nodes, so a stored state may be a rank-permutation of a reachable one;
  every property checked is invariant under that.
* **Rounds as a relative number.** The core only increments the round and compares
  rounds for equality, so states are stored with the round renumbered to 0.
  Every round's states are then the same finite set, and the search covers every
  round, not a prefix of them. ``max_round`` turns this off and bounds the rounds
  instead.
* **Bounds.** Crashes are bounded. A crashed node restarts at once with a new pid:
  the restart is local, so it commutes with everything between, and a node that
  restarts and stays idle acts as one that never came back.

Visited states are kept as 64-bit fingerprints (as TLC does), with a parent pointer,
so a violation is replayed from the initial state into a readable trace.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import multiprocessing
import re
import time
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import NamedTuple

from immutables import Map

from ..core import (
    Announce,
    Beat,
    CloseOp,
    Decision,
    Done,
    ExitOp,
    HeartbeatSighting,
    JoinOp,
    KeepAliveOp,
    LastCallSighting,
    NodeDesc,
    NodeView,
    Observations,
    Operator,
    Read,
    RendezvousState,
    Settings,
    Wait,
    Write,
    heartbeat_of,
)
from ..core import driver as core_driver
from ..core.actions import Action
from ..core.errors import InvalidTransitionError
from .invariants import (
    check_admissions,
    check_removal_published,
    check_return,
    check_state,
    check_transition,
)
from .model import Guards, LifecycleModel, View, lifecycle_state

__all__ = [
    "CheckConfig",
    "CheckResult",
    "Checker",
    "CheckerConfigError",
    "Event",
    "Global",
    "Timers",
    "Violation",
    "check",
    "describe",
]


class CheckerConfigError(ValueError):
    """The checker configuration is out of range (the message names the field)."""


@dataclass(frozen=True)
class CheckConfig:
    """What to check.

    Attributes:
        nodes: cluster size (node slots; a restart reuses its slot with a new pid).
        min_nodes, max_nodes: the rendezvous settings.
        max_round: None (the default) explores every round through the round
            abstraction; a number keeps concrete round numbers and checks states
            beyond that round without expanding them.
        max_crashes: crashes in one run (each crash allows one restart).
        allow_close: whether nodes may close the rendezvous.
        stable_ranks: the settings' stable-ranks option (ranks kept across rounds).
        symmetry: store states modulo node permutations.
        max_states: stop after this many distinct states (None: explore all).
    """

    nodes: int = 3
    min_nodes: int = 2
    max_nodes: int = 3
    max_round: int | None = None
    max_crashes: int = 1
    allow_close: bool = True
    stable_ranks: bool = False
    symmetry: bool = True
    max_states: int | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise CheckerConfigError(f"nodes must be at least 1, got {self.nodes}")
        for name in ("max_round", "max_crashes"):
            if (getattr(self, name) or 0) < 0:
                raise CheckerConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_states is not None and self.max_states < 1:
            raise CheckerConfigError(f"max_states must be positive, got {self.max_states}")
        try:
            self.settings()
        except ValueError as exc:
            raise CheckerConfigError(str(exc)) from None

    def settings(self) -> Settings:
        """The core settings of the search. Only their ratios matter: every timer
        value the search uses sits on one side of each threshold."""
        return Settings(
            run_id="check",
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            join_timeout=10.0,
            # distinct from the keep-alive interval and the deadline (1.0 ahead), so
            # that a Wait's wake time tells which timer it waits for
            last_call_timeout=0.5,
            close_timeout=10.0,
            heartbeat_timeout=10.0,
            keep_alive_interval=1.0,
            keep_alive_max_attempt=2,
            rollback_period=1.0,
            stable_ranks=self.stable_ranks,
        )


class Local(NamedTuple):
    """One node slot's local state (its clock's ``now`` is always 0).

    Sightings are not kept: every step chooses their ages afresh (see
    :meth:`Checker.expand`). Nor is what a join returned: each return is checked
    against the state it returned on, which implies agreement (see
    :func:`rallypoint.spec.invariants.check_return`).
    """

    incarnation: int
    #: idle, joining, training, exited, closed, failed, crashed (see lifecycle_state)
    phase: str
    #: the running operation: None, "join", "exit" or "close"
    op: str | None
    #: the operation's deadline relative to now: BEFORE, TIMED_OUT or PAST
    deadline: float | None


class CoreStep(NamedTuple):
    """What the driver decided in one step, and what carrying it out did (see
    :meth:`Checker._core_step`)."""

    decision: Decision
    #: the action the node carried out: the Write's (None for a Write that only
    #: publishes removals), Beat's KEEP_ALIVE, Wait's SYNC, Done's
    performed: Action | None
    #: the shared state after the step (the Write's state; else the state before)
    written: RendezvousState
    #: the model's guards on the stepping node's view before its action
    guards: Guards
    #: the current round's intent log past the cursor after the step
    intents: frozenset[NodeDesc]
    #: whether the node read the intent log within the step (a Read(intents=True))
    read_log: bool


class Global(NamedTuple):
    """A state of the search: the shared state, every slot's local state, and the
    entries of the current round's intent log past the state's cursor."""

    shared: RendezvousState
    locals: tuple[Local, ...]
    crashes: int
    #: joiners that announced themselves in the current round and were not yet
    #: admitted (the log past ``intent_cursor``; see :meth:`Checker._normalize`)
    intents: frozenset[NodeDesc] = frozenset()


class Timers(NamedTuple):
    """How much time a node's clock let pass since it last looked, as the few
    values the core's thresholds tell apart (see :meth:`Checker.expand`)."""

    #: peers whose heartbeat the node saw stand still longer than the liveness window
    expired: frozenset[NodeDesc]
    #: the node's own sighting: "fresh", "due" (a keep-alive interval old), "expired"
    own: str
    #: whether an armed last call is over
    last_call_over: bool
    #: the running operation's deadline (None for a keep-alive): before, timed out, past
    deadline: float | None
    #: a compare-and-set of the node lost since its last wait (join steps whose
    #: decision is an admission only; see :meth:`Checker.expand`)
    contended: bool = False


@dataclass(frozen=True)
class Event:
    """One event of a search: what happens to which node slot.

    A step (and ``join``/``exit``/``close``, which start an operation and take its
    first step at once) carries the ``timers`` the node sees; see
    :meth:`Checker.expand`.
    """

    kind: str
    slot: int
    timers: Timers | None = None


@dataclass
class Violation:
    """A broken property, with the trace that reaches it from the initial state."""

    problems: list[str]
    trace: list[str]

    def format(self) -> str:
        lines = ["VIOLATION:", *(f"  - {p}" for p in self.problems), "trace:"]
        lines += [f"  {line}" for line in self.trace]
        return "\n".join(lines)


@dataclass
class CheckResult:
    """The outcome of a search."""

    config: CheckConfig
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = True
    violation: Violation | None = None
    lifecycle_edges: set[tuple[str, str, str]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def summary(self) -> str:
        c = self.config
        scope = (
            "stopped at the first violation"
            if self.violation is not None
            else "full state space"
            if self.complete
            else f"stopped at {c.max_states} states"
        )
        lines = [
            f"config: nodes={c.nodes} min={c.min_nodes} max={c.max_nodes} "
            f"max_round={'all' if c.max_round is None else c.max_round} "
            f"max_crashes={c.max_crashes} close={c.allow_close} "
            f"stable_ranks={c.stable_ranks} symmetry={c.symmetry}",
            f"states explored: {self.states} ({scope})",
            f"transitions: {self.transitions}",
            f"depth: {self.depth}",
            f"seconds: {self.seconds:.2f}",
            f"lifecycle edges exercised: {len(self.lifecycle_edges)}",
        ]
        lines.append("result: no violation" if self.ok else "result: VIOLATION")
        if self.violation is not None:
            lines.append(self.violation.format())
        return "\n".join(lines)


class _Found(Exception):
    def __init__(self, problems: list[str], decision: Decision | None = None) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
        #: the driver's decision in the violating step, if it made one
        self.decision = decision
        #: what the violating step did, for the trace
        self.lines: list[str] = []
        #: whether the violating step read the intent log
        self.read_log = False
        #: the event of the violating step, when the search did not know it
        self.event: Event | None = None


#: Seconds between two progress reports of a search.
_PROGRESS_INTERVAL = 0.5
#: Memoized core steps kept at most (a bound on memory, not on the search).
_CORE_STEP_CACHE = 500_000
_TERMINAL_PHASES = frozenset({"closed", "failed", "crashed"})
#: Events that run one iteration of the node's driving loop (see Checker.expand).
_STEPPING_EVENTS = frozenset({"step", "heartbeat", "join", "exit", "close"})
#: The operators behind the operations a node starts.
_OPERATORS: dict[str, Callable[[], Operator]] = {
    "join": JoinOp,
    "exit": ExitOp,
    "close": CloseOp,
}


_NO_OBSERVATIONS = Observations()
#: Peer edges have no guards; their checks pass this placeholder.
_NO_GUARDS = Guards(*([False] * len(fields(Guards))))
_NODE_RE = re.compile(r"\bn(\d+)_(\d+)_0\b")
_OBSERVATION_FIELDS = frozenset(f.name for f in fields(Observations))


def make_observations(
    heartbeats: Mapping[NodeDesc, HeartbeatSighting], last_call: LastCallSighting | None
) -> Observations:
    """Observations holding exactly these sightings.

    The checker makes sightings of their own (chosen ages); the core's Observations
    carry caches derived from the sightings, which must match them, or
    ``dead_nodes`` would act on stale ones: ``oldest`` is rebuilt here, and the
    caches of what the sightings were taken from are left empty (``observe`` then
    compares every counter, and finds each equal to its sighting).
    """
    beats = Map(heartbeats)
    caches: dict[str, object] = {}
    if "oldest" in _OBSERVATION_FIELDS:
        caches["oldest"] = min((h.since for h in beats.values()), default=None)
    return Observations(heartbeats=beats, last_call=last_call, **caches)  # type: ignore[arg-type]


@functools.cache
def node_of(slot: int, incarnation: int) -> NodeDesc:
    """The node of a slot's incarnation (a restart is a new process: a new pid)."""
    return NodeDesc(f"n{slot}", 100 + incarnation, 0)


class Checker:
    """Breadth-first model checker over a :class:`CheckConfig`."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.settings = config.settings()
        self.model = LifecycleModel()
        window = self.settings.liveness_window
        interval = self.settings.keep_alive_interval
        rollback = self.settings.rollback_period
        #: sighting ages: fresh -> due (own only) -> expired
        self._fresh, self._due, self._expired = 0.0, -interval, -(window + 1.0)
        #: deadline values relative to now
        self._before = 1.0
        self._timed_out = -rollback if rollback > 0 else None
        self._past = -(rollback + 1.0)
        self._call_over = -(self.settings.last_call_timeout + 1.0)
        #: the deadline's values in the order time moves them
        self._deadlines = tuple(
            d for d in (self._before, self._timed_out, self._past) if d is not None
        )
        self.edges: set[tuple[str, str, str]] = set()
        self._core_steps: dict[tuple[object, ...], CoreStep] = {}
        #: steps already conformed (see _step)
        self._conformed: set[tuple[object, ...]] = set()
        #: (id of a memoized core step, a waiting node, its deadline) -> missed wake-ups
        self._wakeups: dict[tuple[object, ...], list[str]] = {}
        self._normal_forms: dict[int, tuple[RendezvousState, int, RendezvousState]] = {}
        #: (shared state, intent log, event kind, slot, local) -> events (see choices)
        self._choices: dict[tuple[object, ...], tuple[list[Event], list[Event]]] = {}
        #: (state, node) -> the view a read of it gives; (state, node, timers but
        #: the deadline) -> the sightings a step chooses (see _view)
        self._reads: dict[tuple[RendezvousState, NodeDesc], NodeView] = {}
        self._sightings: dict[tuple[object, ...], Observations] = {}
        #: state -> (relabelling, fingerprint); (shared, intents, relabelling) -> key
        self._fingerprints: dict[Global, tuple[tuple[int, ...], int]] = {}
        self._shared_keys: dict[tuple[object, ...], tuple[object, ...]] = {}
        #: fingerprints a worker process handed back already (see _step_chunk)
        self._handed_out: set[int] = set()
        #: lifecycle edges a chunk reported already (see _step_chunk)
        self._edges_reported: set[tuple[str, str, str]] = set()
        #: transitions checked whose successors are not stored (see choices)
        self.checked_transitions = 0
        #: whether steps describe themselves (only replay needs it)
        self._narrate = False
        #: the problems of the last replayed violation, in the trace's node names
        self.last_problems: list[str] = []

    # -- states ------------------------------------------------------------------

    def initial(self) -> Global:
        locals_ = tuple(Local(0, "idle", None, None) for _ in range(self.config.nodes))
        return self._normalize(Global(RendezvousState(), locals_, 0))

    def _normalize(self, g: Global, shift_rounds: bool = True) -> Global:
        """Forget what no future step can tell apart.

        * Heartbeat counter values and last-call arming numbers (the steps choose the
          ages of sightings afresh, see :meth:`expand`), and the phase number: only
          whether a write publishes a new phase matters (a waiter's Wait ends on
          any phase above the one it read), and the step tells that.
        * The intent log: only its entries past ``intent_cursor`` (joiners that
          announced and were not admitted yet) matter to any decision, so a state
          keeps them as a set (``Global.intents``, computed by the step) and the
          cursor as 0. A new round's log starts empty.
        * The round number (the round abstraction, when ``max_round`` is None): the
          core only increments rounds and compares them for equality, so a state and
          its copy with every round number shifted step alike. Rounds are renumbered
          to start at 0, which makes every round's states the same finite set.
          ``replay`` keeps concrete rounds (``shift_rounds=False``) for its trace.
        """
        shift = g.shared.round if shift_rounds and self.config.max_round is None else 0
        return Global(self._normal_shared(g.shared, shift), g.locals, g.crashes, g.intents)

    def _normal_shared(self, state: RendezvousState, shift: int) -> RendezvousState:
        # Core steps are memoized, so the same written state comes back many times:
        # remember its normal form by identity (the entry keeps it alive).
        known = self._normal_forms.get(id(state))
        if known is not None and known[0] is state and known[1] == shift:
            return known[2]
        normal = state
        if (
            shift
            or any(c != 1 for c in state.heartbeats.values())
            or state.last_call_seq != 1
            or state.last_call not in (None, 1)
            or state.heartbeat_seq != 1
            or state.phase
            or state.intent_cursor
        ):
            normal = state.evolve(
                round=state.round - shift,
                heartbeats=dict.fromkeys(state.heartbeats, 1),
                heartbeat_seq=1,
                last_call=None if state.last_call is None else 1,
                last_call_seq=1,
                phase=0,
                intent_cursor=0,
            )
        if len(self._normal_forms) >= _CORE_STEP_CACHE:
            self._normal_forms.clear()
        self._normal_forms[id(state)] = (state, shift, normal)
        return normal

    def expand(self, g: Global, event: Event) -> Iterator[Event]:
        """The concrete events of ``event``: a step, for every way the node's timers
        may have run since it last looked.

        Between two steps of a node any amount of its local time may pass, and its
        peers may stall for any time. So at each step any subset of the other members
        may have been silent for longer than the liveness window, the node's own
        heartbeat may be fresh, due or expired, and an armed last call may be over.
        This is the asynchronous model with an unreliable failure detector: it
        contains every real timing (any clock offset, drift, scheduling delay), so a
        safety property that holds here holds in every real run. Whether real
        clocks declare only really silent nodes dead is the simulator's question.

        Contention is a choice too. A compare-and-set never loses in this atomic
        model, but a lost one changes nothing shared, so a node may have lost one
        (against a write the search does not need to show) at any step since its
        last wait: a join step whose decision is a write of the node's own action
        is also taken with ``contended`` set (the driver then joins through the
        intent log). A connection error also clears the flag (the executor waits),
        so both values are real at every such step.
        """
        if event.kind not in _STEPPING_EVENTS:
            yield event
            return
        loc = g.locals[event.slot]
        node = node_of(event.slot, loc.incarnation)
        state = g.shared
        peers = sorted(n for n in state.heartbeats if n != node)
        own = ("fresh", "due", "expired") if node in state.heartbeats else ("fresh",)
        over = (False, True) if state.last_call is not None else (False,)
        subsets = itertools.chain.from_iterable(
            itertools.combinations(peers, k) for k in range(len(peers) + 1)
        )
        # A deadline only moves on, and only its own node reads it; so it is chosen
        # when that node steps, not interleaved as events of its own.
        if event.kind == "heartbeat":
            deadlines: tuple[float | None, ...] = (None,)
        elif event.kind == "step":
            deadlines = self._deadlines[self._deadlines.index(loc.deadline) :]
        else:
            deadlines = self._deadlines
        kind, slot = event.kind, event.slot
        joins = kind == "join" or (kind == "step" and loc.op == "join")
        for expired, mine, lc, dl in itertools.product(list(subsets), own, over, deadlines):
            timers = Timers(frozenset(expired), mine, lc, dl)
            yield Event(kind, slot, timers)
            if joins and self._contention_matters(g, node, timers):
                yield Event(kind, slot, timers._replace(contended=True))

    def choices(self, g: Global, event: Event) -> tuple[list[Event], list[Event]]:
        """The concrete events of ``event`` (see :meth:`expand`), split in two: the
        events whose successors the search stores, and the events it only checks.

        Two reductions, both argued in docs/spec.md ("Deadline subsumption"):

        * A step's successor is a function of what the driver decided and wrote
          (:class:`CoreStep`) and of the deadline the step chose. Of the timer
          choices that agree on the first, the successor of the earliest deadline
          simulates the others: they differ only in that node's deadline, a later
          deadline allows a subset of the node's next steps, and no other node
          reads it. So only the earliest is stored; the others are checked.
        * A Wait or a Beat writes nothing shared: its successor is the state
          itself or the state with the node's deadline later, which the state
          simulates. They are checked, not stored.

        Every combination of decision and guards is checked (the guards hold the
        timers the model's conformance reads); a choice whose core step is itself a
        violation is stored, so that the search reports it. The split depends only
        on the shared state, the intent log and the node's own local state, which
        many states share: it is memoized on those.
        """
        if event.kind not in _STEPPING_EVENTS:
            return [event], []
        loc = g.locals[event.slot]
        key = (g.shared, g.intents, event.kind, event.slot, loc.incarnation, loc.op, loc.deadline)
        known = self._choices.get(key)
        if known is not None:
            return known
        node = node_of(event.slot, loc.incarnation)
        if event.kind == "heartbeat":
            op: Operator = KeepAliveOp()
        else:
            name = loc.op if event.kind == "step" else event.kind
            assert name is not None  # "step" events are made only while loc.op is set
            op = _OPERATORS[name]()
        stored: dict[tuple[object, ...], Event] = {}
        checked: list[Event] = []
        violations: list[Event] = []
        # A step's checks depend on the decision, what carrying it out did, and
        # the guards, not on the deadline: one event checks each combination.
        checks: set[tuple[object, ...]] = set()
        # expand() yields the deadlines in the order time moves them: the first
        # event of an outcome has its earliest deadline
        for concrete in self.expand(g, event):
            timers = concrete.timers
            assert timers is not None
            deadline = self._before if event.kind == "heartbeat" else timers.deadline
            try:
                step = self._core_step(g.shared, node, op, timers, deadline, g.intents)
            except _Found:
                violations.append(concrete)
                continue
            instruction = step.decision.instruction
            check = (step.decision, step.performed, step.guards, step.intents)
            if isinstance(instruction, (Wait, Beat)):
                if check not in checks:
                    checks.add(check)
                    checked.append(concrete)
                continue
            outcome = (instruction, step.performed, step.written, step.intents)
            if stored.setdefault(outcome, concrete) is concrete:
                checks.add(check)
            elif check not in checks:
                checks.add(check)
                checked.append(concrete)
        known = ([*violations, *stored.values()], checked)
        if len(self._choices) >= _CORE_STEP_CACHE:
            self._choices.clear()
        self._choices[key] = known
        return known

    def _contention_matters(self, g: Global, node: NodeDesc, timers: Timers) -> bool:
        """Whether a lost compare-and-set changes the join step of ``node`` with
        ``timers``: the uncontended step writes an action of its own (a node only
        loses a compare-and-set on its way to one), and the contended decision
        differs from it."""
        state, intents, deadline = g.shared, g.intents, timers.deadline
        try:
            step = self._core_step(state, node, JoinOp(), timers, deadline, intents)
        except _Found:
            return False  # the step itself is a violation; it is reported as it is
        instruction = step.decision.instruction
        if not isinstance(instruction, Write) or instruction.action is None:
            return False
        contended = timers._replace(contended=True)
        try:
            other = self._core_step(state, node, JoinOp(), contended, deadline, intents)
        except _Found:
            return True  # the contended step is a violation: explore it to report it
        return other.decision.instruction != instruction or other.intents != step.intents

    def _aged(self, state: RendezvousState, node: NodeDesc, timers: Timers) -> Observations:
        """Sightings of every member of ``state``, aged as ``timers`` says.

        A sighting watches the pair (state counter, side counter); the side counters
        the view holds are all 0, so each sighting equals what a read at this instant
        shows, and a re-read within the step keeps its age.
        """
        expired, mine, lc = timers.expired, timers.own, timers.last_call_over
        key = (state, node, expired, mine, lc)
        known = self._sightings.get(key)
        if known is not None:
            return known
        own = {"fresh": self._fresh, "due": self._due, "expired": self._expired}[mine]
        beats = {
            n: HeartbeatSighting(
                heartbeat_of(c, 0), own if n == node else self._expired if n in expired else 0.0
            )
            for n, c in state.heartbeats.items()
        }
        call = None
        if state.last_call is not None:
            since = self._call_over if lc else 0.0
            call = LastCallSighting(state.round, state.last_call, since)
        if len(self._sightings) >= _CORE_STEP_CACHE:
            self._sightings.clear()
        known = self._sightings[key] = make_observations(beats, call)
        return known

    # -- symmetry ----------------------------------------------------------------

    @staticmethod
    def _signature(g: Global, slot: int) -> tuple[object, ...]:
        """Label-free facts about a slot, to order slots before breaking ties."""
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        s = g.shared
        role = (
            ("p", s.participants[node])
            if node in s.participants
            else ("w", 0)
            if node in s.wait_list
            else ("r", 0)
            if node in s.redundancy_list
            else ("-", 0)
        )
        return (
            loc.incarnation,
            loc.phase,
            loc.op or "",
            _deadline_code(loc.deadline),
            role,
            s.last_ranks.get(node, -1),
            s.heartbeats.get(node, 0),
            node in g.intents,
        )

    def _key(self, g: Global, perm: tuple[int, ...]) -> tuple[object, ...]:
        """The state as sortable primitives, slots relabelled by ``perm``."""

        def lab(n: NodeDesc) -> tuple[int, int]:
            return (perm[int(n.addr[1:])], n.pid)

        s = g.shared
        memo = (s, g.intents, perm)
        shared = self._shared_keys.get(memo)
        if shared is None:
            if len(self._shared_keys) >= _CORE_STEP_CACHE:
                self._shared_keys.clear()
            shared = self._shared_keys[memo] = self._shared_key(s, g.intents, lab)
        slots: list[tuple[object, ...]] = [()] * len(g.locals)
        for i, loc in enumerate(g.locals):
            code = _deadline_code(loc.deadline)
            slots[perm[i]] = (loc.incarnation, loc.phase, loc.op or "", code)
        return (shared, tuple(slots), g.crashes)

    @staticmethod
    def _shared_key(
        s: RendezvousState,
        intents: frozenset[NodeDesc],
        lab: Callable[[NodeDesc], tuple[int, int]],
    ) -> tuple[object, ...]:
        return (
            s.round,
            s.complete,
            s.closed,
            s.world_size,
            tuple(sorted((lab(n), r) for n, r in s.participants.items())),
            tuple(sorted(lab(n) for n in s.wait_list)),
            tuple(sorted(lab(n) for n in s.redundancy_list)),
            tuple(sorted((lab(n), c) for n, c in s.heartbeats.items())),
            s.last_call or 0,
            tuple(sorted((lab(n), r) for n, r in s.last_ranks.items())),
            tuple(sorted(lab(n) for n in intents)),
        )

    def _permutations(self, g: Global) -> Iterator[tuple[int, ...]]:
        n = len(g.locals)
        if not self.config.symmetry:
            yield tuple(range(n))
            return
        sigs = [self._signature(g, i) for i in range(n)]
        order = sorted(range(n), key=lambda i: sigs[i])
        groups = [list(grp) for _, grp in itertools.groupby(order, key=lambda i: sigs[i])]
        for choice in itertools.product(*(itertools.permutations(grp) for grp in groups)):
            ordered = [i for grp in choice for i in grp]
            perm = [0] * n
            for new, old in enumerate(ordered):
                perm[old] = new
            yield tuple(perm)

    def fingerprint(self, g: Global) -> tuple[tuple[int, ...], int]:
        """The relabelling to ``g``'s representative and the representative's
        64-bit fingerprint (memoized: most successors were reached before)."""
        known = self._fingerprints.get(g)
        if known is None:
            if len(self._fingerprints) >= _CORE_STEP_CACHE:
                self._fingerprints.clear()
            known = self._fingerprints[g] = self._least(g)
        return known

    def _least(self, g: Global) -> tuple[tuple[int, ...], int]:
        best_key: tuple[object, ...] | None = None
        best_perm: tuple[int, ...] = tuple(range(len(g.locals)))
        for perm in self._permutations(g):
            key = self._key(g, perm)
            if best_key is None or key < best_key:
                best_key, best_perm = key, perm
        return best_perm, hash(best_key)

    def canonical(self, g: Global) -> tuple[Global, tuple[int, ...], int]:
        """The stored representative of ``g``, the permutation used, its fingerprint."""
        perm, fp = self.fingerprint(g)
        return relabel(g, perm), perm, fp

    # -- events ------------------------------------------------------------------

    def events(self, g: Global) -> Iterator[Event]:
        """Every event enabled in ``g``."""
        cfg = self.config
        for i, loc in enumerate(g.locals):
            if loc.phase in _TERMINAL_PHASES:
                continue
            if g.crashes < cfg.max_crashes:
                yield Event("crash", i)
            if loc.op is not None:
                yield Event("step", i)
                continue
            if loc.phase in ("idle", "exited") or (
                loc.phase == "training" and not self._member(g, i)
            ):
                yield Event("join", i)
            if loc.phase == "training":
                yield Event("heartbeat", i)
                yield Event("exit", i)
            if cfg.allow_close and not g.shared.closed:
                yield Event("close", i)

    @staticmethod
    def _member(g: Global, slot: int) -> bool:
        return node_of(slot, g.locals[slot].incarnation) in g.shared.members()

    def _model_state(self, g: Global, slot: int, shared: RendezvousState | None = None) -> str:
        loc = g.locals[slot]
        return lifecycle_state(
            loc.phase, node_of(slot, loc.incarnation), g.shared if shared is None else shared
        )

    def _expect(self, src: str, trigger: str, dst: str, guards: Guards, who: NodeDesc) -> None:
        if not self.model.allows(src, trigger, dst, guards):
            raise _Found(
                [
                    f"conformance: {who} went {src} --{trigger}--> {dst}, "
                    f"which the model does not allow (guards: {_true_guards(guards)})"
                ]
            )
        self.edges.add((src, trigger, dst))

    def successor(
        self, g: Global, event: Event, check_only: bool = False
    ) -> tuple[Global, list[str]]:
        """The state after ``event``, and a line describing it. With
        ``check_only``, only check the step: what it returns is then undefined.

        Raises:
            _Found: a property or the model's conformance is violated by this step.
        """
        slot = event.slot
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        if event.kind in ("crash", "join"):
            before = self._model_state(g, slot)
            guards = Guards.of(View(node, g.shared, self.settings, 0.0, _NO_OBSERVATIONS))
        if event.kind == "crash":
            # The restart is taken at once: it changes only the slot's local state,
            # which no other event reads, and a restarted node that stays idle acts
            # as one that never came back.
            self._expect(before, "crash", "crashed", guards, node)
            new = Local(loc.incarnation + 1, "idle", None, None)
            restarted = node_of(slot, loc.incarnation + 1)
            return _with(g, slot, new, crashes=g.crashes + 1), [f"crashed, restarts as {restarted}"]
        if event.kind not in _STEPPING_EVENTS:
            raise ValueError(f"unknown event {event.kind!r}")
        if event.timers is None:
            raise ValueError(f"a {event.kind} event needs its timers (see expand)")
        if event.kind == "heartbeat":
            return self._step(g, slot, KeepAliveOp(), event.timers, check_only)
        if event.kind == "step":
            return self._step(g, slot, _OPERATORS[loc.op or ""](), event.timers, check_only)
        # Starting an operation changes only the node's own local state, which no
        # other event reads, so it is taken together with the operation's first step
        # (the start commutes with every event between the two).
        if event.kind == "join":
            new = loc._replace(phase="joining", op="join", deadline=self._before)
            started = _with(g, slot, new)
            self._expect(before, "join", self._model_state(started, slot), guards, node)
        else:
            started = _with(g, slot, loc._replace(op=event.kind, deadline=self._before))
        try:
            after, lines = self._step(
                started, slot, _OPERATORS[event.kind](), event.timers, check_only
            )
        except _Found as found:
            found.lines = [f"starts {event.kind}", *found.lines]
            raise
        return after, [f"starts {event.kind}", *lines]

    def _view(
        self,
        state: RendezvousState,
        node: NodeDesc,
        timers: Timers,
        pending: frozenset[NodeDesc] = frozenset(),
    ) -> NodeView:
        """The node's view at this step: ``state`` and every member's side counter
        read at this instant (so never too old to judge liveness on), with its
        sightings aged as ``timers`` says; ``contended`` as the timers choose, and
        ``announced`` when the node is in the round's intent log past the cursor.

        The side counters are all 0: only whether a sighting equals the counter
        matters, and every step chooses the sightings' ages afresh.
        """
        read = self._reads.get((state, node))
        if read is None:
            if len(self._reads) >= _CORE_STEP_CACHE:
                self._reads.clear()
            counters = self._counters(state)
            read = core_driver.after_read(NodeView(), node, state, counters, 0.0)
            self._reads[state, node] = read
        return read._replace(
            observations=self._aged(state, node, timers),
            contended=timers.contended,
            announced=state.round if node in pending else -1,
        )

    @staticmethod
    def _counters(state: RendezvousState) -> Map[NodeDesc, int]:
        return Map({n: 0 for n in state.heartbeats})

    def _core_step(
        self,
        state: RendezvousState,
        node: NodeDesc,
        op: Operator,
        timers: Timers,
        deadline: float | None,
        pending: frozenset[NodeDesc] = frozenset(),
    ) -> CoreStep:
        """The driver's part of a step, carried out atomically: a pure function of
        its arguments, so it is memoized (most states share their shared state and
        timers with others).

        ``pending`` is the current round's intent log past the cursor. The driver
        sees it as the whole log, in node order, with the cursor at 0 (the state
        is normalized so): only the entries past the cursor matter to a decision.
        """
        key = (state, node, type(op), timers, deadline, pending)
        hit = self._core_steps.get(key)
        if hit is not None:
            return hit
        settings = self.settings
        view = self._view(state, node, timers, pending)
        limit = float(deadline) if deadline is not None else float("inf")
        log = tuple(sorted(pending))
        read_log = False
        try:
            decision = core_driver.decide(view, node, settings, op, limit, 0.0)
            instruction = decision.instruction
            if (
                isinstance(instruction, Read)
                and getattr(instruction, "intents", False)
                and view.intents_round != state.round
            ):
                # The intent log, read at this same instant with the state it
                # belongs to: the node then decides again within the step.
                counters = self._counters(state) if instruction.counters else None
                view = core_driver.after_read(view, node, state, counters, 0.0, log)
                read_log = True
                decision = core_driver.decide(view, node, settings, op, limit, 0.0)
        except InvalidTransitionError as exc:
            raise _Found([f"the core chose an action it then rejected: {exc}"]) from None
        instruction, sanitized = decision.instruction, decision.state
        problems: list[str] = []
        intents = pending
        # Carry the instruction out. The view is as fresh as a view can be.
        if isinstance(instruction, Write):
            # A winning compare-and-set (a lost one changes nothing shared, and the
            # node decides again on what beat it: another step of the search).
            written, performed = instruction.state, instruction.action
            if written.round == state.round:
                intents = frozenset(log[max(0, written.intent_cursor) :])
            else:
                intents = frozenset()  # a new round's log: nobody announced in it yet
        elif isinstance(instruction, Announce):
            # The node appends itself to the intent log; nothing else is shared.
            written, performed = state, None
            intents = pending | {node}
            if instruction.round != state.round:
                problems.append(
                    f"{node} announced itself in the intent log of round {instruction.round} "
                    f"while the state is in round {state.round}: it reads round "
                    f"{state.round}'s log back, and its entry waits in a round not started"
                )
        elif isinstance(instruction, Beat):
            # A beat moves only the node's side counter, which no step reads (each
            # chooses its sightings afresh). It is a keep-alive, whatever the
            # operator would have done next (a member beats first when it is due).
            written, performed = state, Action.KEEP_ALIVE
        elif isinstance(instruction, Wait):
            written, performed = state, decision.action  # a wait changes nothing
        elif isinstance(instruction, Done):
            written, performed = state, instruction.action
            joined = instruction.joined
            if joined is not None:
                # agreement, through the state the join returns on (check_return)
                problems += check_return(
                    node, state, joined.round, joined.rank, joined.world_size, joined.members
                )
        elif isinstance(instruction, Read):
            what = (
                f"Read(counters={instruction.counters}, "
                f"intents={getattr(instruction, 'intents', False)})"
            )
            found = _Found(
                [
                    f"the driver re-read a fresh view ({what} on a state, counters"
                    + (" and intent log" if read_log else "")
                    + " read at this instant): an executor would read and ask again forever"
                ],
                decision,
            )
            found.read_log = read_log
            raise found
        else:
            raise _Found([f"the driver answered {instruction!r} to an operation"], decision)
        # Safety: a node that finds members silent publishes their removal at once;
        # the written state and both halves of the step (read -> the operator's view
        # -> written; nothing is written but by a Write); batched admissions.
        # A node never finds itself dead (it is alive: it beats now); its peers judge
        # it by their own sightings. So only the expired peers count.
        silent = timers.expired
        problems += check_removal_published(node, state, silent, decision.dead, written)
        problems += check_state(written, settings)
        problems += check_transition(state, sanitized)
        if isinstance(instruction, Write):
            problems += check_transition(sanitized, written)
            problems += check_admissions(node, state, sanitized, written, instruction.admitted, log)
        if problems:
            found = _Found(problems, decision)
            found.read_log = read_log
            raise found
        # The stepping node's own action is judged on its view before the action.
        guards = Guards.of(
            View(node, sanitized, settings, 0.0, view.observations, deadline, pending)
        )
        if len(self._core_steps) >= _CORE_STEP_CACHE:
            # ids of dropped steps may be reused: forget what was keyed on them
            self._core_steps.clear()
            self._wakeups.clear()
        step = self._core_steps[key] = CoreStep(
            decision, performed, written, guards, intents, read_log
        )
        return step

    def _step(
        self,
        g: Global,
        slot: int,
        op: Operator,
        timers: Timers,
        check_only: bool = False,
    ) -> tuple[Global, list[str]]:
        """One iteration of the driving loop: the real driver decides on the node's
        view, and the instruction is carried out atomically (``check_only``: the
        step is checked, and its successor not built when the checks were made
        before)."""
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        # A keep-alive has no deadline of its own; it never times out.
        deadline = self._before if loc.op is None else timers.deadline
        try:
            core_step = self._core_step(g.shared, node, op, timers, deadline, g.intents)
        except _Found as found:
            if self._narrate and found.decision is not None:
                found.lines = self._narration(
                    loc, timers, deadline, op, found.decision, g, found.read_log
                )
            raise
        decision, performed, written, guards = core_step[:4]
        instruction, sanitized, dead = decision.instruction, decision.state, decision.dead
        lines = []
        if self._narrate:
            lines = self._narration(loc, timers, deadline, op, decision, g, core_step.read_log)
        if dead:
            broken = self._broken_leases(g, dead)
            if broken:
                lease_found = _Found(broken, decision)
                lease_found.lines = lines
                raise lease_found
        # No missed wake-up: a write that publishes no phase must leave the decision
        # of every node waiting on the state as it was.
        if isinstance(instruction, Write) and instruction.phase is None:
            missed = self._missed_wakeups(g, slot, core_step)
            if missed:
                missed_found = _Found(missed, decision)
                missed_found.lines = lines
                raise missed_found
        # Conformance depends on the shared state and intent log, what the step
        # decided and did, its guards, and every node's phase and pid; many steps
        # share all of them (timer choices that differ in nothing the check reads),
        # so each combination is checked once.
        conformed = (
            g.shared,
            g.intents,
            decision,
            performed,
            guards,
            slot,
            loc.op,
            tuple((o.phase, o.incarnation) for o in g.locals),
        )
        if check_only and conformed in self._conformed:
            return g, lines

        # The time that passed stays passed: the chosen deadline value is kept.
        new_deadline = loc.deadline if loc.op is None else deadline
        phase, new_op = loc.phase, loc.op
        if isinstance(instruction, Done):
            action = instruction.action
            if action is Action.FINISH:
                if loc.op == "join" and instruction.joined is not None:
                    # Done.rejoin (the round lost its rank 0) finishes here too: the
                    # handler then exits the round and joins the next one, which a
                    # trained node's exit and join events explore.
                    phase, new_op, new_deadline = "training", None, None
                elif loc.op == "exit":
                    phase, new_op, new_deadline = "exited", None, None
                elif loc.op == "close":
                    phase, new_op, new_deadline = "closed", None, None
            elif action in (Action.ERROR_CLOSED, Action.ERROR_GRACEFUL_EXIT):
                phase, new_op, new_deadline = "closed", None, None
            elif action is Action.ERROR_TIMEOUT:
                phase, new_op, new_deadline = "failed", None, None
        elif isinstance(instruction, Write):
            if instruction.action is Action.REMOVE_FROM_PARTICIPANTS and loc.op == "exit":
                phase = "exited"
            if instruction.deadline is not None:
                # a fresh deadline, as far from now as the one an operation starts with
                new_deadline = self._before
        # Observations are not kept: every step chooses its sightings afresh.
        new_loc = Local(loc.incarnation, phase, new_op, new_deadline)
        after = _with(g, slot, new_loc, shared=written, intents=core_step.intents)
        if conformed not in self._conformed:
            admitted = instruction.admitted if isinstance(instruction, Write) else ()
            try:
                self._conform(g, slot, sanitized, dead, after, performed, op, guards, admitted)
            except _Found as found:
                found.decision = decision
                found.lines = lines
                raise
            if len(self._conformed) >= _CORE_STEP_CACHE:
                self._conformed.clear()
            self._conformed.add(conformed)
        return after, lines

    def _broken_leases(self, g: Global, dead: frozenset[NodeDesc]) -> list[str]:
        """Self-fencing (docs/design.md, decision 7): a node declared dead whose
        workers run must already have been told to stop them.

        A peer declares a node dead once its counter pair has not moved for over a
        liveness window on the peer's clock, counted from when the peer first saw
        it, which is no earlier than the renewal that set it was sent. So at that
        moment the node's own lease (its sighting of itself, timed from that send)
        is at least a window old, and the core's ``must_fence`` must say so."""
        window = self.settings.liveness_window
        problems = []
        for i, loc in enumerate(g.locals):
            gone = node_of(i, loc.incarnation)
            if gone not in dead or loc.phase != "training":
                continue
            lapsed = make_observations({gone: HeartbeatSighting(0, -window)}, None)
            view = NodeView(observations=lapsed)
            if not core_driver.must_fence(view, gone, self.settings, 0.0):
                problems.append(
                    f"lease: {gone} was declared dead while it trained, and its own lease "
                    f"(last renewed a liveness window of {window:g} s ago) had not run out: "
                    "must_fence said its workers could go on"
                )
        return problems

    def _missed_wakeups(self, g: Global, slot: int, core_step: CoreStep) -> list[str]:
        """Waiters the step ``core_step`` of ``slot`` leaves asleep although their
        decision changed (the step's write publishes no new phase).

        A waiter is another node running a join whose decision on the state before
        the step is a Wait (with the timers it may have then: nobody silent, which
        would make it publish a removal instead). Its decision on the state after
        the step with the same timers (a new member is seen fresh, a new last call
        just armed) must be the same Wait, waking at the same time: its Wait ends
        only on a phase above the one it read, or at that time.

        Not a waiter in this sense: a node the step removed from the state (a peer
        declared it dead). It learns that by its own keep-alive timer, which every
        member's Wait includes: waking every waiter on every removal is what phases
        are there to avoid.

        A function of the step (the shared states before and after) and of the
        waiter's node and deadline: memoized.
        """
        before, after = g.shared, core_step.written
        problems: list[str] = []
        for i, other in enumerate(g.locals):
            if i == slot or other.op != "join":
                continue
            waiter = node_of(i, other.incarnation)
            key = (id(core_step), waiter, other.deadline)
            known = self._wakeups.get(key)
            if known is None:
                known = self._wakeups[key] = self._missed_wakeup(before, after, waiter, other)
            problems += known
        return problems

    def _missed_wakeup(
        self, before: RendezvousState, after: RendezvousState, waiter: NodeDesc, loc: Local
    ) -> list[str]:
        if waiter in before.members() and waiter not in after.members():
            return []
        own = ("fresh", "due") if waiter in before.heartbeats else ("fresh",)
        over = (False, True) if before.last_call is not None else (False,)
        start = self._deadlines.index(loc.deadline) if loc.deadline in self._deadlines else 0
        for mine, lc, dl in itertools.product(own, over, self._deadlines[start:]):
            timers = Timers(frozenset(), mine, lc, dl)
            asleep = self._decide(before, waiter, timers, dl)
            if not isinstance(asleep.instruction, Wait):
                continue
            if after.last_call != before.last_call or after.round != before.round:
                timers = timers._replace(last_call_over=False)  # a new last call, just seen
            awake = self._decide(after, waiter, timers, dl)
            if _outcome(awake) != _outcome(asleep):
                return [
                    f"missed wake-up: {waiter} waits ({_describe_decision(asleep)}) on the "
                    f"state before this step and would {_describe_decision(awake)} on the "
                    "state after it, but the step's write publishes no new phase"
                ]
        return []

    def _decide(
        self, state: RendezvousState, node: NodeDesc, timers: Timers, deadline: float | None
    ) -> Decision:
        """The decision of a join of ``node`` on ``state`` (not carried out)."""
        view = self._view(state, node, timers)
        limit = float(deadline) if deadline is not None else float("inf")
        try:
            return core_driver.decide(view, node, self.settings, JoinOp(), limit, 0.0)
        except InvalidTransitionError as exc:
            raise _Found([f"the core chose an action it then rejected: {exc}"]) from None

    def _narration(
        self,
        loc: Local,
        timers: Timers,
        deadline: float | None,
        op: Operator,
        decision: Decision,
        g: Global | None = None,
        read_log: bool = False,
    ) -> list[str]:
        """What a step did, for traces."""
        lines = []
        expired, mine, lc = timers.expired, timers.own, timers.last_call_over
        if loc.op is not None and deadline != loc.deadline:
            lines.append("deadline passed" if deadline == self._timed_out else "rollback over")
        if mine != "fresh":
            lines.append(f"own heartbeat {mine}")
        if lc:
            lines.append("last call over")
        if expired:
            lines.append(f"sees {sorted(map(str, expired))} silent too long")
        if timers.contended:
            lines.append("lost a compare-and-set since its last wait (contended)")
        if decision.dead:
            lines.append(f"declares dead {sorted(map(str, decision.dead))}")
        if read_log and g is not None:
            lines.append(f"reads the intent log {sorted(map(str, g.intents))}")
        action = "nothing" if decision.action is None else decision.action.name
        instruction = decision.instruction
        if isinstance(instruction, Write) and instruction.action is None:
            what = "publishes the removal first"
        elif isinstance(instruction, Write) and instruction.admitted:
            what = f"write, admitting {[str(n) for n in instruction.admitted]}"
        elif isinstance(instruction, Announce):
            what = f"announces itself in the intent log of round {instruction.round}"
        elif isinstance(instruction, Done) and instruction.rejoin:
            what = "done, but the round lost its rank 0: rejoin"
        else:
            what = type(instruction).__name__.lower()
        if isinstance(instruction, Write) and instruction.phase is not None:
            what += ", new phase"
        lines.append(f"{type(op).__name__} -> {action} ({what})")
        return lines

    def _conform(
        self,
        g: Global,
        slot: int,
        sanitized: RendezvousState,
        dead: frozenset[NodeDesc],
        after: Global,
        action: Action | None,
        op: Operator,
        guards: Guards,
        admitted: tuple[NodeDesc, ...] = (),
    ) -> None:
        """Every node's lifecycle change in this step must be an edge of the model.

        ``action`` is what the node carried out (None: it only published removals);
        ``admitted``: the nodes its write admitted in a batch, after its own action
        and in this order (each is judged on the state just before its admission).
        """
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        state = g.shared
        nodes = [node_of(i, other.incarnation) for i, other in enumerate(g.locals)]
        # Peers change lifecycle state only when removed (sanitize), admitted in a
        # batch, or when the round completes or advances; other nodes need no check.
        if dead:
            members, kept = state.members(), sanitized.members()
            for i in range(len(g.locals)):
                if nodes[i] in members and nodes[i] not in kept:
                    src = self._model_state(g, i)
                    dst = self._model_state(g, i, sanitized)
                    if src != dst:
                        self._expect(src, "declared_dead", dst, _NO_GUARDS, nodes[i])
        middle = self._model_state(g, slot, sanitized)
        final = self._model_state(after, slot)
        # A batch: the states after the node's own action and after each admission.
        stages = self._admission_stages(node, sanitized, action, admitted, after.shared)
        own = final if not admitted else lifecycle_state(loc.phase, node, stages[0])
        trigger = _trigger(action, op)
        if (action is not None and action.changes_state) or (trigger is not None and middle != own):
            if trigger is None:
                raise _Found([f"conformance: {node} changed {middle} -> {own}"])
            self._expect(middle, trigger, own, guards, node)
        elif middle != own:
            done = "only publishing removals" if action is None else action.name
            raise _Found([f"conformance: {node} went {middle} -> {own} on {done}"])
        moved = {slot}
        for k, other in enumerate(admitted):
            index = next((j for j, n in enumerate(nodes) if n == other), None)
            if index is None:
                continue  # an earlier incarnation's entry: nobody runs that node
            src = self._model_state(g, index, sanitized)
            dst = lifecycle_state(g.locals[index].phase, other, stages[k + 1])
            if src != dst:
                view = View(other, stages[k], self.settings, 0.0, _NO_OBSERVATIONS, None, g.intents)
                self._expect(src, "admitted", dst, Guards.of(view), other)
            moved.add(index)
            final_i = self._model_state(after, index)
            if final_i != dst:
                self._expect(dst, "round_completed", final_i, _NO_GUARDS, other)
        if own != final:
            self._expect(own, "round_completed", final, _NO_GUARDS, node)
        written = after.shared
        if written.complete != sanitized.complete or written.round != sanitized.round:
            for i in range(len(g.locals)):
                if i in moved:
                    continue
                src = self._model_state(g, i, sanitized)
                dst = self._model_state(after, i)
                if src != dst:
                    self._expect(src, "round_completed", dst, _NO_GUARDS, nodes[i])

    def _admission_stages(
        self,
        node: NodeDesc,
        sanitized: RendezvousState,
        action: Action | None,
        admitted: tuple[NodeDesc, ...],
        written: RendezvousState,
    ) -> list[RendezvousState]:
        """For a batch write: the state after the writer's own action, then after
        each admission in turn (each node's action read off where the write put it).
        Empty when the write admits nobody else."""
        try:
            return core_driver.admission_stages(
                node, self.settings, sanitized, action, admitted, written
            )
        except InvalidTransitionError as exc:
            raise _Found(
                [f"conformance: {node}'s batch is not a sequence of admissions: {exc}"]
            ) from None

    # -- the search --------------------------------------------------------------

    def run(
        self,
        progress: Callable[[CheckResult], None] | None = None,
        on_state: Callable[[Global, int], None] | None = None,
        workers: int = 1,
    ) -> CheckResult:
        """Explore every reachable state (or up to ``max_states``), breadth first,
        a level at a time.

        ``progress`` is called with the running totals about every
        ``_PROGRESS_INTERVAL`` seconds, and ``on_state`` with every newly stored
        state and its fingerprint.

        Each level is stepped in chunks (:meth:`_step_chunk`) and their successors
        merged in order; this process keeps the visited fingerprints and the parent
        pointers, and replays a violation into its trace. With ``workers`` > 1 the
        chunks are stepped by that many forked processes: a worker is a fork of
        this checker (so a bug planted in the core before the search is planted in
        every worker) and hands back the successors it did not hand back before.
        Chunks merge in order either way, so the states, transitions and depth do
        not depend on ``workers``.
        """
        with _few_collections():
            return self._run(progress, on_state, workers)

    def _run(
        self,
        progress: Callable[[CheckResult], None] | None,
        on_state: Callable[[Global, int], None] | None,
        workers: int,
    ) -> CheckResult:
        global _WORKER
        start = time.perf_counter()
        result = CheckResult(self.config)
        init, _, init_fp = self.canonical(self.initial())
        problems = check_state(init.shared, self.settings)
        if problems:
            result.violation = Violation(problems, ["initial state"])
            return result
        parents: dict[int, tuple[int, Event | None]] = {init_fp: (init_fp, None)}
        if on_state is not None:
            on_state(init, init_fp)
        limit = self.config.max_states
        level: list[tuple[Global, int]] = [(init, init_fp)]
        depth, reported = 0, start
        self.checked_transitions = 0
        pool = None
        if workers > 1:
            _WORKER = self
            pool = multiprocessing.get_context("fork").Pool(workers)
        try:
            while level:
                result.depth = depth
                if self.config.max_round is not None:
                    level = [(g, fp) for g, fp in level if g.shared.round <= self.config.max_round]
                size = max(1, min(_CHUNK, len(level) // (workers * 4)))
                chunks = [level[i : i + size] for i in range(0, len(level), size)]
                # In process, each chunk is stepped after the previous one merged:
                # it skips the successors already known.
                outcomes = (
                    pool.imap(_step_chunk_in_worker, chunks)
                    if pool is not None
                    else (self._step_chunk(chunk, parents) for chunk in chunks)
                )
                following: list[tuple[Global, int]] = []
                for successors, stepped, edges, violation in outcomes:
                    result.transitions += stepped
                    self.edges |= edges
                    if violation is not None:
                        parent, event, found = violation
                        self.last_problems = found
                        trace = self.replay([*self._path(parents, parent), event])
                        result.violation = Violation(self.last_problems, trace)
                        break
                    for parent, event, stored, cfp in successors:
                        if cfp in parents:
                            continue
                        parents[cfp] = (parent, event)
                        following.append((stored, cfp))
                        if on_state is not None:
                            on_state(stored, cfp)
                        if limit is not None and len(parents) >= limit:
                            result.complete = False
                            break
                    if not result.complete:
                        break
                    now = time.perf_counter()
                    if progress is not None and now - reported >= _PROGRESS_INTERVAL:
                        reported = now
                        result.states, result.seconds = len(parents), now - start
                        progress(result)
                if result.violation is not None or not result.complete:
                    break
                level = following
                depth += 1 if level else 0
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            _WORKER = None
        result.depth = depth
        result.states = len(parents)
        result.seconds = time.perf_counter() - start
        result.lifecycle_edges = set(self.edges)
        return result

    def _successors(self, g: Global) -> Iterator[tuple[Event, Global]]:
        """The successors of ``g`` to store, each with its event, after checking
        every transition of ``g`` (see :meth:`choices`).

        Raises:
            _Found: a transition violates a property (``event`` names it).
        """
        for abstract in self.events(g):
            stored, checked = self.choices(g, abstract)
            self.checked_transitions += len(checked)
            for event in checked:
                try:
                    self.successor(g, event, check_only=True)
                except _Found as found:
                    found.event = event
                    raise
            for event in stored:
                try:
                    succ, _ = self.successor(g, event)
                except _Found as found:
                    found.event = event
                    raise
                yield event, succ

    def _step_chunk(
        self,
        chunk: list[tuple[Global, int]],
        known: Container[int],
        handed_out: set[int] | None = None,
    ) -> _ChunkOutcome:
        """Step the states of ``chunk``: their successors whose fingerprints are
        not in ``known`` (each added to ``handed_out``, if given), the transitions
        stepped, the lifecycle edges first exercised since the last chunk, and the
        first violation as (parent fingerprint, event, problems)."""
        successors: list[_Successor] = []
        checked_before = self.checked_transitions
        stepped = 0
        violation = None
        for g, fp in chunk:
            seen: set[Global] = set()  # many timer choices lead to one state
            try:
                for event, succ in self._successors(g):
                    stepped += 1
                    succ = self._normalize(succ)
                    if succ in seen:
                        continue
                    seen.add(succ)
                    perm, cfp = self.fingerprint(succ)
                    if cfp in known:
                        continue
                    if handed_out is not None:
                        handed_out.add(cfp)
                    successors.append((fp, event, relabel(succ, perm), cfp))
            except _Found as problem:
                assert problem.event is not None
                violation = (fp, problem.event, problem.problems)
                break
        edges = self.edges - self._edges_reported
        self._edges_reported |= edges
        stepped += self.checked_transitions - checked_before
        return successors, stepped, edges, violation

    @staticmethod
    def _path(parents: dict[int, tuple[int, Event | None]], fp: int) -> list[Event]:
        events: list[Event] = []
        while True:
            parent, event = parents[fp]
            if event is None:
                break
            events.append(event)
            fp = parent
        events.reverse()
        return events

    def replay(self, events: list[Event]) -> list[str]:
        """A readable trace of ``events`` from the initial state.

        Node names stay stable along the trace although the search relabels nodes:
        ``names`` follows each canonical slot back to the slot it started as.
        """
        self._narrate = True
        try:
            return self._replay(events)
        finally:
            self._narrate = False

    def _replay(self, events: list[Event]) -> list[str]:
        g, perm, _ = self.canonical(self.initial())
        names = [""] * len(g.locals)
        for old, new in enumerate(perm):
            names[new] = f"n{old}"
        lines = [f"  0. initial: {describe(g, names)}"]
        for k, event in enumerate(events, 1):
            who = _display(g, event.slot, names)
            try:
                succ, what = self.successor(g, event)
            except _Found as found:
                renamed = [_rename(p, names) for p in found.problems]
                self.last_problems = renamed
                text = "; ".join(renamed)
                did = "".join(f"{_rename(line, names)}; " for line in found.lines)
                lines.append(f"{k:3}. {who} {event.kind}: {did}VIOLATES {text}")
                break
            succ = self._normalize(succ, shift_rounds=False)
            text = _rename("; ".join(what), names)
            lines.append(f"{k:3}. {who} {event.kind}: {text}")
            g, perm, _ = self.canonical(succ)
            moved = [""] * len(names)
            for old, new in enumerate(perm):
                moved[new] = names[old]
            names = moved
            lines.append(f"     -> {describe(g, names)}")
        return lines


#: One successor a chunk hands back: (parent fingerprint, event, state, fingerprint).
_Successor = tuple[int, Event, Global, int]
#: What stepping a chunk gives (see Checker._step_chunk).
_ChunkOutcome = tuple[
    list[_Successor], int, set[tuple[str, str, str]], tuple[int, Event, list[str]] | None
]
#: States a worker steps in one go, at most.
_CHUNK = 256
#: The checker a forked worker process steps states with (see Checker.run).
_WORKER: Checker | None = None


#: Collector thresholds during a search (generation 0, 1, 2); see _few_collections.
_SEARCH_GC_THRESHOLDS = (100_000, 20, 100)


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """Run the search with the cycle collector triggered rarely.

    A search allocates millions of small objects that live to its end (memo tables,
    fingerprints, parents) and makes almost no reference cycles, so the collector's
    default thresholds (a pass every 700 allocations) spend about a third of the
    search traversing them and find next to nothing: a bounded 3-node search
    (40,000 states) took 28.9 s with them, 21.2 s with these, 19.3 s with none.
    Forked workers inherit them.
    """
    saved = gc.get_threshold()
    gc.set_threshold(*_SEARCH_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def _step_chunk_in_worker(chunk: list[tuple[Global, int]]) -> _ChunkOutcome:
    """A forked worker's part of a level (see :meth:`Checker.run`): it remembers
    what it handed back, the main process knows the rest."""
    checker = _WORKER
    assert checker is not None, "a worker runs only in a fork of Checker.run"
    return checker._step_chunk(chunk, checker._handed_out, checker._handed_out)


def _deadline_code(deadline: float | None) -> int:
    """A deadline (relative to now) as a small non-negative number for state keys.

    Not the float itself: CPython hashes -1 and -2 alike (``hash(-1) == -2``), so
    keys that differ only in a deadline 1 s past (timed out) and 2 s past (past the
    rollback period) would get the same fingerprint, and the search would take one
    state for the other.
    """
    return 0 if deadline is None else 1000 + round(deadline * 100)


def _outcome(decision: Decision) -> tuple[object, ...]:
    """What a decision does, as far as a waiter is concerned: the instruction, the
    action, and for a Wait the time it wakes at."""
    instruction = decision.instruction
    until = instruction.until if isinstance(instruction, Wait) else None
    return (type(instruction).__name__, decision.action, until)


def _describe_decision(decision: Decision) -> str:
    instruction = decision.instruction
    action = "nothing" if decision.action is None else decision.action.name
    if isinstance(instruction, Wait):
        until = "a new phase" if instruction.until is None else f"+{instruction.until:g} s"
        return f"{action}: wait until {until}"
    return f"{action}: {type(instruction).__name__.lower()}"


def _true_guards(guards: Guards) -> str:
    held = [name for name, value in vars(guards).items() if value]
    return ", ".join(held) or "none"


def _trigger(action: Action | None, op: Operator) -> str | None:
    if action is None:
        return None
    if action.changes_state:
        return action.value
    if action is Action.FINISH:
        return "closed" if isinstance(op, CloseOp) else "finish"
    if action in (Action.ERROR_CLOSED, Action.ERROR_GRACEFUL_EXIT):
        return "closed"
    if action is Action.ERROR_TIMEOUT:
        return "timeout"
    return None


def _with(
    g: Global,
    slot: int,
    loc: Local,
    shared: RendezvousState | None = None,
    crashes: int | None = None,
    intents: frozenset[NodeDesc] | None = None,
) -> Global:
    locals_ = list(g.locals)
    locals_[slot] = loc
    return Global(
        g.shared if shared is None else shared,
        tuple(locals_),
        g.crashes if crashes is None else crashes,
        g.intents if intents is None else intents,
    )


def relabel(g: Global, perm: tuple[int, ...]) -> Global:
    """``g`` with slot ``i`` moved to ``perm[i]`` and every node renamed with it."""
    if perm == tuple(range(len(perm))):
        return g

    def lab(n: NodeDesc) -> NodeDesc:
        return NodeDesc(f"n{perm[int(n.addr[1:])]}", n.pid, n.local_id)

    s = g.shared
    shared = s.evolve(
        participants={lab(n): r for n, r in s.participants.items()},
        wait_list={lab(n) for n in s.wait_list},
        redundancy_list={lab(n) for n in s.redundancy_list},
        heartbeats={lab(n): c for n, c in s.heartbeats.items()},
        last_ranks={lab(n): r for n, r in s.last_ranks.items()},
    )
    locals_: list[Local] = [g.locals[0]] * len(g.locals)
    for i, loc in enumerate(g.locals):
        locals_[perm[i]] = loc
    return Global(shared, tuple(locals_), g.crashes, frozenset(map(lab, g.intents)))


def _display(g: Global, slot: int, names: list[str]) -> str:
    inc = g.locals[slot].incarnation
    return names[slot] + (f"'{inc}" if inc else "")


def _rename(text: str, names: list[str]) -> str:
    """``text`` with node ids (``n1_101_0``) replaced by their trace names."""
    return _NODE_RE.sub(lambda m: _name(node_of(int(m[1]), int(m[2]) - 100), names), text)


def _name(n: NodeDesc, names: list[str]) -> str:
    base = names[int(n.addr[1:])]
    return base + (f"'{n.pid - 100}" if n.pid != 100 else "")


def describe(g: Global, names: list[str] | None = None) -> str:
    """One line per state for traces: the shared state, then every node.

    ``I{...}`` are the joiners in the round's intent log past the cursor. A node
    shows its phase, its operation (``/join``), and ``timed-out`` or
    ``past-rollback`` for its deadline. What a node's timers showed at a step is
    in that step's line of the trace.
    """
    names = names or [f"n{i}" for i in range(len(g.locals))]
    s = g.shared
    parts = [
        f"round={s.round}",
        "complete" if s.complete else "open",
        *(["closed"] if s.closed else []),
        f"world={s.world_size}" if s.complete else "",
        "P{" + ", ".join(f"{_name(n, names)}:{r}" for n, r in sorted(s.participants.items())) + "}",
    ]
    if s.wait_list:
        parts.append("W{" + ", ".join(sorted(_name(n, names) for n in s.wait_list)) + "}")
    if s.redundancy_list:
        parts.append("R{" + ", ".join(sorted(_name(n, names) for n in s.redundancy_list)) + "}")
    if s.last_call is not None:
        parts.append("last-call armed")
    if g.intents:
        parts.append("I{" + ", ".join(sorted(_name(n, names) for n in g.intents)) + "}")
    nodes = []
    for i, loc in enumerate(g.locals):
        text = f"{_display(g, i, names)}={loc.phase}" + (f"/{loc.op}" if loc.op else "")
        if loc.deadline is not None and loc.deadline < 0:
            text += " timed-out" if loc.deadline == -1.0 else " past-rollback"
        nodes.append(text)
    return " ".join(p for p in parts if p) + " | " + "; ".join(sorted(nodes))


def check(
    config: CheckConfig,
    progress: Callable[[CheckResult], None] | None = None,
    workers: int = 1,
) -> CheckResult:
    """Run the model checker on ``config`` (in ``workers`` processes)."""
    return Checker(config).run(progress, workers=workers)
