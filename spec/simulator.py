"""A deterministic discrete-event simulator of many rendezvous nodes.

TigerBeetle's VOPR is the model: the clock, the network and the backend are stubs,
every fault is an option with a probability, a seed replays a run exactly, and the
simulator runs the production code path. No threads, no sockets, no real time: one
event heap (``heapq``) ordered by simulated time and a sequence number, and one
``random.Random(seed)`` for every choice.

What is simulated:

* **Nodes** run the core's driver (:mod:`rallypoint.core.driver`) exactly as the
  production executor (:class:`rallypoint.adapters.sync.StateSync`, driven by the
  handler and the agent) does; the simulator decides nothing itself. It asks
  ``driver.decide`` (or ``driver.monitor``) for the next instruction, carries it
  out against the simulated backend, and feeds the result back with the
  ``after_*`` functions (looked up on the module at every call, so that a test can
  plant a bug in them)::

      Read(counters, intents, state)
                     -> a read request: the state (unless ``state`` is False: the
                        view's state and token are kept), the side counters, the
                        intent log of the state's round -> after_read
      Write(state)   -> a compare-and-set request on the state's version; a won
                        write with ``phase`` publishes it -> after_write; a lost one
                        decides again after a jittered exponential backoff; a won
                        one with ``deadline`` moves the operation's deadline
      Beat()         -> a request that bumps the node's side counter -> after_beat
      Announce(round) -> a request that appends the node to the round's intent
                        log -> after_announce
      Wait(until, phase)
                     -> a phase watch (StateSync's ``wait_for_phase``): notified at
                        once if a phase above ``phase`` was already published, else
                        when one is; and a wake at local ``until`` (just past it)
                        or after ``poll_interval``, whichever comes first ->
                        after_wait, then decide again (which reads)
      Done / Verdict -> what the handler and the agent do with them

  A new process registers its heartbeat key with one beat before its first
  decision (as StateSync does). Every operation starts on a stale view (it reads
  first), except a join right after an exit, which decides on the exit's view (the
  handler's ``next_rendezvous``: exit, then join; again when ``Done.rejoin``).
  A node whose join returned trains, as the handler and the agent do: every
  ``keep_alive_interval / 4`` of its own clock it runs the keep-alive operator on
  its current view without re-reading (usually Done or a Beat at once); and the
  agent's monitor loop waits for a phase above its view's (the handler's
  ``wait_for_change``) or ``monitor_interval``, whichever comes first, then reads
  the state with the counters and runs ``driver.monitor`` until a Verdict, and
  waits again; waiting nodes or lost participants make it re-rendezvous (exit,
  then join). A node has one request in flight at a time: a tick that finds it
  busy is queued until the current task ends (the monitor's phase watch runs
  beside it, as the agent's thread does).
* **Clocks**: each node's monotonic clock is ``offset + (1 + drift) * t``; the
  driver only ever sees the node's own clock.
* **Backend**: the state in a compare-and-set register with a version, one side
  heartbeat counter per node, the highest published phase, and one intent log per
  round; request and response latency (``latency`` +- ``jitter`` each way) and
  spurious CAS conflicts (``conflict_rate``). Publishing a phase notifies only the
  nodes watching a lower one (each once per watch); a write that publishes nothing
  wakes nobody (docs/design.md, decision 8).
* **Faults**: crashes (``crash_rate`` per node per minute) with a restart after
  ``restart_delay`` as a new process (new pid); partitions from the backend
  (``partition_rate`` per node per minute, ``partition_duration``): requests are
  lost and time out after ``request_timeout``, after which an operation (join,
  exit, close) re-reads and goes on while a heartbeat or monitor pass gives up
  until its next tick; graceful leaves (``leave_rate``: exit, then the process
  stays down for ``restart_delay``).
* **Failures the agent handles**: a training node's workers fail
  (``worker_failure_rate``): it counts the failure in the job-wide restart budget
  for the round it trained in (``ChargeRestartOp``), then exits that round and
  joins the next, as the agent does; with ``restart_budget`` set, the failure
  after the budget is spent closes the rendezvous, and the run ends closed (a node
  stops once it sees the rendezvous closed). A node fails its health check
  (``health_failure_rate``): it excludes itself (``ExcludeOp``: it leaves its
  round and sits out ``exclusion_rounds`` rounds) and joins again, standing by as
  a spare while excluded. All rates are 0 by default, and a rate of 0 draws
  nothing from the run's random numbers: runs without them are as before.

Every committed write is checked with :func:`check_state` and
:func:`check_transition` (above 256 nodes, a write that neither completes, closes
nor advances the round is checked on the entries it touched, and the whole state
every ``nodes / 32`` writes: see ``check_every``); every returned join for
agreement (the incremental form of :func:`check_agreement`, each distinct
membership united once). A *false death* is a node removed by a peer's write while
it was alive, reachable and heartbeating. Violations carry the last events as a
trace.

Tests can inject writes, beats and intents of nodes that are not simulated
(:meth:`Simulator.inject_write`, :meth:`Simulator.inject_beat`,
:meth:`Simulator.inject_announce`) and record every instruction a node carries
out (``on_instruction``): the driver conformance test runs one scripted scenario
through StateSync and through a simulated node and compares the two instruction
sequences.

Bytes are counted as the size of the state's encoded form (:func:`encode_state`)
on every read and write, plus 8 bytes and the key per side counter read or
beaten, the entry and a separator per intent read (the entry and 8 bytes per
announce), and 8 bytes per published phase. Encoding 1,000 nodes' state takes
milliseconds, so the size is kept incrementally instead: per entry, from the
codec's own entry layout, updated only for the entries a write touched
(:class:`rallypoint.core.codec.EncodedSize`, beside the codec); a test checks it
against ``len(encode_state(state))``.

The cost of simulating one node-step does not grow with the number of nodes,
except where the driver itself does O(n) work (a counter read observes every
member; a finished join lists its round's members) and on the rare writes that
complete or advance a round.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from immutables import Map

from ..core import (
    Action,
    Announce,
    Beat,
    ChargeRestartOp,
    CloseOp,
    Done,
    ExcludeOp,
    ExitOp,
    Instruction,
    JoinOp,
    KeepAliveOp,
    Membership,
    NodeDesc,
    NodeView,
    Operator,
    Read,
    RendezvousState,
    Settings,
    Verdict,
    Wait,
    Write,
    encode_state,
)
from ..core import driver as core_driver
from ..core.codec import EncodedSize
from .invariants import (
    AgreementTracker,
    RoundResult,
    check_budget,
    check_budget_step,
    check_exclusions,
    check_exclusions_kept,
    check_state,
    check_transition,
)
from .lifecycle import Name, Phase
from .options import Rule, check_ranges, check_settings

__all__ = [
    "NodeStats",
    "RoundStat",
    "SimConfig",
    "SimConfigError",
    "SimReport",
    "SimViolation",
    "Simulator",
    "simulate",
]


class SimConfigError(ValueError):
    """A simulator option is out of range (the message names it)."""


@dataclass(frozen=True)
class SimConfig:
    """Everything a run depends on. The same config and seed give the same run.

    Rates are per node per simulated minute; times are simulated seconds.
    """

    nodes: int = 8
    min_nodes: int | None = None
    max_nodes: int | None = None
    seed: int = 0
    duration: float = 300.0
    #: nodes first arrive uniformly over [0, arrival_spread]
    arrival_spread: float = 2.0
    # Rendezvous settings (seconds on each node's own clock).
    last_call_timeout: float = 1.0
    join_timeout: float = 600.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    heartbeat_timeout: float = 5.0
    close_timeout: float = 30.0
    # Backend and network.
    latency: float = 0.002
    jitter: float = 0.001
    conflict_rate: float = 0.0
    request_timeout: float = 1.0
    #: a waiting node re-reads at least this often even without a notification
    poll_interval: float = 5.0
    #: a Wait(until) wakes this long (local seconds) past ``until``: a decision
    #: flips strictly after it (StateSync's timer margin)
    wake_epsilon: float = 0.002
    #: the cap of the jittered exponential backoff after lost compare-and-sets
    #: (StateSync's ``_MAX_BACKOFF``)
    max_backoff: float = 0.05
    #: a training node checks for waiting nodes and lost peers at least this often
    #: (sooner when a phase is published)
    monitor_interval: float = 5.0
    # Clocks: offsets uniform in [-clock_offset, clock_offset] seconds, rates in
    # [1 - drift, 1 + drift].
    clock_offset: float = 0.0
    drift: float = 0.0
    # Faults.
    crash_rate: float = 0.0
    restart_delay: float = 10.0
    partition_rate: float = 0.0
    partition_duration: float = 30.0
    leave_rate: float = 0.0
    #: a training node's workers fail (it charges the restart budget, exits and
    #: joins again), per node per minute
    worker_failure_rate: float = 0.0
    #: a node fails its health check (it excludes itself and joins again as a
    #: spare), per node per minute
    health_failure_rate: float = 0.0
    #: the settings' job-wide restart budget (None: none) and the rounds an
    #: excluded node sits out
    restart_budget: int | None = None
    exclusion_rounds: int = 1
    #: stop with a violation after this many node-steps (a livelock guard)
    max_steps: int | None = None
    #: events kept for a violation's trace
    trace_length: int = 60
    #: encode the state on every write and compare with the incremental size
    verify_bytes: bool = False
    #: check the whole state (check_state, check_transition) every this many
    #: writes; the writes in between are checked on the entries they touched, and
    #: a write that completes, closes or advances a round is always checked whole.
    #: None: every write up to 256 nodes, else every ``nodes // 32`` writes.
    check_every: int | None = None

    def __post_init__(self) -> None:
        check_ranges(self, SimConfigError, _RULES)
        if self.jitter > self.latency:
            raise SimConfigError(f"jitter ({self.jitter}) must not exceed latency ({self.latency})")
        if self.drift >= 0.5:
            raise SimConfigError(f"drift must be below 0.5 (50%), got {self.drift}")
        if self.conflict_rate >= 1:
            raise SimConfigError(f"conflict_rate must be below 1, got {self.conflict_rate}")
        check_settings(self, SimConfigError)

    def settings(self) -> Settings:
        """The rendezvous settings every simulated node uses."""
        return Settings(
            run_id="sim",
            min_nodes=self.min_nodes if self.min_nodes is not None else max(1, self.nodes // 2),
            max_nodes=self.max_nodes if self.max_nodes is not None else self.nodes,
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            close_timeout=self.close_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            keep_alive_interval=self.keep_alive_interval,
            keep_alive_max_attempt=self.keep_alive_max_attempt,
            restart_budget=self.restart_budget,
            exclusion_rounds=self.exclusion_rounds,
        )

    def check_interval(self) -> int:
        """Writes from one whole-state check to the next (see ``check_every``)."""
        if self.check_every is not None:
            return self.check_every
        return 1 if self.nodes <= _CHECK_ALL_UP_TO else max(1, self.nodes // 32)


#: The ranges of SimConfig's fields.
_RULES = (
    Rule(("nodes", "check_every"), 1),
    Rule(
        (
            "duration",
            "arrival_spread",
            "latency",
            "jitter",
            "clock_offset",
            "drift",
            "crash_rate",
            "partition_rate",
            "leave_rate",
            "worker_failure_rate",
            "health_failure_rate",
            "conflict_rate",
            "restart_delay",
            "partition_duration",
            "wake_epsilon",
            "max_backoff",
        ),
        0,
        finite=True,
    ),
    Rule(("request_timeout", "poll_interval", "monitor_interval"), 0, strict=True),
)
#: Up to this many nodes, every write is checked whole (see SimConfig.check_every).
_CHECK_ALL_UP_TO = 256


# -- reports -------------------------------------------------------------------


@dataclass
class NodeStats:
    """Backend traffic and work of one node slot (all its incarnations)."""

    steps: int = 0
    #: read requests (state reads, counter reads and intent-log reads alike)
    reads: int = 0
    #: reads that fetched a round's intent log
    intent_reads: int = 0
    writes: int = 0
    conflicts: int = 0
    #: appends to an intent log (joiners whose compare-and-set lost)
    announces: int = 0
    #: phase notifications received (a Wait's or the monitor's watch)
    notifications: int = 0
    #: waits ended, by a notification or a timer (driver Waits and monitor waits)
    wakeups: int = 0
    timeouts: int = 0
    #: side heartbeat counter bumps (keep-alives of members, and registrations)
    beats: int = 0
    bytes_read: int = 0
    #: state writes, published phases, announces and beats (the beats' share is
    #: ``beat_bytes``)
    bytes_written: int = 0
    beat_bytes: int = 0


@dataclass(frozen=True)
class RoundStat:
    """One completed round: when its first participant joined and when its last
    member returned (simulated seconds), and its size."""

    round: int
    size: int
    opened: float
    completed: float

    @property
    def duration(self) -> float:
        return self.completed - self.opened


@dataclass(frozen=True)
class SimViolation:
    """A broken property, when (simulated time) and the events that led to it."""

    time: float
    problems: tuple[str, ...]
    trace: tuple[str, ...]

    def format(self) -> str:
        lines = [f"VIOLATION at t={self.time:.6f}:", *(f"  - {p}" for p in self.problems)]
        lines.append("last events:")
        lines += [f"  {line}" for line in self.trace]
        return "\n".join(lines)


@dataclass
class SimReport:
    """The outcome of a run. :meth:`format` is a pure function of the run, so the
    same seed prints the same report; wall-clock timing is kept apart."""

    config: SimConfig
    simulated: float = 0.0
    node_steps: int = 0
    events: int = 0
    rounds: list[RoundStat] = field(default_factory=list)
    stats: list[NodeStats] = field(default_factory=list)
    crashes: int = 0
    partitions: int = 0
    leaves: int = 0
    deaths: int = 0
    false_deaths: int = 0
    #: nodes that stopped their workers because their lease ran out (fenced)
    fences: int = 0
    #: nodes declared dead while their workers still ran: a broken lease, so two
    #: groups could train at once (a safety fault)
    unfenced_deaths: int = 0
    timeouts: int = 0
    #: phases published (writes that woke the nodes waiting for a lower one)
    phases: int = 0
    #: training nodes whose workers failed, and nodes that failed a health check
    worker_failures: int = 0
    health_failures: int = 0
    #: won writes that counted a failure in the restart budget, or excluded a node
    charges: int = 0
    exclusions: int = 0
    #: the restart budget's count, and whether the rendezvous is closed, at the end
    restarts: int = 0
    closed: bool = False
    violations: list[SimViolation] = field(default_factory=list)
    #: live, reachable nodes declared dead (a liveness fault, not a safety one)
    false_death_log: list[SimViolation] = field(default_factory=list)
    unfenced_log: list[SimViolation] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations and self.false_deaths == 0 and self.unfenced_deaths == 0

    @property
    def steps_per_second(self) -> float:
        return self.node_steps / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def totals(self) -> NodeStats:
        total = NodeStats()
        for s in self.stats:
            for name in vars(total):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    def summary_rows(self) -> list[tuple[str, str]]:
        """(figure, value) rows of the report, for a table or plain text."""
        c = self.config
        settings = c.settings()
        n = max(1, len(self.stats))
        t = self.totals()
        durations = sorted(r.duration for r in self.rounds)

        def pct(q: float) -> str:
            if not durations:
                return "-"
            return f"{durations[min(len(durations) - 1, int(q * len(durations)))]:.3f} s"

        return [
            ("nodes (min, max)", f"{c.nodes} ({settings.min_nodes}, {settings.max_nodes})"),
            ("seed", str(c.seed)),
            ("simulated time", f"{self.simulated:.1f} s"),
            ("events", f"{self.events:,}"),
            ("node-steps", f"{self.node_steps:,}"),
            ("rounds completed", str(len(self.rounds))),
            ("round time p50 / p90 / max", f"{pct(0.5)} / {pct(0.9)} / {pct(1.0)}"),
            (
                "crashes / partitions / leaves",
                f"{self.crashes} / {self.partitions} / {self.leaves}",
            ),
            ("deaths declared (false)", f"{self.deaths} ({self.false_deaths})"),
            ("fences (deaths of unfenced nodes)", f"{self.fences} ({self.unfenced_deaths})"),
            ("operation timeouts", str(self.timeouts)),
            *self._failure_rows(),
            ("phases published", str(self.phases)),
            ("backend reads per node", f"{t.reads / n:.1f}"),
            ("backend writes per node", f"{t.writes / n:.1f}"),
            ("CAS conflicts per node", f"{t.conflicts / n:.1f}"),
            ("intent announces per node", f"{t.announces / n:.1f}"),
            ("heartbeat beats per node", f"{t.beats / n:.1f}"),
            ("wake-ups per node", f"{t.wakeups / n:.1f}"),
            ("phase notifications per node", f"{t.notifications / n:.1f}"),
            ("bytes read per node", f"{t.bytes_read / n:,.0f}"),
            ("bytes written per node", f"{t.bytes_written / n:,.0f}"),
            ("bytes per write", f"{(t.bytes_written - t.beat_bytes) / max(1, t.writes):,.0f}"),
            ("invariant violations", str(len(self.violations))),
        ]

    def _failure_rows(self) -> list[tuple[str, str]]:
        """The rows of the restart budget and exclusions (none for a run without
        them, whose table stays as it was)."""
        c = self.config
        if not (c.worker_failure_rate or c.health_failure_rate or c.restart_budget is not None):
            return []
        budget = "none" if c.restart_budget is None else str(c.restart_budget)
        return [
            (
                "worker failures / health-check failures",
                f"{self.worker_failures} / {self.health_failures}",
            ),
            ("restarts charged (budget)", f"{self.restarts} ({budget})"),
            ("exclusions", str(self.exclusions)),
            ("rendezvous closed", "yes" if self.closed else "no"),
        ]

    def format(self) -> str:
        width = max(len(k) for k, _ in self.summary_rows())
        lines = [f"{k:<{width}}  {v}" for k, v in self.summary_rows()]
        lines += ["rounds (round, size, opened, completed, seconds):"]
        lines += [
            f"  {r.round} {r.size} {r.opened:.6f} {r.completed:.6f} {r.duration:.6f}"
            for r in self.rounds
        ]
        for v in [*self.violations, *self.false_death_log, *self.unfenced_log]:
            lines.append(v.format())
        return "\n".join(lines)


# -- the simulation --------------------------------------------------------------


class Task(Name):
    """What a node is driving."""

    #: an operation (join, exit, close)
    OP = "op"
    #: a keep-alive (the handler's heartbeat loop)
    BEAT = "beat"
    #: the agent's monitor pass
    MONITOR = "monitor"


class Fault(Name):
    """A fault the simulator injects at a rate per node (see SimConfig)."""

    CRASH = "crash"
    PARTITION = "partition"
    LEAVE = "leave"
    #: a training node's workers fail
    WORKER_FAILURE = "worker-failure"
    #: a node fails its health check
    HEALTH_CHECK = "health-check"


#: Events that belong to one request, wait or backoff of a node (checked against
#: node.req); the phase watch's events are checked against node.wtok, "tick"
#: against node.ticks; every other event is not tied to a token.
_REQUEST_EVENTS = frozenset(
    {
        "backend_read",
        "backend_cas",
        "backend_beat",
        "backend_announce",
        "response",
        "wake",
        "retry",
        "request_timeout",
    }
)
_WATCH_EVENTS = frozenset({"backend_watch", "notify"})
#: The collector's first-generation threshold while the simulator runs.
_GC_THRESHOLD = 50_000


class _Node:
    """One node slot: a process that may crash and come back with a new pid."""

    __slots__ = (
        "alive",
        "deadline",
        "desc",
        "drift",
        "healed_at",
        "incarnation",
        "joined",
        "leaving",
        "losses",
        "mwait",
        "next_beat",
        "next_monitor",
        "offset",
        "op",
        "partitioned",
        "phase",
        "queued_beat",
        "queued_monitor",
        "registered",
        "req",
        "sent",
        "slot",
        "task",
        "ticks",
        "version",
        "view",
        "waiting",
        "watch_q",
        "wtok",
    )

    def __init__(self, slot: int, offset: float, drift: float) -> None:
        self.slot = slot
        self.offset = offset
        self.drift = drift
        self.incarnation = 0
        self.desc = NodeDesc(f"10.0.{slot // 250}.{slot % 250 + 1}", 1000, 0)
        self.alive = False
        self.partitioned = False
        self.healed_at = -math.inf
        self.phase: Phase = Phase.DOWN
        #: what this node knows (the driver's view) and the state version it last
        #: read or wrote (its compare-and-set token; 0: nothing read)
        self.view = NodeView()
        self.version = 0
        #: the task being driven (None: none), its operator and its deadline
        #: (local time)
        self.task: Task | None = None
        self.op: Operator | None = None
        self.deadline = math.inf
        #: the token of the request, wait or backoff in flight (events of older
        #: ones are dropped), whether it is a driver Wait, the CAS losses in a row,
        #: and whether this process has created its heartbeat key
        self.req = 0
        #: local time the request in flight was sent (a renewal counts from then)
        self.sent = 0.0
        self.waiting = False
        self.losses = 0
        self.registered = False
        #: the phase watch: its token, and the phase it is registered under at the
        #: backend (None: not registered); mwait: the agent's monitor is waiting
        self.wtok = 0
        self.watch_q: int | None = None
        self.mwait = False
        #: training: the round joined, the timers (local times) and queued ticks
        self.joined: Membership | None = None
        self.ticks = 0
        self.next_beat = math.inf
        self.next_monitor = math.inf
        self.queued_beat = False
        self.queued_monitor = False
        #: whether the node's exit is a graceful leave (the process then stays
        #: down a while) rather than the first half of a re-rendezvous
        self.leaving = False

    def local(self, t: float) -> float:
        return self.offset + (1.0 + self.drift) * t

    def global_time(self, local: float) -> float:
        return (local - self.offset) / (1.0 + self.drift)


def _key_bytes(node: NodeDesc) -> int:
    """Bytes of one side counter on the wire: its key and an 8-byte value."""
    return len(str(node)) + 8


def _entry_bytes(node: NodeDesc) -> int:
    """Bytes of one intent-log entry when read: the node's name and a separator."""
    return len(str(node)) + 1


class Simulator:
    """One deterministic run. Drive it with :meth:`run`, or step by step with
    :meth:`run_until` and the fault methods (the hypothesis machines do).

    Args:
        config: the run's options and seed.
        on_violation: called with every violation as it is found.
        on_instruction: called with ``(slot, instruction)`` for every instruction
            a node is about to carry out (Done and Verdict included), in order.
    """

    def __init__(
        self,
        config: SimConfig,
        on_violation: Callable[[SimViolation], None] | None = None,
        on_instruction: Callable[[int, Instruction], None] | None = None,
    ) -> None:
        self.config = config
        self.settings = config.settings()
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, int, int, Any]] = []
        self._seq = 0
        #: the backend: the state and its version, the side counter of every node
        #: (an immutable map: a read hands out a snapshot without copying), the
        #: highest published phase (-1: none), and the intent log of each round
        #: with its size in bytes
        self.version = 0
        self.state = RendezvousState()
        self.side: Map[NodeDesc, int] = Map()
        self.published = -1
        self.intents: dict[int, list[NodeDesc]] = {}
        self._intent_bytes: dict[int, int] = {}
        #: phase watches: the phase watched -> {slot: watch token}
        self._watching: dict[int, dict[int, int]] = {}
        #: injected writes waiting for the next compare-and-set (inject_write(race=True))
        self._races: list[Callable[[RendezvousState], RendezvousState | None]] = []
        self.size = EncodedSize(self.state)
        #: bytes of the side counters of the state's heartbeat members
        self.counter_bytes = 0
        self.report = SimReport(config, stats=[NodeStats() for _ in range(config.nodes)])
        self._trace: deque[tuple[float, int, str]] = deque(maxlen=config.trace_length)
        self._on_violation = on_violation
        self._on_instruction = on_instruction
        self._check_every = config.check_interval()
        self._unchecked = 0
        self._checked = self.state
        # Agreement of returned joins, per round: the world size, rank -> node, the
        # union of the memberships, and the memberships already united (by the
        # identity of the participants they were made from, kept alive).
        self.agreement = AgreementTracker()
        self._round_opened: dict[int, float] = {}
        self._round_pending: dict[int, set[NodeDesc]] = {}
        self._round_size: dict[int, int] = {}
        self.closed_by: NodeDesc | None = None
        self._handlers: dict[str, Callable[[_Node, Any], None]] = {
            name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_on_")
        }
        self.nodes = self._arrivals()
        self._by_desc = {node.desc: node for node in self.nodes}

    def _arrivals(self) -> list[_Node]:
        """The node slots, each with its clock, its arrival and its first faults
        scheduled."""
        c, rng = self.config, self.rng
        nodes = [
            _Node(i, rng.uniform(-c.clock_offset, c.clock_offset), rng.uniform(-c.drift, c.drift))
            for i in range(c.nodes)
        ]
        for node in nodes:
            self._at(rng.uniform(0.0, c.arrival_spread), "arrive", node.slot)
            self._schedule_faults(node)
        return nodes

    # -- event plumbing ----------------------------------------------------------

    def _at(self, t: float, kind: str, slot: int, token: int = -1, data: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, slot, token, data))

    def _delay(self) -> float:
        c = self.config
        return c.latency + self.rng.uniform(-c.jitter, c.jitter) if c.latency else 0.0

    def _exp(self, per_minute: float) -> float:
        return self.rng.expovariate(per_minute / 60.0) if per_minute > 0 else math.inf

    def _schedule_faults(self, node: _Node) -> None:
        for fault in Fault:
            self._schedule_fault(node, fault, self._exp(self._fault_rate(fault)))

    def _fault_rate(self, fault: Fault) -> float:
        c = self.config
        if fault is Fault.CRASH:
            return c.crash_rate
        if fault is Fault.WORKER_FAILURE:
            return c.worker_failure_rate
        if fault is Fault.HEALTH_CHECK:
            return c.health_failure_rate
        return c.partition_rate if fault is Fault.PARTITION else c.leave_rate

    def _schedule_fault(self, node: _Node, fault: Fault, delay: float) -> None:
        """The next ``fault`` of ``node`` after ``delay``, if within the run."""
        if self.now + delay < self.config.duration:
            self._at(self.now + delay, "fault", node.slot, -1, fault)

    def _log(self, node: _Node | None, text: str) -> None:
        self._trace.append((self.now, -1 if node is None else node.slot, text))

    def _finding(self, problems: list[str]) -> SimViolation:
        """``problems`` found now, with the last events as their trace."""
        trace = tuple(f"t={t:.6f} node {slot}: {text}" for t, slot, text in self._trace)
        return SimViolation(self.now, tuple(problems), trace)

    def _violate(self, problems: list[str]) -> None:
        violation = self._finding(problems)
        self.report.violations.append(violation)
        if self._on_violation is not None:
            self._on_violation(violation)

    # -- running ---------------------------------------------------------------

    def run(self) -> SimReport:
        """Run until ``duration`` (simulated seconds) and return the report."""
        start = time.perf_counter()
        self.run_until(self.config.duration)
        self.report.wall_seconds = time.perf_counter() - start
        return self.report

    def run_until(self, t: float) -> None:
        """Process every event up to simulated time ``t``.

        The cyclic garbage collector runs less often meanwhile (a run allocates
        millions of short-lived sightings and map nodes, and at the default
        thresholds its full collections, which walk every live view, took half the
        time of a 1,000-node run); the thresholds are restored on return.
        """
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], _GC_THRESHOLD), *thresholds[1:])
        try:
            self._run_until(t)
        finally:
            gc.set_threshold(*thresholds)

    def _run_until(self, t: float) -> None:
        heap = self._heap
        limit = self.config.max_steps
        requests = _REQUEST_EVENTS
        watches = _WATCH_EVENTS
        nodes = self.nodes
        handlers = self._handlers
        report = self.report
        pop = heapq.heappop
        while heap and heap[0][0] <= t:
            when, _, kind, slot, token, data = pop(heap)
            self.now = when
            report.events += 1
            node = nodes[slot]
            if token >= 0:
                if kind in requests:
                    current = node.req
                elif kind in watches:
                    current = node.wtok
                else:
                    current = node.ticks
                if token != current:
                    continue  # of an earlier request, wait, watch or training session
            handlers[kind](node, data)
            if limit is not None and report.node_steps > limit:
                self._violate([f"more than {limit} node-steps: livelock?"])
                heap.clear()
                break
        self.now = max(self.now, t)
        report.simulated = self.now
        report.restarts = self.state.restarts
        report.closed = self.state.closed

    # -- faults (also called directly by the hypothesis machines) ----------------

    def crash(self, slot: int) -> None:
        """Kill node ``slot``'s process now; it restarts after ``restart_delay``."""
        node = self.nodes[slot]
        if not node.alive:
            return
        self._log(node, "crashes")
        self.report.crashes += 1
        self._stop(node)
        self._at(self.now + self.config.restart_delay, "arrive", slot)

    def partition(self, slot: int, duration: float | None = None) -> None:
        """Cut node ``slot`` off the backend (for ``duration``, or until healed)."""
        node = self.nodes[slot]
        if node.partitioned:
            return
        node.partitioned = True
        self.report.partitions += 1
        self._log(node, "partitioned from the backend")
        if duration is not None:
            self._at(self.now + duration, "heal", slot)

    def heal(self, slot: int) -> None:
        """Reconnect node ``slot`` to the backend."""
        node = self.nodes[slot]
        if node.partitioned:
            node.partitioned = False
            node.healed_at = self.now
            self._log(node, "reconnected")

    def leave(self, slot: int) -> None:
        """Node ``slot`` leaves gracefully (the handler's ``leave()``: stop the
        heartbeats, exit) and its process stays down for ``restart_delay``."""
        node = self.nodes[slot]
        if not node.alive or node.phase not in (Phase.TRAINING, Phase.JOINING):
            return
        self.report.leaves += 1
        self._log(node, "leaves")
        deadline = node.local(self.now) + self.settings.close_timeout
        self._begin(node, ExitOp(), deadline, Phase.EXITING, fresh=False)
        node.leaving = True
        self._drive(node)

    def fail_workers(self, slot: int) -> None:
        """The workers of node ``slot`` fail while it trains: as the agent does, it
        counts the failure in the restart budget for the round it trained in,
        then exits that round and joins the next (the failure after the budget is
        spent closes the rendezvous, and the node stops)."""
        node = self.nodes[slot]
        if not node.alive or node.phase is not Phase.TRAINING or node.joined is None:
            return
        self.report.worker_failures += 1
        round_ = node.joined.round
        self._log(node, f"workers failed in round {round_}: charges the restart budget")
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ChargeRestartOp(round_), deadline, Phase.JOINING, fresh=False)
        self._drive(node)

    def fail_health_check(self, slot: int) -> None:
        """Node ``slot`` fails its health check while it trains or joins: it
        excludes itself (leaves its round, sits out ``exclusion_rounds`` rounds),
        then joins again, standing by as a spare while excluded."""
        node = self.nodes[slot]
        if not node.alive or node.phase not in (Phase.TRAINING, Phase.JOINING):
            return
        if isinstance(node.op, (ChargeRestartOp, ExcludeOp)):
            return  # the agent finishes what it does for a failure first
        self.report.health_failures += 1
        self._log(node, "fails its health check: excludes itself")
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ExcludeOp(), deadline, Phase.JOINING, fresh=False)
        self._drive(node)

    def arrive(self, slot: int) -> None:
        """Start node ``slot`` now if it is down (a new process joins)."""
        self._on_arrive(self.nodes[slot], None)

    def close(self, slot: int) -> None:
        """Node ``slot`` closes the rendezvous (the handler's ``shutdown()``)."""
        node = self.nodes[slot]
        if node.alive and node.phase in (Phase.TRAINING, Phase.JOINING):
            deadline = node.local(self.now) + self.settings.close_timeout
            self._begin(node, CloseOp(), deadline, Phase.CLOSING, fresh=False)
            self._drive(node)

    # -- injection (the conformance tests) ---------------------------------------

    def inject_write(
        self,
        at: float,
        change: Callable[[RendezvousState], RendezvousState | None],
        *,
        race: bool = False,
    ) -> None:
        """At simulated time ``at``, a writer that is not simulated replaces the
        stored state with ``change(state)`` (None: writes nothing). The write is
        committed like a node's: checked, versioned, and its phase published if it
        moved the state's. With ``race``, the write lands right before the first
        compare-and-set served at or after ``at``, which then loses to it."""
        self._at(at, "inject", 0, -1, ("race" if race else "write", change))

    def inject_beat(self, at: float, node: NodeDesc) -> None:
        """At simulated time ``at``, bump the side heartbeat counter of ``node``
        (a node that is not simulated beats)."""
        self._at(at, "inject", 0, -1, ("beat", node))

    def inject_announce(self, at: float, node: NodeDesc, round_: int) -> None:
        """At simulated time ``at``, append ``node`` to the intent log of
        ``round_`` (a joiner that is not simulated announces itself)."""
        self._at(at, "inject", 0, -1, ("announce", (node, round_)))

    def _on_inject(self, _: _Node, data: Any) -> None:
        what, payload = data
        if what == "beat":
            self.side = self.side.set(payload, self.side.get(payload, 0) + 1)
            self._log(None, f"injected beat of {payload}")
        elif what == "announce":
            node, round_ = payload
            self._append_intent(node, round_)
            self._log(None, f"injected announce of {node} in round {round_}")
        elif what == "race":
            self._races.append(payload)
        else:
            self._inject_write(payload)

    def _inject_write(self, change: Callable[[RendezvousState], RendezvousState | None]) -> None:
        old = self.state
        new = change(old)
        if new is None:
            return
        touched = old.members() | new.members() | set(old.heartbeats) | set(new.heartbeats)
        self._log(None, "injected write")
        self._commit(None, new, tuple(sorted(touched)))
        if new.phase > old.phase:
            self._publish(new.phase)

    # -- lifecycle ---------------------------------------------------------------

    def _stop(self, node: _Node) -> None:
        node.alive = False
        node.phase = Phase.DOWN
        self._cancel(node)
        node.ticks += 1
        node.task = None
        node.op = None
        node.joined = None
        node.queued_beat = node.queued_monitor = False

    def _cancel(self, node: _Node) -> None:
        """Forget the request, wait, watch or backoff in flight (their events are
        dropped)."""
        node.req += 1
        node.waiting = False
        node.mwait = False
        self._unwatch(node)

    def _on_fault(self, node: _Node, fault: Fault) -> None:
        """A fault of ``node`` is due: inject it, and schedule the next one (a
        partition's after it heals)."""
        if fault is Fault.CRASH:
            self.crash(node.slot)
        elif fault is Fault.PARTITION:
            self.partition(node.slot, self.config.partition_duration)
        elif fault is Fault.WORKER_FAILURE:
            self.fail_workers(node.slot)
        elif fault is Fault.HEALTH_CHECK:
            self.fail_health_check(node.slot)
        else:
            self.leave(node.slot)
        delay = self._exp(self._fault_rate(fault))
        if fault is Fault.PARTITION:
            delay += self.config.partition_duration
        self._schedule_fault(node, fault, delay)

    def _on_heal(self, node: _Node, data: Any) -> None:
        self.heal(node.slot)

    def _on_arrive(self, node: _Node, data: Any) -> None:
        if node.alive or node.phase is Phase.CLOSED:
            return
        node.alive = True
        if node.incarnation:
            self._by_desc.pop(node.desc, None)
            node.desc = NodeDesc(node.desc.addr, 1000 + node.incarnation, 0)
            self._by_desc[node.desc] = node
        node.incarnation += 1
        node.view = NodeView()
        node.version = 0
        node.registered = False
        self._log(node, f"starts as {node.desc}")
        self._regroup(node)
        self._drive(node)

    def _begin(self, node: _Node, op: Operator, deadline: float, phase: Phase, fresh: bool) -> None:
        """Start an operation (StateSync.run): stop the heartbeats, the monitor and
        whatever the node was doing; unless ``fresh``, the first decision reads."""
        self._cancel(node)
        node.ticks += 1
        node.queued_beat = node.queued_monitor = False
        node.task = Task.OP
        node.op = op
        node.deadline = deadline
        node.phase = phase
        node.losses = 0
        node.leaving = False
        if not fresh:
            node.view = core_driver.after_wait(node.view)

    def _regroup(self, node: _Node) -> None:
        """The handler's next_rendezvous: exit the current round, then join."""
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ExitOp(), deadline, Phase.JOINING, fresh=False)

    # -- carrying out instructions ---------------------------------------------------

    def _drive(self, node: _Node) -> None:
        """Decide and carry out instructions until one needs the backend or time
        (StateSync._drive, with the IO turned into events)."""
        settings = self.settings
        report = self.report
        stats = report.stats[node.slot]
        while node.task is not None:
            if not node.registered:
                # StateSync creates the node's heartbeat key before its first decision.
                self._request(node, "backend_beat")
                return
            now = node.local(self.now)
            if node.task is Task.MONITOR:
                decision = core_driver.monitor(node.view, node.desc, settings, node.joined, now)
            else:
                assert node.op is not None
                decision = core_driver.decide(
                    node.view, node.desc, settings, node.op, node.deadline, now
                )
            report.node_steps += 1
            stats.steps += 1
            instruction = decision.instruction
            if self._on_instruction is not None:
                self._on_instruction(node.slot, instruction)
            if type(instruction) is Read:
                data = (instruction.counters, instruction.intents, instruction.state)
                self._request(node, "backend_read", data)
                return
            if type(instruction) is Write:
                if instruction.action is not None or instruction.dead:
                    what = "publish" if instruction.action is None else instruction.action.name
                    self._log(node, f"{self._task_name(node)} -> {what}")
                self._request(node, "backend_cas", (node.version, instruction))
                return
            if type(instruction) is Beat:
                self._request(node, "backend_beat")
                return
            if type(instruction) is Announce:
                self._request(node, "backend_announce", instruction.round)
                return
            if type(instruction) is Wait:
                self._wait(node, instruction.until, instruction.phase, now)
                return
            if type(instruction) is Done:
                if not self._done(node, instruction):
                    return
                continue
            assert type(instruction) is Verdict
            if not self._verdict(node, instruction):
                return

    @staticmethod
    def _task_name(node: _Node) -> str:
        return "monitor" if node.task is Task.MONITOR else type(node.op).__name__

    def _request(self, node: _Node, kind: str, data: Any = None) -> None:
        node.req += 1
        node.sent = node.local(self.now)
        if node.partitioned:
            self._at(self.now + self.config.request_timeout, "request_timeout", node.slot, node.req)
            return
        self._at(self.now + self._delay(), kind, node.slot, node.req, data)

    def _reply(self, node: _Node, data: Any) -> None:
        self._at(self.now + self._delay(), "response", node.slot, node.req, data)

    def _wait(self, node: _Node, until: float | None, phase: int, now: float) -> None:
        """StateSync._wait: wait_for_phase(phase), with a wake at ``until`` (just
        past it) or after poll_interval, whichever comes first."""
        timeout = self.config.poll_interval
        if until is not None:
            timeout = min(timeout, max(0.0, until - now) + self.config.wake_epsilon)
        node.req += 1
        node.waiting = True
        self._at(node.global_time(now + timeout), "wake", node.slot, node.req)
        self._watch(node, phase)

    def _end_wait(self, node: _Node) -> None:
        node.waiting = False
        node.req += 1  # drop the other of notification and wake
        self._unwatch(node)
        self.report.stats[node.slot].wakeups += 1
        node.view = core_driver.after_wait(node.view)

    # -- phase watches -------------------------------------------------------------

    def _watch(self, node: _Node, phase: int) -> None:
        """Ask the backend to notify ``node`` once a phase above ``phase`` is
        published (a request: lost while partitioned, the timer then decides)."""
        self._unwatch(node)
        if not node.partitioned:
            self._at(self.now + self._delay(), "backend_watch", node.slot, node.wtok, phase)

    def _unwatch(self, node: _Node) -> None:
        """Drop ``node``'s phase watch (its pending events too)."""
        node.wtok += 1
        watched = node.watch_q
        if watched is not None:
            node.watch_q = None
            slots = self._watching.get(watched)
            if slots is not None:
                slots.pop(node.slot, None)
                if not slots:
                    del self._watching[watched]

    def _on_backend_watch(self, node: _Node, phase: int) -> None:
        if self.published > phase:
            self._at(self.now + self._delay(), "notify", node.slot, node.wtok)
            return
        self._watching.setdefault(phase, {})[node.slot] = node.wtok
        node.watch_q = phase

    def _publish(self, phase: int) -> None:
        """Publish ``phase``: notify the nodes watching a lower one (only them; a
        partitioned one stays registered and is notified by a later phase)."""
        if phase <= self.published:
            return
        self.published = phase
        self.report.phases += 1
        watching = self._watching
        nodes = self.nodes
        for watched in [q for q in watching if q < phase]:
            slots = watching.pop(watched)
            kept: dict[int, int] = {}
            for slot, token in slots.items():
                node = nodes[slot]
                if token != node.wtok:
                    continue
                if node.partitioned:
                    kept[slot] = token
                    continue
                node.watch_q = None
                self._at(self.now + self._delay(), "notify", slot, token)
            if kept:
                watching[watched] = kept

    def _on_notify(self, node: _Node, data: Any) -> None:
        node.watch_q = None
        self.report.stats[node.slot].notifications += 1
        if node.waiting:
            self._end_wait(node)
            self._drive(node)
        elif node.mwait:
            self._end_monitor_wait(node)
            if node.task is None and self._idle(node):
                self._drive(node)

    # -- the backend -------------------------------------------------------------------

    def _on_backend_read(self, node: _Node, data: tuple[bool, bool, bool]) -> None:
        counters, intents, with_state = data
        stats = self.report.stats[node.slot]
        stats.reads += 1
        if with_state:
            state = self.state
            size = self.size.value
        else:
            state = node.view.state  # StateSync keeps the view's state and token
            size = 0
        side = None
        if counters:
            # Every node's counter (an immutable snapshot, no copy); the driver
            # looks up the members' only, which is what the bytes count.
            side = self.side
            if with_state:
                size += self.counter_bytes
            else:
                size += sum(map(_key_bytes, state.heartbeats))
        log = None
        if intents:
            stats.intent_reads += 1
            entries = self.intents.get(state.round)
            log = () if entries is None else tuple(entries)
            size += self._intent_bytes.get(state.round, 0)
        stats.bytes_read += size
        reply = ("read", state if with_state else None, self.version, side, log)
        self._reply(node, reply)

    def _on_backend_cas(self, node: _Node, data: tuple[int, Write]) -> None:
        expected, write = data
        if self._races:
            # Injected writes that beat this compare-and-set.
            races, self._races = self._races, []
            for change in races:
                self._inject_write(change)
        stats = self.report.stats[node.slot]
        if expected != self.version or (
            self.config.conflict_rate and self.rng.random() < self.config.conflict_rate
        ):
            stats.conflicts += 1
            stats.bytes_read += self.size.value
            self._reply(node, ("cas", False, self.state, self.version, write))
            return
        for gone in sorted(write.dead):  # sorted: the report is independent of hashing
            self._judge_death(node, gone)
        # The writer may be among the dead (its own counter stood still, e.g. while
        # it was partitioned): name each touched node once.
        touched = tuple(dict.fromkeys((node.desc, *sorted(write.dead), *write.admitted)))
        self._commit(node, write.state, touched)
        if write.action is Action.CHARGE_RESTART:
            self.report.charges += 1
        elif write.action is Action.EXCLUDE:
            self.report.exclusions += 1
        if write.phase is not None:
            stats.bytes_written += 8
            self._publish(write.phase)
        self._reply(node, ("cas", True, self.state, self.version, write))

    def _on_backend_beat(self, node: _Node, data: Any) -> None:
        value = self.side.get(node.desc, 0) + 1
        self.side = self.side.set(node.desc, value)
        stats = self.report.stats[node.slot]
        size = _key_bytes(node.desc)
        stats.beats += 1
        stats.bytes_written += size
        stats.beat_bytes += size
        self._reply(node, ("beat", value))

    def _append_intent(self, desc: NodeDesc, round_: int) -> None:
        self.intents.setdefault(round_, []).append(desc)
        self._intent_bytes[round_] = self._intent_bytes.get(round_, 0) + _entry_bytes(desc)

    def _on_backend_announce(self, node: _Node, round_: int) -> None:
        self._append_intent(node.desc, round_)
        stats = self.report.stats[node.slot]
        stats.announces += 1
        stats.bytes_written += len(str(node.desc)) + 8
        self._log(node, f"announces itself in round {round_}")
        self._reply(node, ("announce", round_))

    def _commit(
        self, writer: _Node | None, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> None:
        old = self.state
        problems = self._check(old, new, touched)
        self.version += 1
        self.state = new
        size = self.size.update(new, touched)
        for desc in touched:
            if desc in old.heartbeats:
                self.counter_bytes -= _key_bytes(desc)
            if desc in new.heartbeats:
                self.counter_bytes += _key_bytes(desc)
        if self.config.verify_bytes:
            encoded = len(encode_state(new))
            if size != encoded:
                problems.append(f"incremental size {size} != encoded size {encoded}")
            counted = sum(map(_key_bytes, new.heartbeats))
            if self.counter_bytes != counted:
                problems.append(f"counter bytes {self.counter_bytes} != {counted}")
        if writer is not None:
            stats = self.report.stats[writer.slot]
            stats.writes += 1
            stats.bytes_written += size
        self._account_round(old, new, touched)
        if problems:
            self._violate(problems)

    def _check(
        self, old: RendezvousState, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> list[str]:
        """The safety properties of the write ``old -> new`` (see check_every)."""
        self._unchecked += 1
        if (
            self._unchecked >= self._check_every
            or old.complete != new.complete
            or old.round != new.round
            or old.closed != new.closed
        ):
            problems = check_state(new, self.settings) + check_transition(old, new)
            if self._checked is not old:
                # Over every write since the last whole check (each property is
                # one that holds across several steps when it holds across each,
                # the failures counted per write aside: see check_transition).
                span = check_transition(self._checked, new, steps=self._unchecked)
                problems += [p for p in span if p not in problems]
            self._unchecked = 0
            self._checked = new
            return problems
        return self._check_touched(old, new, touched)

    def _check_touched(
        self, old: RendezvousState, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> list[str]:
        """check_state and check_transition on the entries ``touched`` (the write
        neither completed, closed nor advanced a round), in their words."""
        problems: list[str] = []
        s = self.settings
        participants = new.participants
        if len(participants) > s.max_nodes:
            problems.append(f"{len(participants)} participants exceed max_nodes {s.max_nodes}")
        if new.complete and len(participants) > new.world_size:
            problems.append(f"complete round {new.round} has more participants than world size")
        if not new.complete and new.world_size != 0:
            problems.append(f"incomplete round {new.round} has world size {new.world_size}")
        if new.complete and new.world_size != old.world_size:
            problems.append(f"world size of complete round {new.round} changed")
        waiting, redundant = new.wait_list, new.redundancy_list
        for node in touched:
            member = node in participants
            if member and (node in waiting or node in redundant):
                problems.append(f"nodes {[str(node)]} are participants and waiting/redundant")
            if node in waiting and node in redundant:
                problems.append("a node is both waiting and redundant")
            if new.complete and member:
                rank = old.participants.get(node)
                if rank is None:
                    problems.append(f"{node} joined complete round {new.round}")
                elif rank != participants[node]:
                    problems.append(f"rank of {node} changed within complete round {new.round}")
        # The restart budget (a few numbers) and the exclusions of the entries touched.
        if new.restarts != old.restarts or new.charged_through != old.charged_through:
            problems += check_budget_step(old, new) + check_budget(new, s)
        if new.excluded or old.excluded:
            problems += check_exclusions(new, touched)
            problems += check_exclusions_kept(old, new, touched)
        return problems

    def _account_round(
        self, old: RendezvousState, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> None:
        if new.participants and not new.complete and new.round not in self._round_opened:
            self._round_opened[new.round] = self.now
        if new.complete and not old.complete:
            self._round_pending[new.round] = set(new.participants)
            self._round_size[new.round] = new.world_size
        pending = self._round_pending.get(old.round)
        if pending is not None and len(new.participants) < len(old.participants):
            # Members that leave or die before returning no longer hold the round up.
            if new.round != old.round:
                pending.clear()
            else:
                for node in touched:
                    if node not in new.participants:
                        pending.discard(node)
            self._round_done(old.round)

    def _round_done(self, round_: int) -> None:
        pending = self._round_pending.get(round_)
        if pending is not None and not pending:
            del self._round_pending[round_]
            opened = self._round_opened.get(round_, self.now)
            self.report.rounds.append(RoundStat(round_, self._round_size[round_], opened, self.now))

    def _judge_death(self, observer: _Node, gone: NodeDesc) -> None:
        """Count a removal by a peer; a false one if the node was alive, reachable
        and heartbeating on schedule (docs/design.md, decision 2)."""
        self.report.deaths += 1
        self._log(observer, f"declares {gone} dead")
        node = self._by_desc.get(gone)
        if node is None or node.desc != gone:
            return
        if node.alive and node.phase is Phase.TRAINING:
            # Its lease ran out on its peer's clock while its workers still ran: it
            # should have fenced itself first (core.driver.must_fence).
            self.report.unfenced_deaths += 1
            problem = f"unfenced death: {observer.desc} declared {gone} dead while it trained"
            self.report.unfenced_log.append(self._finding([problem]))
        if node.alive and node.phase in (Phase.JOINING, Phase.TRAINING, Phase.EXITING):
            grace = self.settings.liveness_window + self.config.request_timeout * 2
            if not node.partitioned and self.now - node.healed_at > grace:
                self.report.false_deaths += 1
                problem = f"false death: {observer.desc} declared live {gone} dead"
                self.report.false_death_log.append(self._finding([problem]))

    # -- results coming back -------------------------------------------------------------

    def _on_response(self, node: _Node, data: Any) -> None:
        now = node.local(self.now)
        what = data[0]
        if what == "read":
            _, state, version, side, log = data
            if state is None:  # Read(state=False): the view's state and token stay
                state = node.view.state
            else:
                node.version = version
            node.view = core_driver.after_read(node.view, node.desc, state, side, now, log)
        elif what == "cas":
            _, won, stored, version, write = data
            node.version = version
            node.view = core_driver.after_write(node.view, node.desc, won, stored, now, node.sent)
            if not won:
                node.losses += 1
                # StateSync's jittered, capped exponential backoff before deciding again.
                cap = min(self.config.max_backoff, 0.001 * 2 ** min(node.losses, 16))
                self._at(self.now + self.rng.uniform(0, cap), "retry", node.slot, node.req)
                return
            node.losses = 0
            if write.deadline is not None and node.task is Task.OP:
                node.deadline = write.deadline
        elif what == "announce":
            node.view = core_driver.after_announce(node.view, data[1])
        else:  # a beat
            node.registered = True
            node.view = core_driver.after_beat(node.view, node.desc, data[1], now, node.sent)
        self._drive(node)

    def _on_retry(self, node: _Node, data: Any) -> None:
        self._drive(node)

    def _on_wake(self, node: _Node, data: Any) -> None:
        if not node.waiting:
            return
        self._end_wait(node)
        self._drive(node)

    def _on_request_timeout(self, node: _Node, data: Any) -> None:
        self.report.stats[node.slot].timeouts += 1
        self._log(node, "request timed out")
        if node.task is Task.OP:
            # An operation retries (StateSync within its retry window): read again.
            node.view = core_driver.after_wait(node.view)
            self._drive(node)
            return
        if node.task is Task.MONITOR:
            # The agent's monitor pass failed: it waits and checks again.
            self._monitor_wait(node)
        # A heartbeat or monitor pass gives up until its next tick.
        if self._idle(node):
            self._drive(node)

    # -- what the handler and the agent do with Done and Verdict -----------------------

    def _done(self, node: _Node, done: Done) -> bool:
        """Act on an operation's end; True: the node drives on (a next operation)."""
        if node.task is Task.BEAT:
            return self._idle(node)  # a failed keep-alive is only logged
        op, action = node.op, done.action
        if isinstance(op, (ChargeRestartOp, ExcludeOp)) and action is Action.FINISH:
            if done.state.closed:
                # The budget is spent (this charge closed it) or the job ended.
                self._log(node, f"{type(op).__name__} -> the rendezvous is closed: stops")
                self._stop_closed(node)
                return False
            # Charged: leave the round, then join the next; excluded (out of its
            # round already): join again, as a spare while excluded. Either
            # decides on the view its write left (fresh).
            after = ExitOp() if isinstance(op, ChargeRestartOp) else JoinOp()
            self._begin(node, after, node.deadline, Phase.JOINING, fresh=True)
            return True
        if isinstance(op, ExitOp) and action is Action.FINISH:
            if node.leaving:
                self._stop(node)
                self._at(self.now + self.config.restart_delay, "arrive", node.slot)
                return False
            # next_rendezvous: the join decides on the exit's view (fresh).
            self._begin(node, JoinOp(), node.deadline, Phase.JOINING, fresh=True)
            return True
        if isinstance(op, JoinOp) and action is Action.FINISH:
            if done.rejoin:
                self._log(node, f"round {done.state.round} lost its rank 0: rejoins")
                self._begin(node, ExitOp(), node.deadline, Phase.JOINING, fresh=False)
                return True
            self._joined(node, done)
            return False
        self._log(node, f"{type(op).__name__} -> {action.name}")
        if (action is Action.FINISH and isinstance(op, CloseOp)) or action in (
            Action.ERROR_CLOSED,
            Action.ERROR_GRACEFUL_EXIT,
        ):
            self._stop_closed(node)
            return False
        # ERROR_TIMEOUT: the agent gives up on this attempt and starts over.
        self.report.timeouts += 1
        self._stop(node)
        self._at(self.now + self.config.restart_delay, "arrive", node.slot)
        return False

    def _stop_closed(self, node: _Node) -> None:
        """The rendezvous is closed: the node stops for good."""
        self.closed_by = self.closed_by or node.desc
        self._stop(node)
        node.phase = Phase.CLOSED

    def _joined(self, node: _Node, done: Done) -> None:
        """The join returned: check agreement, then train (heartbeats and monitor)."""
        joined = done.joined
        assert joined is not None
        self._log(node, f"joined round {joined.round} as rank {joined.rank}")
        problems = self._agree(node.desc, done, joined)
        if problems:
            self._violate(problems)
        pending = self._round_pending.get(joined.round)
        if pending is not None:
            pending.discard(node.desc)
            self._round_done(joined.round)
        node.phase = Phase.TRAINING
        node.joined = joined
        node.task = None
        node.op = None
        node.next_beat = node.local(self.now) + self.settings.keep_alive_interval / 4
        self._monitor_wait(node)

    def _agree(self, desc: NodeDesc, done: Done, joined: Membership) -> list[str]:
        """Agreement of one returned join with the others of its round. The round's
        node -> rank map is shared by every node that returned on the same state,
        so the tracker merges it once."""
        result = RoundResult(joined.round, joined.rank, joined.world_size, joined.participants)
        return self.agreement.add(desc, result)

    def _verdict(self, node: _Node, verdict: Verdict) -> bool:
        """The agent's monitor: stop once the rendezvous is closed (elsewhere: the
        budget spent, or the job ended), regroup on waiting nodes or lost
        participants, else wait for the next phase (or monitor_interval) and
        check again."""
        if node.view.state.closed:
            self._log(node, "the rendezvous is closed: stops its workers")
            self._stop_closed(node)
            return False
        if verdict.waiting or verdict.lost:
            reason = "peer lost" if verdict.lost else "nodes waiting"
            self._log(node, f"re-rendezvous: {reason}")
            self._regroup(node)
            return True
        self._monitor_wait(node)
        return self._idle(node)

    # -- training: heartbeats and the agent's monitor -----------------------------

    def _monitor_wait(self, node: _Node) -> None:
        """The agent's ``wait_for_change(monitor_interval)``: a phase watch on the
        view's phase, and the monitor's timer."""
        node.mwait = True
        node.next_monitor = node.local(self.now) + self.config.monitor_interval
        self._watch(node, node.view.state.phase)
        self._schedule_tick(node)

    def _end_monitor_wait(self, node: _Node) -> None:
        """The monitor's wait ended (a phase, or its timer): a pass is due."""
        node.mwait = False
        self._unwatch(node)
        self.report.stats[node.slot].wakeups += 1
        node.queued_monitor = True
        node.next_monitor = math.inf
        self._schedule_tick(node)

    def _schedule_tick(self, node: _Node) -> None:
        node.ticks += 1  # one pending tick per node
        due = min(node.next_beat, node.next_monitor)
        if due < math.inf:
            self._at(node.global_time(due), "tick", node.slot, node.ticks, due)

    def _on_tick(self, node: _Node, due: float) -> None:
        if node.phase is Phase.TRAINING and core_driver.must_fence(
            node.view, node.desc, self.settings, due
        ):
            # The agent's lease check: its workers stop, and it rejoins (it cannot
            # reach the store to leave first).
            self.report.fences += 1
            self._log(node, "lease ran out: fences (stops its workers) and rejoins")
            self._regroup(node)
            self._drive(node)
            return
        if node.next_beat <= due:
            node.queued_beat = True
            node.next_beat += self.settings.keep_alive_interval / 4
        if node.next_monitor <= due and node.mwait:
            self._end_monitor_wait(node)
        self._schedule_tick(node)
        if node.task is None and self._idle(node):
            self._drive(node)

    def _idle(self, node: _Node) -> bool:
        """A training node's task ended: start a queued one. True: drive it now."""
        node.task = None
        node.op = None
        if node.queued_beat:
            # The handler's heartbeat loop: KeepAliveOp on the current view (fresh).
            node.queued_beat = False
            node.task = Task.BEAT
            node.op = KeepAliveOp()
            node.deadline = node.local(self.now) + self.settings.heartbeat_timeout
            node.losses = 0
            return True
        if node.queued_monitor:
            # The agent's num_nodes_waiting / dead_participants (StateSync.monitor):
            # the view is stale, so the driver's monitor reads first (with the
            # counters when they are due).
            node.queued_monitor = False
            node.task = Task.MONITOR
            node.losses = 0
            node.view = core_driver.after_wait(node.view)
            return True
        return False


def simulate(config: SimConfig) -> SimReport:
    """Run one simulation and return its report."""
    return Simulator(config).run()
