"""A deterministic discrete-event simulator of many rendezvous nodes.

TigerBeetle's VOPR is the model: the clock, the network and the backend are stubs,
every fault is an option with a probability, and a seed replays a run exactly. No
threads, no sockets, no real time: one event heap (``heapq``) ordered by simulated
time and a sequence number, and one ``random.Random(seed)`` for every choice.

What is simulated:

* **Nodes** drive the real core exactly as an adapter does (see
  :mod:`rallypoint.core`): read the state, ``observe``, ``sanitize``, ask an
  operator, ``apply``, compare-and-set; on a lost race decide again on the state
  the backend returned; after a SYNC wait for a watch notification or until
  ``wake_at``. A node whose join returned trains: it heartbeats every keep-alive
  interval and checks every ``monitor_interval`` whether nodes are waiting or a peer
  was lost, and then re-rendezvous (exit, then join), as the elastic agent does.
* **Clocks**: each node's monotonic clock is ``offset + (1 + drift) * t``; the core
  only ever sees the node's own clock.
* **Backend**: one in-memory compare-and-set register with a version, request and
  response latency (``latency`` +- ``jitter`` each way), spurious CAS conflicts
  (``conflict_rate``) and watch notifications to waiting nodes (coalesced: a node
  with a notification in flight is not sent another).
* **Faults**: crashes (``crash_rate`` per node per minute) with a restart after
  ``restart_delay`` as a new process (new pid); partitions from the backend
  (``partition_rate`` per node per minute, ``partition_duration``): requests are
  lost and time out after ``request_timeout``; graceful leaves (``leave_rate``)
  with a rejoin after ``restart_delay``.

Every committed write is checked with :func:`check_state` and
:func:`check_transition`; every returned join with an :class:`AgreementTracker`
(the incremental form of :func:`check_agreement`). A *false death* is a node
removed by a peer's sanitize while it was alive, reachable and heartbeating.
Violations carry the last events as a trace.

Bytes are counted as the size of the state's encoded form (:func:`encode_state`)
on every read and write. Encoding 1,000 nodes' state takes milliseconds, so the
size is kept incrementally instead: per entry, from the codec's own entry layout,
updated only for the entries a write touched (:class:`EncodedSize`); a test checks
it against ``len(encode_state(state))``.
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
    CloseOp,
    Context,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    NodeDesc,
    Observations,
    Operator,
    RendezvousState,
    Settings,
    apply,
    encode_state,
    observe,
    sanitize,
    wake_at,
)

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
        touched = tuple(touched)
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
    bytes_read: int = 0
    bytes_written: int = 0


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
            ("watch notifications per node", f"{t.notifications / n:.1f}"),
            ("bytes read per node", f"{t.bytes_read / n:,.0f}"),
            ("bytes written per node", f"{t.bytes_written / n:,.0f}"),
            ("bytes per write", f"{t.bytes_written / max(1, t.writes):,.0f}"),
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


class _Node:
    """One node slot: a process that may crash and come back with a new pid."""

    __slots__ = (
        "after_exit",
        "alive",
        "cached",
        "deadline",
        "desc",
        "drift",
        "healed_at",
        "incarnation",
        "inflight",
        "notify_pending",
        "obs",
        "offset",
        "op",
        "partitioned",
        "phase",
        "result",
        "slot",
        "subscribed",
        "token",
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
        self.op: Operator | None = None
        self.deadline = math.inf
        self.obs = Observations()
        self.cached: tuple[int, RendezvousState] | None = None
        self.inflight = False
        self.subscribed = False
        self.notify_pending = False
        self.token = 0
        self.result: RoundResult | None = None
        self.after_exit = "join"

    def local(self, t: float) -> float:
        return self.offset + (1.0 + self.drift) * t

    def global_time(self, local: float) -> float:
        return (local - self.offset) / (1.0 + self.drift)


class Simulator:
    """One deterministic run. Drive it with :meth:`run`, or step by step with
    :meth:`run_until` and the fault methods (the hypothesis machines do)."""

    def __init__(
        self, config: SimConfig, on_violation: Callable[[SimViolation], None] | None = None
    ) -> None:
        self.config = config
        self.settings = config.settings()
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, int, int, Any]] = []
        self._seq = 0
        self.version = 0
        self.state = RendezvousState()
        self.size = EncodedSize(self.state)
        self.report = SimReport(config, stats=[NodeStats() for _ in range(config.nodes)])
        self.agreement = AgreementTracker()
        self._trace: deque[tuple[float, int, str]] = deque(maxlen=config.trace_length)
        self._on_violation = on_violation
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

    def _after(self, node: _Node, local_delay: float, kind: str, data: Any = None) -> None:
        """Schedule ``kind`` after ``local_delay`` seconds of the node's own clock."""
        self._at(
            node.global_time(node.local(self.now) + local_delay), kind, node.slot, node.token, data
        )

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

    def _log(self, node: _Node, text: str) -> None:
        self._trace.append((self.now, node.slot, text))

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
        while heap and heap[0][0] <= t:
            when, _, kind, slot, token, data = heapq.heappop(heap)
            self.now = when
            self.report.events += 1
            node = self.nodes[slot]
            if token >= 0 and token != node.token:
                continue  # a timer or response of an earlier incarnation or operation
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
        """Node ``slot`` leaves gracefully (exit), and rejoins after ``restart_delay``."""
        node = self.nodes[slot]
        if not node.alive or node.phase not in (_TRAINING, _JOINING):
            return
        self.report.leaves += 1
        self._log(node, "leaves")
        node.after_exit = "leave"
        self._start(node, ExitOp(), self.settings.close_timeout, _EXITING)

    def arrive(self, slot: int) -> None:
        """Start node ``slot`` now if it is down (a new process joins)."""
        self._on_arrive(self.nodes[slot], None)

    def close(self, slot: int) -> None:
        """Node ``slot`` closes the rendezvous (the job is over)."""
        node = self.nodes[slot]
        if node.alive and node.phase in (_TRAINING, _JOINING):
            self._start(node, CloseOp(), self.settings.close_timeout, _CLOSING)

    def _stop(self, node: _Node) -> None:
        node.alive = False
        node.phase = _DOWN
        node.token += 1
        node.op = None
        node.inflight = False
        node.subscribed = False
        node.notify_pending = False
        node.result = None
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
        node.token += 1
        if node.incarnation:
            node.desc = NodeDesc(node.desc.addr, 1000 + node.incarnation, 0)
        node.incarnation += 1
        node.obs = Observations()
        node.cached = None
        self._log(node, f"starts as {node.desc}")
        self._start(node, JoinOp(), self.settings.join_timeout, _JOINING)

    # -- the driving loop ------------------------------------------------------

    def _start(self, node: _Node, op: Operator, timeout: float, phase: str) -> None:
        """Begin an operation: read the state first (a sync), then step."""
        node.token += 1
        node.op = op
        node.phase = phase
        node.deadline = node.local(self.now) + timeout
        node.inflight = False
        node.subscribed = False
        self._watchers.discard(node.slot)
        self._read(node)

    def _send(self, node: _Node, kind: str, data: Any = None) -> None:
        node.inflight = True
        if node.partitioned:
            self._after(node, self.config.request_timeout, "request_timeout")
            return
        self._at(self.now + self._delay(), kind, node.slot, node.token, data)

    def _read(self, node: _Node) -> None:
        self._send(node, "backend_read")

    def _on_backend_read(self, node: _Node, data: Any) -> None:
        self._at(
            self.now + self._delay(),
            "response",
            node.slot,
            node.token,
            ("read", self.version, self.state, self.size.value),
        )

    def _on_backend_cas(self, node: _Node, data: Any) -> None:
        expected, new, dead = data
        if expected != self.version or (
            self.config.conflict_rate and self.rng.random() < self.config.conflict_rate
        ):
            reply = ("conflict", self.version, self.state, self.size.value)
        else:
            for gone in dead:
                self._judge_death(node, gone)
            self._commit(node, new, (node.desc, *dead))
            reply = ("ok", self.version, self.state, self.size.value)
        self._at(self.now + self._delay(), "response", node.slot, node.token, reply)

    def _on_request_timeout(self, node: _Node, data: Any) -> None:
        node.inflight = False
        self.report.stats[node.slot].timeouts += 1
        self._log(node, "request timed out")
        self._read(node)

    def _on_response(self, node: _Node, data: Any) -> None:
        what, version, state, size = data
        node.inflight = False
        stats = self.report.stats[node.slot]
        if what == "read":
            stats.reads += 1
            stats.bytes_read += size
        elif what == "conflict":
            stats.conflicts += 1
            stats.bytes_read += size
        node.cached = (version, state)
        if what == "ok":
            node.obs = observe(node.obs, state, node.local(self.now))
        if node.phase == _TRAINING:
            self._monitor(node)
        else:
            self._step(node)

    def _on_notify(self, node: _Node, data: Any) -> None:
        node.notify_pending = False
        if not node.subscribed or node.inflight:
            return
        stats = self.report.stats[node.slot]
        stats.notifications += 1
        stats.bytes_read += self.size.value
        node.subscribed = False
        self._watchers.discard(node.slot)
        node.cached = (self.version, self.state)
        self._step(node)

    def _on_wake(self, node: _Node, data: Any) -> None:
        if not node.subscribed or node.inflight:
            return
        node.subscribed = False
        self._watchers.discard(node.slot)
        if data == "poll":
            self._read(node)
        else:
            self._step(node)

    def _commit(self, writer: _Node, new: RendezvousState, touched: tuple[NodeDesc, ...]) -> None:
        old = self.state
        problems = check_state(new, self.settings) + check_transition(old, new)
        self.version += 1
        self.state = new
        size = self.size.update(new, touched)
        if self.config.verify_bytes and size != len(encode_state(new)):
            problems.append(f"incremental size {size} != encoded size {len(encode_state(new))}")
        stats = self.report.stats[writer.slot]
        stats.writes += 1
        stats.bytes_written += size
        self._account_round(old, new)
        if problems:
            self._violate(problems)
        # Wake the waiting nodes (a watch). A node with a notification in flight is
        # not in the set: it reads the latest state when that one arrives.
        watchers = self._watchers
        if watchers:
            cut = []
            for slot in watchers:
                node = self.nodes[slot]
                if node.partitioned:
                    cut.append(slot)
                    continue
                node.notify_pending = True
                self._at(self.now + self._delay(), "notify", slot, node.token)
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

    def _step(self, node: _Node) -> None:
        """One iteration of the driving loop on the node's cached state."""
        assert node.cached is not None and node.op is not None
        report = self.report
        report.node_steps += 1
        self.report.stats[node.slot].steps += 1
        version, state = node.cached
        now = node.local(self.now)
        settings = self.settings
        node.obs = obs = observe(node.obs, state, now)
        sanitized, dead = sanitize(state, obs, settings, now)
        ctx = Context(node.desc, sanitized, settings, now, obs)
        action = node.op(ctx, node.deadline)
        if action.changes_state:
            new = apply(sanitized, action, ctx)
            if action.resets_deadline:
                node.deadline = now + settings.join_timeout
            self._log(node, f"{type(node.op).__name__} -> {action.name}")
            self._write(node, version, new, dead)
            return
        if dead:
            self._write(node, version, sanitized, dead)
            return
        if action is Action.SYNC:
            self._wait(node, ctx)
        else:
            self._log(node, f"{type(node.op).__name__} -> {action.name}")
            self._finish(node, action, sanitized)

    def _write(
        self, node: _Node, version: int, new: RendezvousState, dead: frozenset[NodeDesc]
    ) -> None:
        self._send(node, "backend_cas", (version, new, dead))

    def _judge_death(self, observer: _Node, gone: NodeDesc) -> None:
        """Count a removal by sanitize; a false one if the node was alive, reachable
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

    def _wait(self, node: _Node, ctx: Context) -> None:
        node.subscribed = True
        if not node.notify_pending:
            self._watchers.add(node.slot)
        local_now = ctx.now
        wake = wake_at(ctx, node.deadline)
        poll = local_now + self.config.poll_interval
        if wake is not None and wake < poll:
            # Decisions flip strictly after wake_at: wake just past it.
            self._at(node.global_time(wake) + 1e-6, "wake", node.slot, node.token, "step")
        else:
            self._at(node.global_time(poll), "wake", node.slot, node.token, "poll")

    def _finish(self, node: _Node, action: Action, state: RendezvousState) -> None:
        op = node.op
        node.op = None
        if action is Action.FINISH and isinstance(op, JoinOp):
            rank = state.participants[node.desc]
            result = RoundResult(state.round, rank, state.world_size, frozenset(state.participants))
            node.result = result
            problems = self.agreement.add(node.desc, result)
            if problems:
                self._violate(problems)
            pending = self._round_pending.get(state.round)
            if pending is not None:
                pending.discard(node.desc)
                self._round_done(state.round)
            node.phase = _TRAINING
            node.token += 1
            self._after(node, self.settings.keep_alive_interval, "heartbeat")
            self._after(node, self.config.monitor_interval, "monitor_tick")
            return
        if action is Action.FINISH and isinstance(op, ExitOp):
            node.result = None
            if node.after_exit == "leave":
                node.after_exit = "join"
                self._stop(node)
                self._at(self.now + self.config.restart_delay, "arrive", node.slot)
            else:
                self._start(node, JoinOp(), self.settings.join_timeout, _JOINING)
            return
        if action is Action.FINISH and isinstance(op, KeepAliveOp):
            node.phase = _TRAINING
            self._after(node, self.settings.keep_alive_interval, "heartbeat")
            return
        if (action is Action.FINISH and isinstance(op, CloseOp)) or action in (
            Action.ERROR_CLOSED,
            Action.ERROR_GRACEFUL_EXIT,
        ):
            self.closed_by = self.closed_by or node.desc
            self._stop(node)
            node.phase = _CLOSED
            return
        # ERROR_TIMEOUT: the agent gives up on this attempt and starts over.
        self.report.timeouts += 1
        self._stop(node)
        self._at(self.now + self.config.restart_delay, "arrive", node.slot)

    # -- training: heartbeats and the agent's monitor -----------------------------

    def _on_heartbeat(self, node: _Node, data: Any) -> None:
        if node.phase != _TRAINING:
            return
        if node.inflight or node.op is not None:
            # Busy with the monitor's read: beat right after it, not an interval late.
            self._after(node, 4 * self.config.latency + 1e-3, "heartbeat")
            return
        node.op = KeepAliveOp()
        node.deadline = node.local(self.now) + self.settings.heartbeat_timeout
        node.phase = _TRAINING
        self._read(node)

    def _on_monitor_tick(self, node: _Node, data: Any) -> None:
        if node.phase == _TRAINING and not node.inflight and node.op is None:
            self._read(node)
        self._after(node, self.config.monitor_interval, "monitor_tick")

    def _monitor(self, node: _Node) -> None:
        """A training node read the state: keep alive if asked, else check whether
        it must re-rendezvous (nodes waiting, or a peer of its round gone)."""
        if node.op is not None:
            self._step(node)
            return
        assert node.cached is not None and node.result is not None
        self.report.node_steps += 1
        self.report.stats[node.slot].steps += 1
        version, state = node.cached
        now = node.local(self.now)
        node.obs = observe(node.obs, state, now)
        sanitized, dead = sanitize(state, node.obs, self.settings, now)
        if dead:
            self._send(node, "backend_cas", (version, sanitized, dead))
            return
        mine = node.result
        lost = (
            node.desc not in sanitized.participants
            or sanitized.round != mine.round
            or len(sanitized.participants) < mine.world_size
        )
        if sanitized.wait_list or lost:
            self._log(node, "re-rendezvous: " + ("peer lost" if lost else "nodes waiting"))
            node.after_exit = "join"
            self._start(node, ExitOp(), self.settings.close_timeout, _EXITING)


def simulate(config: SimConfig) -> SimReport:
    """Run one simulation and return its report."""
    return Simulator(config).run()
