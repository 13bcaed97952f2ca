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
  ``after_*`` functions::

      Read(counters) -> a read request; the blob (and the side counters of its
                        heartbeat members) -> after_read
      Write(state)   -> a compare-and-set request on the blob's version ->
                        after_write; a lost one decides again after a jittered
                        exponential backoff; a won one with ``deadline`` moves the
                        operation's deadline
      Beat()         -> a request that bumps the node's side counter -> after_beat
      Wait(until)    -> a watch on the version read, and a wake at local ``until``
                        (just past it) or after ``poll_interval``, whichever comes
                        first -> after_wait, then decide again (which reads)
      Done / Verdict -> what the handler and the agent do with them

  A new process registers its heartbeat key with one beat before its first
  decision (as StateSync does). Every operation starts on a stale view (it reads
  first), except a join right after an exit, which decides on the exit's view (the
  handler's ``next_rendezvous``: exit, then join; again when ``Done.rejoin``).
  A node whose join returned trains, as the handler and the agent do: every
  ``keep_alive_interval / 4`` of its own clock it runs the keep-alive operator on
  its current view without re-reading (usually Done or a Beat at once), and every
  ``monitor_interval`` it reads the state with the counters and runs
  ``driver.monitor`` until a Verdict; waiting nodes or lost participants make it
  re-rendezvous (exit, then join). A node has one request in flight at a time: a
  tick that finds it busy is queued until the current task ends.
* **Clocks**: each node's monotonic clock is ``offset + (1 + drift) * t``; the
  driver only ever sees the node's own clock.
* **Backend**: the state blob (a :class:`RendezvousState` whose heartbeat
  counters are in blob form, see :mod:`rallypoint.core.liveness`) in a
  compare-and-set register with a version, plus one side heartbeat counter per
  node; request and response latency (``latency`` +- ``jitter`` each way),
  spurious CAS conflicts (``conflict_rate``) and watch notifications (a node is
  notified once per wait; it then re-reads, as StateSync does after
  ``wait_for_change``).
* **Faults**: crashes (``crash_rate`` per node per minute) with a restart after
  ``restart_delay`` as a new process (new pid); partitions from the backend
  (``partition_rate`` per node per minute, ``partition_duration``): requests are
  lost and time out after ``request_timeout``, after which an operation (join,
  exit, close) re-reads and goes on while a heartbeat or monitor pass gives up
  until its next tick; graceful leaves (``leave_rate``: exit, then the process
  stays down for ``restart_delay``).

Every committed write is checked with :func:`check_state` and
:func:`check_transition`; every returned join with an :class:`AgreementTracker`
(the incremental form of :func:`check_agreement`). A *false death* is a node
removed by a peer's write while it was alive, reachable and heartbeating.
Violations carry the last events as a trace.

Tests can inject writes and beats of nodes that are not simulated
(:meth:`Simulator.inject_write`, :meth:`Simulator.inject_beat`) and record every
instruction a node carries out (``on_instruction``): the driver conformance test
runs one scripted scenario through StateSync and through a simulated node and
compares the two instruction sequences.

Bytes are counted as the size of the blob's encoded form (:func:`encode_state`)
on every read and write, plus 8 bytes and the key per side counter read or
beaten. Encoding 1,000 nodes' state takes milliseconds, so the size is kept
incrementally instead: per entry, from the codec's own entry layout, updated only
for the entries a write touched (:class:`EncodedSize`); a test checks it against
``len(encode_state(state))``.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rallypoint.core import (
    Action,
    Beat,
    CloseOp,
    Done,
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
from rallypoint.core import driver as core_driver

from .invariants import AgreementTracker, RoundResult, check_state, check_transition

__all__ = [
    "EncodedSize",
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
    #: a training node checks for waiting nodes and lost peers this often
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
    #: stop with a violation after this many node-steps (a livelock guard)
    max_steps: int | None = None
    #: events kept for a violation's trace
    trace_length: int = 60
    #: encode the state on every write and compare with the incremental size
    verify_bytes: bool = False

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise SimConfigError(f"nodes must be at least 1, got {self.nodes}")
        for name in (
            "duration",
            "arrival_spread",
            "latency",
            "jitter",
            "clock_offset",
            "drift",
            "crash_rate",
            "partition_rate",
            "leave_rate",
            "conflict_rate",
            "restart_delay",
            "partition_duration",
            "wake_epsilon",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise SimConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("request_timeout", "poll_interval", "monitor_interval"):
            if getattr(self, name) <= 0:
                raise SimConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.jitter > self.latency:
            raise SimConfigError(f"jitter ({self.jitter}) must not exceed latency ({self.latency})")
        if self.drift >= 0.5:
            raise SimConfigError(f"drift must be below 0.5 (50%), got {self.drift}")
        if self.conflict_rate >= 1:
            raise SimConfigError(f"conflict_rate must be below 1, got {self.conflict_rate}")
        try:
            self.settings()
        except ValueError as exc:
            raise SimConfigError(str(exc)) from None

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
        )


# -- encoded size --------------------------------------------------------------


def _entry_len(node: NodeDesc, *extra: int) -> int:
    return len(json.dumps([node[0], node[1], node[2], *extra], separators=(",", ":")))


class EncodedSize:
    """``len(encode_state(state))``, kept incrementally across writes.

    The codec writes each collection as a JSON list of per-node entries; the size
    of a state is the size of the state with empty collections plus, per non-empty
    collection, the sizes of its entries and the commas between them. A write
    changes the entries of the nodes it touched (the writer and the nodes its
    sanitize removed), except when ranks are assigned or the round advances, when
    the participants are counted again.
    """

    def __init__(self, state: RendezvousState) -> None:
        self._state = state
        self._parts = {name: self._full(state, name) for name in self._NAMES}
        self.value = self._total(state)

    _NAMES = ("p", "w", "r", "hb", "lr")

    @staticmethod
    def _items(state: RendezvousState, name: str) -> Iterable[tuple[NodeDesc, tuple[int, ...]]]:
        if name == "p":
            return ((n, (r,)) for n, r in state.participants.items())
        if name == "w":
            return ((n, ()) for n in state.wait_list)
        if name == "r":
            return ((n, ()) for n in state.redundancy_list)
        if name == "hb":
            return ((n, (c,)) for n, c in state.heartbeats.items())
        return ((n, (r,)) for n, r in state.last_ranks.items())

    @staticmethod
    def _entry(state: RendezvousState, name: str, node: NodeDesc) -> int | None:
        """The entry size of ``node`` in collection ``name``, None if absent."""
        if name == "p":
            rank = state.participants.get(node)
            return None if rank is None else _entry_len(node, rank)
        if name == "w":
            return _entry_len(node) if node in state.wait_list else None
        if name == "r":
            return _entry_len(node) if node in state.redundancy_list else None
        if name == "hb":
            counter = state.heartbeats.get(node)
            return None if counter is None else _entry_len(node, counter)
        rank = state.last_ranks.get(node)
        return None if rank is None else _entry_len(node, rank)

    def _full(self, state: RendezvousState, name: str) -> tuple[int, int]:
        sizes = [_entry_len(n, *extra) for n, extra in self._items(state, name)]
        return sum(sizes), len(sizes)

    def _total(self, state: RendezvousState) -> int:
        empty = state.evolve(
            participants={},
            wait_list=frozenset(),
            redundancy_list=frozenset(),
            heartbeats={},
            last_ranks={},
        )
        size = len(encode_state(empty))
        for total, count in self._parts.values():
            if count:
                size += total + count - 1
        return size

    @staticmethod
    def _source(state: RendezvousState, name: str) -> object:
        return {
            "p": state.participants,
            "w": state.wait_list,
            "r": state.redundancy_list,
            "hb": state.heartbeats,
            "lr": state.last_ranks,
        }[name]

    def update(self, new: RendezvousState, touched: Iterable[NodeDesc]) -> int:
        """The size of ``new``, a state written over the previous one by a step
        that touched only ``touched`` (plus what ranking or a new round changes)."""
        old = self._state
        touched = tuple(dict.fromkeys(touched))  # a node may be named twice
        for name in self._NAMES:
            if self._source(old, name) is self._source(new, name):
                continue
            rerank = name in ("p", "lr") and (
                old.complete != new.complete or old.round != new.round
            )
            if rerank:
                self._parts[name] = self._full(new, name)
                continue
            total, count = self._parts[name]
            for node in touched:
                before = self._entry(old, name, node)
                after = self._entry(new, name, node)
                if before is not None:
                    total, count = total - before, count - 1
                if after is not None:
                    total, count = total + after, count + 1
            self._parts[name] = (total, count)
        self._state = new
        self.value = self._total(new)
        return self.value


# -- reports -------------------------------------------------------------------


@dataclass
class NodeStats:
    """Backend traffic and work of one node slot (all its incarnations)."""

    steps: int = 0
    reads: int = 0
    writes: int = 0
    conflicts: int = 0
    notifications: int = 0
    timeouts: int = 0
    #: side heartbeat counter bumps (keep-alives of members, and registrations)
    beats: int = 0
    bytes_read: int = 0
    #: blob writes and beats (the beats' share is ``beat_bytes``)
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
    timeouts: int = 0
    violations: list[SimViolation] = field(default_factory=list)
    #: live, reachable nodes declared dead (a liveness fault, not a safety one)
    false_death_log: list[SimViolation] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations and self.false_deaths == 0

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
            ("operation timeouts", str(self.timeouts)),
            ("backend reads per node", f"{t.reads / n:.1f}"),
            ("backend writes per node", f"{t.writes / n:.1f}"),
            ("CAS conflicts per node", f"{t.conflicts / n:.1f}"),
            ("heartbeat beats per node", f"{t.beats / n:.1f}"),
            ("watch notifications per node", f"{t.notifications / n:.1f}"),
            ("bytes read per node", f"{t.bytes_read / n:,.0f}"),
            ("bytes written per node", f"{t.bytes_written / n:,.0f}"),
            ("bytes per write", f"{(t.bytes_written - t.beat_bytes) / max(1, t.writes):,.0f}"),
            ("invariant violations", str(len(self.violations))),
        ]

    def format(self) -> str:
        width = max(len(k) for k, _ in self.summary_rows())
        lines = [f"{k:<{width}}  {v}" for k, v in self.summary_rows()]
        lines += ["rounds (round, size, opened, completed, seconds):"]
        lines += [
            f"  {r.round} {r.size} {r.opened:.6f} {r.completed:.6f} {r.duration:.6f}"
            for r in self.rounds
        ]
        for v in [*self.violations, *self.false_death_log]:
            lines.append(v.format())
        return "\n".join(lines)


# -- the simulation --------------------------------------------------------------

_DOWN, _JOINING, _TRAINING, _EXITING, _CLOSING, _CLOSED = (
    "down",
    "joining",
    "training",
    "exiting",
    "closing",
    "closed",
)
#: What a node is driving: an operation (join, exit, close), a keep-alive, or the
#: agent's monitor pass.
_OP, _BEAT, _MONITOR = "op", "beat", "monitor"
#: Events that belong to one request or wait of a node (checked against node.req);
#: "tick" is checked against node.ticks; every other event is not tied to a token.
_REQUEST_EVENTS = frozenset(
    {
        "backend_read",
        "backend_cas",
        "backend_beat",
        "backend_watch",
        "response",
        "notify",
        "wake",
        "retry",
        "request_timeout",
    }
)
#: The largest backoff after lost compare-and-sets (StateSync's _MAX_BACKOFF).
_MAX_BACKOFF = 0.05


class _Node:
    """One node slot: a process that may crash and come back with a new pid."""

    __slots__ = (
        "after_exit",
        "alive",
        "deadline",
        "desc",
        "drift",
        "healed_at",
        "incarnation",
        "joined",
        "losses",
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
        "slot",
        "task",
        "ticks",
        "version",
        "view",
        "waiting",
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
        self.phase = _DOWN
        #: what this node knows (the driver's view) and the blob version it last
        #: read or wrote (its compare-and-set and watch token; 0: nothing read)
        self.view = NodeView()
        self.version = 0
        #: the task being driven (_OP, _BEAT, _MONITOR or None), its operator and
        #: its deadline (local time)
        self.task: str | None = None
        self.op: Operator | None = None
        self.deadline = math.inf
        #: the token of the request, wait or backoff in flight (events of older
        #: ones are dropped), whether it is a wait, the CAS losses in a row, and
        #: whether this process has created its heartbeat key
        self.req = 0
        self.waiting = False
        self.losses = 0
        self.registered = False
        #: training: the round joined, the timers (local times) and queued ticks
        self.joined: Membership | None = None
        self.ticks = 0
        self.next_beat = math.inf
        self.next_monitor = math.inf
        self.queued_beat = False
        self.queued_monitor = False
        #: after an exit: "join" (re-rendezvous) or "leave" (stay down a while)
        self.after_exit = "join"

    def local(self, t: float) -> float:
        return self.offset + (1.0 + self.drift) * t

    def global_time(self, local: float) -> float:
        return (local - self.offset) / (1.0 + self.drift)


def _key_bytes(node: NodeDesc) -> int:
    """Bytes of one side counter on the wire: its key and an 8-byte value."""
    return len(str(node)) + 8


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
        #: the backend: the blob, its version, and the side counter of every node
        self.version = 0
        self.state = RendezvousState()
        self.side: dict[NodeDesc, int] = {}
        self.size = EncodedSize(self.state)
        #: bytes of the side counters of the blob's heartbeat members
        self.counter_bytes = 0
        self.report = SimReport(config, stats=[NodeStats() for _ in range(config.nodes)])
        self.agreement = AgreementTracker()
        self._trace: deque[tuple[float, int, str]] = deque(maxlen=config.trace_length)
        self._on_violation = on_violation
        self._on_instruction = on_instruction
        self._watchers: set[int] = set()
        self._round_opened: dict[int, float] = {}
        self._round_pending: dict[int, set[NodeDesc]] = {}
        self._round_size: dict[int, int] = {}
        self.closed_by: NodeDesc | None = None
        rng = self.rng
        self.nodes = [
            _Node(
                i,
                rng.uniform(-config.clock_offset, config.clock_offset),
                rng.uniform(-config.drift, config.drift),
            )
            for i in range(config.nodes)
        ]
        self._handlers: dict[str, Callable[[_Node, Any], None]] = {
            name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_on_")
        }
        for node in self.nodes:
            self._at(rng.uniform(0.0, config.arrival_spread), "arrive", node.slot)
            self._schedule_faults(node)

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
        c = self.config
        for kind, rate in (
            ("crash", c.crash_rate),
            ("partition", c.partition_rate),
            ("leave", c.leave_rate),
        ):
            delay = self._exp(rate)
            if delay < c.duration:
                self._at(self.now + delay, f"fault_{kind}", node.slot)

    def _log(self, node: _Node | None, text: str) -> None:
        self._trace.append((self.now, -1 if node is None else node.slot, text))

    def _violate(self, problems: list[str]) -> None:
        trace = tuple(f"t={t:.6f} node {slot}: {text}" for t, slot, text in self._trace)
        violation = SimViolation(self.now, tuple(problems), trace)
        self.report.violations.append(violation)
        if self._on_violation is not None:
            self._on_violation(violation)

    # -- running ---------------------------------------------------------------

    def run(self) -> SimReport:
        """Run until ``duration`` (simulated seconds) and return the report."""
        import time

        start = time.perf_counter()
        self.run_until(self.config.duration)
        self.report.wall_seconds = time.perf_counter() - start
        return self.report

    def run_until(self, t: float) -> None:
        """Process every event up to simulated time ``t``."""
        heap = self._heap
        limit = self.config.max_steps
        requests = _REQUEST_EVENTS
        while heap and heap[0][0] <= t:
            when, _, kind, slot, token, data = heapq.heappop(heap)
            self.now = when
            self.report.events += 1
            node = self.nodes[slot]
            if token >= 0 and token != (node.req if kind in requests else node.ticks):
                continue  # of an earlier request, wait, incarnation or training session
            self._handlers[kind](node, data)
            if limit is not None and self.report.node_steps > limit:
                self._violate([f"more than {limit} node-steps: livelock?"])
                heap.clear()
                break
        self.now = max(self.now, t)
        self.report.simulated = self.now

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
        if not node.alive or node.phase not in (_TRAINING, _JOINING):
            return
        self.report.leaves += 1
        self._log(node, "leaves")
        deadline = node.local(self.now) + self.settings.close_timeout
        self._begin(node, ExitOp(), deadline, _EXITING, fresh=False)
        node.after_exit = "leave"
        self._drive(node)

    def arrive(self, slot: int) -> None:
        """Start node ``slot`` now if it is down (a new process joins)."""
        self._on_arrive(self.nodes[slot], None)

    def close(self, slot: int) -> None:
        """Node ``slot`` closes the rendezvous (the handler's ``shutdown()``)."""
        node = self.nodes[slot]
        if node.alive and node.phase in (_TRAINING, _JOINING):
            deadline = node.local(self.now) + self.settings.close_timeout
            self._begin(node, CloseOp(), deadline, _CLOSING, fresh=False)
            self._drive(node)

    # -- injection (the conformance tests) ---------------------------------------

    def inject_write(
        self, at: float, change: Callable[[RendezvousState], RendezvousState | None]
    ) -> None:
        """At simulated time ``at``, a writer that is not simulated replaces the
        stored blob with ``change(blob)`` (None: writes nothing). The write is
        committed like a node's: checked, versioned, and the watchers notified."""
        self._at(at, "inject", 0, -1, ("write", change))

    def inject_beat(self, at: float, node: NodeDesc) -> None:
        """At simulated time ``at``, bump the side heartbeat counter of ``node``
        (a node that is not simulated beats)."""
        self._at(at, "inject", 0, -1, ("beat", node))

    def _on_inject(self, _: _Node, data: Any) -> None:
        what, payload = data
        if what == "beat":
            self.side[payload] = self.side.get(payload, 0) + 1
            self._log(None, f"injected beat of {payload}")
            return
        old = self.state
        new = payload(old)
        if new is None:
            return
        touched = old.members() | new.members() | set(old.heartbeats) | set(new.heartbeats)
        self._log(None, "injected write")
        self._commit(None, new, tuple(touched))

    # -- lifecycle ---------------------------------------------------------------

    def _stop(self, node: _Node) -> None:
        node.alive = False
        node.phase = _DOWN
        self._cancel(node)
        node.ticks += 1
        node.task = None
        node.op = None
        node.joined = None
        node.queued_beat = node.queued_monitor = False

    def _cancel(self, node: _Node) -> None:
        """Forget the request, wait or backoff in flight (its events are dropped)."""
        node.req += 1
        node.waiting = False
        self._watchers.discard(node.slot)

    def _on_fault_crash(self, node: _Node, data: Any) -> None:
        self.crash(node.slot)
        delay = self._exp(self.config.crash_rate)
        if self.now + delay < self.config.duration:
            self._at(self.now + delay, "fault_crash", node.slot)

    def _on_fault_partition(self, node: _Node, data: Any) -> None:
        self.partition(node.slot, self.config.partition_duration)
        delay = self._exp(self.config.partition_rate) + self.config.partition_duration
        if self.now + delay < self.config.duration:
            self._at(self.now + delay, "fault_partition", node.slot)

    def _on_fault_leave(self, node: _Node, data: Any) -> None:
        self.leave(node.slot)
        delay = self._exp(self.config.leave_rate)
        if self.now + delay < self.config.duration:
            self._at(self.now + delay, "fault_leave", node.slot)

    def _on_heal(self, node: _Node, data: Any) -> None:
        self.heal(node.slot)

    def _on_arrive(self, node: _Node, data: Any) -> None:
        if node.alive or node.phase == _CLOSED:
            return
        node.alive = True
        if node.incarnation:
            node.desc = NodeDesc(node.desc.addr, 1000 + node.incarnation, 0)
        node.incarnation += 1
        node.view = NodeView()
        node.version = 0
        node.registered = False
        self._log(node, f"starts as {node.desc}")
        self._regroup(node)
        self._drive(node)

    def _begin(self, node: _Node, op: Operator, deadline: float, phase: str, fresh: bool) -> None:
        """Start an operation (StateSync.run): stop the heartbeats and whatever the
        node was doing; unless ``fresh``, the first decision reads."""
        self._cancel(node)
        node.ticks += 1
        node.queued_beat = node.queued_monitor = False
        node.task = _OP
        node.op = op
        node.deadline = deadline
        node.phase = phase
        node.losses = 0
        node.after_exit = "join"
        if not fresh:
            node.view = core_driver.after_wait(node.view)

    def _regroup(self, node: _Node) -> None:
        """The handler's next_rendezvous: exit the current round, then join."""
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ExitOp(), deadline, _JOINING, fresh=False)

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
            if node.task == _MONITOR:
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
            if isinstance(instruction, Read):
                self._request(node, "backend_read", instruction.counters)
                return
            if isinstance(instruction, Write):
                if instruction.action is not None or instruction.dead:
                    what = "publish" if instruction.action is None else instruction.action.name
                    self._log(node, f"{self._task_name(node)} -> {what}")
                self._request(node, "backend_cas", (node.version, instruction))
                return
            if isinstance(instruction, Beat):
                self._request(node, "backend_beat")
                return
            if isinstance(instruction, Wait):
                self._wait(node, instruction.until, now)
                return
            if isinstance(instruction, Done):
                if not self._done(node, instruction):
                    return
                continue
            assert isinstance(instruction, Verdict)
            if not self._verdict(node, instruction):
                return

    @staticmethod
    def _task_name(node: _Node) -> str:
        return "monitor" if node.task == _MONITOR else type(node.op).__name__

    def _request(self, node: _Node, kind: str, data: Any = None) -> None:
        node.req += 1
        if node.partitioned:
            self._at(self.now + self.config.request_timeout, "request_timeout", node.slot, node.req)
            return
        self._at(self.now + self._delay(), kind, node.slot, node.req, data)

    def _reply(self, node: _Node, data: Any) -> None:
        self._at(self.now + self._delay(), "response", node.slot, node.req, data)

    def _wait(self, node: _Node, until: float | None, now: float) -> None:
        """StateSync._wait: a watch on the version read, and a wake at ``until``
        (just past it) or after poll_interval, whichever comes first."""
        timeout = self.config.poll_interval
        if until is not None:
            timeout = min(timeout, max(0.0, until - now) + self.config.wake_epsilon)
        node.req += 1
        node.waiting = True
        self._at(node.global_time(now + timeout), "wake", node.slot, node.req)
        if not node.partitioned:
            self._at(self.now + self._delay(), "backend_watch", node.slot, node.req, node.version)

    def _end_wait(self, node: _Node) -> None:
        node.waiting = False
        node.req += 1  # drop the other of notification and wake
        self._watchers.discard(node.slot)
        node.view = core_driver.after_wait(node.view)

    # -- the backend -------------------------------------------------------------------

    def _on_backend_read(self, node: _Node, counters: bool) -> None:
        stats = self.report.stats[node.slot]
        blob = self.state
        size = self.size.value
        side = None
        if counters:
            values = self.side
            side = {n: values.get(n, 0) for n in blob.heartbeats}
            size += self.counter_bytes
        stats.reads += 1
        stats.bytes_read += size
        self._reply(node, ("read", blob, self.version, side))

    def _on_backend_cas(self, node: _Node, data: tuple[int, Write]) -> None:
        expected, write = data
        if expected != self.version or (
            self.config.conflict_rate and self.rng.random() < self.config.conflict_rate
        ):
            stats = self.report.stats[node.slot]
            stats.conflicts += 1
            stats.bytes_read += self.size.value
            self._reply(node, ("cas", False, self.state, self.version, write))
            return
        for gone in sorted(write.dead):  # sorted: the report is independent of hashing
            self._judge_death(node, gone)
        # The writer may be among the dead (its own counter stood still, e.g. while
        # it was partitioned): name each touched node once.
        touched = (node.desc, *(gone for gone in write.dead if gone != node.desc))
        self._commit(node, write.state, touched)
        self._reply(node, ("cas", True, self.state, self.version, write))

    def _on_backend_beat(self, node: _Node, data: Any) -> None:
        value = self.side.get(node.desc, 0) + 1
        self.side[node.desc] = value
        stats = self.report.stats[node.slot]
        size = _key_bytes(node.desc)
        stats.beats += 1
        stats.bytes_written += size
        stats.beat_bytes += size
        self._reply(node, ("beat", value))

    def _on_backend_watch(self, node: _Node, seen: int) -> None:
        if self.version != seen:
            self._at(self.now + self._delay(), "notify", node.slot, node.req)
        else:
            self._watchers.add(node.slot)

    def _commit(
        self, writer: _Node | None, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> None:
        old = self.state
        problems = check_state(new, self.settings) + check_transition(old, new)
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
        self._account_round(old, new)
        if problems:
            self._violate(problems)
        # Wake the waiting nodes (a watch); each is notified once per wait. A
        # partitioned one is notified after it reconnects (if it still waits).
        watchers = self._watchers
        if watchers:
            cut = []
            for slot in watchers:
                node = self.nodes[slot]
                if node.partitioned:
                    cut.append(slot)
                    continue
                self._at(self.now + self._delay(), "notify", slot, node.req)
            watchers.clear()
            watchers.update(cut)

    def _account_round(self, old: RendezvousState, new: RendezvousState) -> None:
        if new.participants and not new.complete and new.round not in self._round_opened:
            self._round_opened[new.round] = self.now
        if new.complete and not old.complete:
            self._round_pending[new.round] = set(new.participants)
            self._round_size[new.round] = new.world_size
        pending = self._round_pending.get(old.round)
        if pending is not None and len(new.participants) < len(old.participants):
            # Members that leave or die before returning no longer hold the round up.
            pending.intersection_update(new.participants if new.round == old.round else ())
            self._round_done(old.round)

    def _round_done(self, round_: int) -> None:
        pending = self._round_pending.get(round_)
        if pending is not None and not pending:
            del self._round_pending[round_]
            opened = self._round_opened.get(round_, self.now)
            self.report.rounds.append(RoundStat(round_, self._round_size[round_], opened, self.now))

    def _judge_death(self, observer: _Node, gone: NodeDesc) -> None:
        """Count a removal by a peer; a false one if the node was alive, reachable
        and heartbeating on schedule (DESIGN.md decision 2)."""
        self.report.deaths += 1
        self._log(observer, f"declares {gone} dead")
        for node in self.nodes:
            if node.desc == gone and node.alive and node.phase in (_JOINING, _TRAINING, _EXITING):
                grace = self.settings.liveness_window + self.config.request_timeout * 2
                if not node.partitioned and self.now - node.healed_at > grace:
                    self.report.false_deaths += 1
                    trace = tuple(f"t={t:.6f} node {slot}: {text}" for t, slot, text in self._trace)
                    problem = f"false death: {observer.desc} declared live {gone} dead"
                    self.report.false_death_log.append(SimViolation(self.now, (problem,), trace))

    # -- results coming back -------------------------------------------------------------

    def _on_response(self, node: _Node, data: Any) -> None:
        now = node.local(self.now)
        what = data[0]
        if what == "read":
            _, blob, version, side = data
            node.version = version
            node.view = core_driver.after_read(node.view, blob, side, now)
        elif what == "cas":
            _, won, stored, version, write = data
            node.version = version
            node.view = core_driver.after_write(node.view, won, stored, now)
            if not won:
                node.losses += 1
                # StateSync's jittered, capped exponential backoff before deciding again.
                cap = min(_MAX_BACKOFF, 0.001 * 2 ** min(node.losses, 16))
                self._at(self.now + self.rng.uniform(0, cap), "retry", node.slot, node.req)
                return
            node.losses = 0
            if write.deadline is not None and node.task == _OP:
                node.deadline = write.deadline
        else:  # a beat
            node.registered = True
            node.view = core_driver.after_beat(node.view, node.desc, data[1], now)
        self._drive(node)

    def _on_retry(self, node: _Node, data: Any) -> None:
        self._drive(node)

    def _on_notify(self, node: _Node, data: Any) -> None:
        if not node.waiting:
            return
        self.report.stats[node.slot].notifications += 1
        self._end_wait(node)
        self._drive(node)

    def _on_wake(self, node: _Node, data: Any) -> None:
        if not node.waiting:
            return
        self._end_wait(node)
        self._drive(node)

    def _on_request_timeout(self, node: _Node, data: Any) -> None:
        self.report.stats[node.slot].timeouts += 1
        self._log(node, "request timed out")
        if node.task == _OP:
            # An operation retries (StateSync within its retry window): read again.
            node.view = core_driver.after_wait(node.view)
            self._drive(node)
        elif self._idle(node):
            # A heartbeat or monitor pass gives up until its next tick.
            self._drive(node)

    # -- what the handler and the agent do with Done and Verdict -----------------------

    def _done(self, node: _Node, done: Done) -> bool:
        """Act on an operation's end; True: the node drives on (a next operation)."""
        if node.task == _BEAT:
            return self._idle(node)  # a failed keep-alive is only logged
        op, action = node.op, done.action
        if isinstance(op, ExitOp) and action is Action.FINISH:
            if node.after_exit == "leave":
                self._stop(node)
                self._at(self.now + self.config.restart_delay, "arrive", node.slot)
                return False
            # next_rendezvous: the join decides on the exit's view (fresh).
            self._begin(node, JoinOp(), node.deadline, _JOINING, fresh=True)
            return True
        if isinstance(op, JoinOp) and action is Action.FINISH:
            if done.rejoin:
                self._log(node, f"round {done.state.round} lost its rank 0: rejoins")
                self._begin(node, ExitOp(), node.deadline, _JOINING, fresh=False)
                return True
            assert done.joined is not None
            self._joined(node, done.joined)
            return False
        self._log(node, f"{type(op).__name__} -> {action.name}")
        if (action is Action.FINISH and isinstance(op, CloseOp)) or action in (
            Action.ERROR_CLOSED,
            Action.ERROR_GRACEFUL_EXIT,
        ):
            self.closed_by = self.closed_by or node.desc
            self._stop(node)
            node.phase = _CLOSED
            return False
        # ERROR_TIMEOUT: the agent gives up on this attempt and starts over.
        self.report.timeouts += 1
        self._stop(node)
        self._at(self.now + self.config.restart_delay, "arrive", node.slot)
        return False

    def _joined(self, node: _Node, joined: Membership) -> None:
        """The join returned: check agreement, then train (heartbeats and monitor)."""
        self._log(node, f"joined round {joined.round} as rank {joined.rank}")
        result = RoundResult(joined.round, joined.rank, joined.world_size, joined.members)
        problems = self.agreement.add(node.desc, result)
        if problems:
            self._violate(problems)
        pending = self._round_pending.get(joined.round)
        if pending is not None:
            pending.discard(node.desc)
            self._round_done(joined.round)
        node.phase = _TRAINING
        node.joined = joined
        node.task = None
        node.op = None
        node.ticks += 1
        now = node.local(self.now)
        node.next_beat = now + self.settings.keep_alive_interval / 4
        node.next_monitor = now + self.config.monitor_interval
        self._schedule_tick(node)

    def _verdict(self, node: _Node, verdict: Verdict) -> bool:
        """The agent's monitor: regroup on waiting nodes or lost participants."""
        if verdict.waiting or verdict.lost:
            reason = "peer lost" if verdict.lost else "nodes waiting"
            self._log(node, f"re-rendezvous: {reason}")
            self._regroup(node)
            return True
        return self._idle(node)

    # -- training: heartbeats and the agent's monitor -----------------------------

    def _schedule_tick(self, node: _Node) -> None:
        due = min(node.next_beat, node.next_monitor)
        self._at(node.global_time(due), "tick", node.slot, node.ticks, due)

    def _on_tick(self, node: _Node, due: float) -> None:
        if node.next_beat <= due:
            node.queued_beat = True
            node.next_beat += self.settings.keep_alive_interval / 4
        if node.next_monitor <= due:
            node.queued_monitor = True
            node.next_monitor += self.config.monitor_interval
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
            node.task = _BEAT
            node.op = KeepAliveOp()
            node.deadline = node.local(self.now) + self.settings.heartbeat_timeout
            node.losses = 0
            return True
        if node.queued_monitor:
            # The agent's num_nodes_waiting / dead_participants: a read with the
            # counters (the sync engine's refresh), then the driver's monitor.
            node.queued_monitor = False
            node.task = _MONITOR
            node.losses = 0
            self._request(node, "backend_read", True)
        return False


def simulate(config: SimConfig) -> SimReport:
    """Run one simulation and return its report."""
    return Simulator(config).run()
