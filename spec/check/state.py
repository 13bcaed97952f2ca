"""The model checker's vocabulary: what it checks, its states and events, its result.

A state of the search (:class:`Global`) is the shared state, every node slot's
local state (:class:`Local`) and the round's intent log past its cursor. An event
(:class:`Event`) names what happens to which slot; a step carries the few timer
values (:class:`Timers`) that the core's thresholds tell apart. See
:mod:`rallypoint.spec.check` for how the search uses them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from ...core import (
    Decision,
    NodeDesc,
    RendezvousState,
    Settings,
)
from ..model.lifecycle import Name, Phase
from ..model.machine import built
from ..options import Rule, check_ranges, check_settings

__all__ = [
    "Age",
    "CheckConfig",
    "CheckResult",
    "CheckerConfigError",
    "CheckerWorkerError",
    "Deadline",
    "Event",
    "EventKind",
    "Found",
    "Global",
    "Local",
    "Op",
    "Timers",
    "Violation",
    "node_of",
    "slot_of",
    "with_local",
]


class CheckerConfigError(ValueError):
    """The checker configuration is out of range (the message names the field)."""


class CheckerWorkerError(RuntimeError):
    """A worker process of the search died (killed, e.g. by the out-of-memory
    killer): its part of a level is lost, so the search cannot go on."""


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
        leaves: whether a training node may leave for good (``LeaveOp``, an
            agent stopping) besides exiting to rejoin; off by default: the
            default search knows nodes gone only by their death, and a node
            that exits and never joins again is one the next round waits for.
        stable_ranks: the settings' stable-ranks option (ranks kept across rounds).
        symmetry: store states modulo node permutations.
        subsumption: step no state that another state reached by then
            simulates: the same but for the deadlines of some running
            operations, which are earlier there (docs/spec.md, "Subsumed
            states"). Such states are counted as subsumed, not as states.
        max_states: stop after this many distinct states (None: explore all).
        max_memory: stop once the search's processes hold more than this many
            GiB of memory (their resident sets, summed; None: no limit). A space
            too large for the machine then ends as a search stopped early, with
            its figures, instead of in the out-of-memory killer.
        max_failures: times in one run that a training node's workers fail (it
            then charges the restart budget for its round, and may exit and join
            again). 0: never, and the search is the one without a budget.
        max_exclusions: times in one run that a node excludes itself (a failed
            health check) while it runs no operation. 0: never.
        restart_budget, exclusion_rounds: the settings' job-wide restart budget
            (None: none) and how many rounds an excluded node sits out.
    """

    nodes: int = 3
    min_nodes: int = 2
    max_nodes: int = 3
    max_round: int | None = None
    max_crashes: int = 1
    allow_close: bool = True
    leaves: bool = False
    stable_ranks: bool = False
    symmetry: bool = True
    subsumption: bool = True
    max_states: int | None = None
    max_memory: float | None = None
    max_failures: int = 0
    max_exclusions: int = 0
    restart_budget: int | None = None
    exclusion_rounds: int = 1

    def __post_init__(self) -> None:
        rules = (
            Rule(("nodes", "max_states"), 1),
            Rule(("max_round", "max_crashes", "max_failures", "max_exclusions"), 0),
            Rule(("max_memory",), 0, strict=True, finite=True),
        )
        check_ranges(self, CheckerConfigError, rules)
        check_settings(self, CheckerConfigError)

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
            restart_budget=self.restart_budget,
            exclusion_rounds=self.exclusion_rounds,
        )


class Op(Name):
    """The operation a node runs."""

    JOIN = "join"
    EXIT = "exit"
    CLOSE = "close"
    #: count a failure of the workers in the restart budget, for the round the
    #: node trained in: the current round (``ChargeRestartOp(round)``)
    CHARGE = "charge"
    #: the same, once that round has ended under it (a later write advanced the
    #: round): the operator finishes without charging
    CHARGE_LATE = "charge-late"
    #: exclude itself (``ExcludeOp``)
    EXCLUDE = "exclude"
    #: leave the rendezvous for good (``LeaveOp``: an agent stopping)
    LEAVE = "leave"


class EventKind(Name):
    """What happens to a node slot in one event of the search."""

    #: the node crashes (and restarts at once as a new process, idle)
    CRASH = "crash"
    #: one iteration of the driving loop of the node's running operation
    STEP = "step"
    #: one iteration of a trained node's keep-alive
    HEARTBEAT = "heartbeat"
    #: the node starts an operation and takes its first step
    JOIN = "join"
    EXIT = "exit"
    #: a training node leaves for good (its agent stops): the next round does
    #: not wait for it
    LEAVE = "leave"
    CLOSE = "close"
    #: a training node's workers fail: it starts charging the restart budget
    #: (``max_failures``); its exit and join events then do what the agent does next
    FAIL = "fail"
    #: a node that runs no operation fails its health check and excludes itself
    #: (``max_exclusions``); its join event then rejoins, as a spare while excluded
    EXCLUDE = "exclude"


#: The operation an event starts.
STARTS: dict[EventKind, Op] = {
    EventKind.JOIN: Op.JOIN,
    EventKind.EXIT: Op.EXIT,
    EventKind.LEAVE: Op.LEAVE,
    EventKind.CLOSE: Op.CLOSE,
    EventKind.FAIL: Op.CHARGE,
    EventKind.EXCLUDE: Op.EXCLUDE,
}
#: Events that run one iteration of the node's driving loop (see Steps.expand).
STEPPING_EVENTS = frozenset({EventKind.STEP, EventKind.HEARTBEAT, *STARTS})


class Age(Name):
    """How old a node's sighting of its own heartbeat is."""

    FRESH = "fresh"
    #: a keep-alive interval old: a beat is due
    DUE = "due"
    #: older than the liveness window
    EXPIRED = "expired"


class Deadline(IntEnum):
    """Where the running operation's deadline stands relative to the node's now,
    as the values the core's thresholds tell apart, in the order time moves them.

    A value ranks the time left (0 stands for no deadline in a state's key); the
    time relative to now it stands for is :meth:`relative`.
    """

    #: ahead of now
    BEFORE = 3
    #: passed, within the rollback period
    TIMED_OUT = 2
    #: past the rollback period too
    PAST = 1

    def relative(self, settings: Settings) -> float:
        """The deadline relative to now, in seconds of the node's clock."""
        if self is Deadline.BEFORE:
            return 1.0
        if self is Deadline.TIMED_OUT:
            return -settings.rollback_period
        return -(settings.rollback_period + 1.0)

    @staticmethod
    def in_time_order(settings: Settings) -> tuple[Deadline, ...]:
        """The values a deadline takes in ``settings``, in the order time moves
        them (without a rollback period, none is timed out but not past)."""
        if settings.rollback_period > 0:
            return tuple(Deadline)
        return (Deadline.BEFORE, Deadline.PAST)


class Local(NamedTuple):
    """One node slot's local state (its clock's ``now`` is always 0).

    Sightings are not kept: every step chooses their ages afresh (see
    :meth:`Steps.expand`). Nor is what a join returned: each return is checked
    against the state it returned on, which implies agreement (see
    :func:`rallypoint.spec.model.invariants.check_return`).
    """

    incarnation: int
    #: one of the model's local phases (see lifecycle_state)
    phase: Phase
    #: the running operation
    op: Op | None
    #: the operation's deadline relative to now
    deadline: Deadline | None
    #: (a training node, when workers may fail) a write advanced the round since
    #: the node's join returned: its workers' failure is of an ended round, and
    #: free (see Steps.events)
    round_ended: bool = False


class Global(NamedTuple):
    """A state of the search: the shared state, every slot's local state, and the
    entries of the current round's intent log past the state's cursor."""

    shared: RendezvousState
    locals: tuple[Local, ...]
    crashes: int
    #: joiners that announced themselves in the current round and were not yet
    #: admitted (the log past ``intent_cursor``; see :meth:`Symmetry.normalize`)
    intents: frozenset[NodeDesc] = frozenset()
    #: workers' failures and self-exclusions so far (bounded by the config)
    failures: int = 0
    exclusions: int = 0


class Timers(NamedTuple):
    """How much time a node's clock let pass since it last looked, as the few
    values the core's thresholds tell apart (see :meth:`Steps.expand`)."""

    #: peers whose heartbeat the node saw stand still longer than the liveness window
    expired: frozenset[NodeDesc]
    #: the node's own sighting
    own: Age
    #: whether an armed last call is over
    last_call_over: bool
    #: the running operation's deadline (None for a keep-alive)
    deadline: Deadline | None
    #: a compare-and-set of the node lost since its last wait (join steps whose
    #: decision is an admission only; see :meth:`Steps.expand`)
    contended: bool = False


@dataclass(frozen=True)
class Event:
    """One event of a search: what happens to which node slot.

    A step (and ``join``/``exit``/``close``, which start an operation and take its
    first step at once) carries the ``timers`` the node sees; see
    :meth:`Steps.expand`.
    """

    kind: EventKind
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
    #: the limit that stopped an incomplete search: "max_states" or "max_memory"
    stopped_by: str | None = None
    #: the memory the search's processes held when last weighed against
    #: ``max_memory`` (GiB; 0 without a limit)
    memory: float = 0.0
    violation: Violation | None = None
    lifecycle_edges: set[tuple[str, str, str]] = field(default_factory=set)
    #: states reached and not stepped: another state reached by then simulates
    #: each (see CheckConfig.subsumption); not counted in ``states``
    subsumed: int = 0

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
            else f"stopped at the memory limit: {self.memory:.2f} GiB held, "
            f"more than max_memory={c.max_memory:g} GiB"
            if self.stopped_by == "max_memory"
            else f"stopped at {c.max_states} states"
        )
        lines = [
            f"config: nodes={c.nodes} min={c.min_nodes} max={c.max_nodes} "
            f"max_round={'all' if c.max_round is None else c.max_round} "
            f"max_crashes={c.max_crashes} close={c.allow_close} "
            + ("leaves=True " if c.leaves else "")
            + f"stable_ranks={c.stable_ranks} symmetry={c.symmetry} subsumption={c.subsumption}"
            + (
                f" max_failures={c.max_failures} max_exclusions={c.max_exclusions} "
                f"restart_budget={c.restart_budget} exclusion_rounds={c.exclusion_rounds}"
                if c.max_failures or c.max_exclusions
                else ""
            ),
            f"states explored: {self.states} ({scope})",
            *([f"states subsumed: {self.subsumed}"] if c.subsumption else []),
            f"transitions: {self.transitions}",
            f"depth: {self.depth}",
            f"seconds: {self.seconds:.2f}",
            f"lifecycle edges exercised: {len(self.lifecycle_edges)}",
        ]
        lines.append("result: no violation" if self.ok else "result: VIOLATION")
        if self.violation is not None:
            lines.append(self.violation.format())
        return "\n".join(lines)


class Found(Exception):
    """A step broke a property (raised within the search, reported as a
    :class:`Violation`)."""

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


@functools.cache
def node_of(slot: int, incarnation: int) -> NodeDesc:
    """The node of a slot's incarnation (a restart is a new process: a new pid)."""
    return NodeDesc(f"n{slot}", 100 + incarnation, 0)


def slot_of(node: NodeDesc) -> int:
    """The slot whose incarnation ``node`` is (see :func:`node_of`)."""
    return int(node.addr[1:])


def with_local(
    g: Global,
    slot: int,
    loc: Local,
    shared: RendezvousState | None = None,
    crashes: int | None = None,
    intents: frozenset[NodeDesc] | None = None,
) -> Global:
    """``g`` with slot ``slot``'s local state replaced (and what else is given)."""
    locals_ = list(g.locals)
    locals_[slot] = loc
    return built(
        Global,
        (
            g.shared if shared is None else shared,
            tuple(locals_),
            g.crashes if crashes is None else crashes,
            g.intents if intents is None else intents,
            g.failures,
            g.exclusions,
        ),
    )
