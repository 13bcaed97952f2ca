"""The simulator's event machinery: one heap of events ordered by simulated time
and a sequence number, the random numbers, the trace of the last events, and the
loop that hands each event to its handler (:class:`EventLoop`, the base of
:class:`rallypoint.spec.simulator.Simulator`)."""

from __future__ import annotations

import gc
import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core import NodeDesc, NodeInstruction, RendezvousState
from .sim_config import SimConfig
from .sim_node import SimNode
from .sim_report import NodeStats, SimReport, SimViolation

__all__ = ["EventLoop"]


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


class EventLoop:
    """The clock, the event heap, the report and the stored state of one run.

    The parts of the simulator (:mod:`.sim_checks`, :mod:`.sim_backend`,
    :mod:`.sim_agent`, :mod:`.sim_executor`, :mod:`.sim_faults`) build on it, each a
    class of its own in that order; :class:`rallypoint.spec.simulator.Simulator`
    puts them together. Every event is handled by the method ``_on_<kind>``. Each
    part sets up its own state in :meth:`_setup`, which ``__init__`` calls last;
    the arguments are :class:`~rallypoint.spec.simulator.Simulator`'s.
    """

    #: the node slots, by slot and by their current process (set by the Simulator)
    nodes: list[SimNode]
    _by_desc: dict[NodeDesc, SimNode]
    #: the handler of each kind of event (``_on_<kind>``)
    _handlers: dict[str, Callable[[SimNode, Any], None]]

    def __init__(
        self,
        config: SimConfig,
        on_violation: Callable[[SimViolation], None] | None = None,
        on_instruction: Callable[[int, NodeInstruction], None] | None = None,
    ) -> None:
        self.config = config
        self.settings = config.settings()
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, int, int, Any]] = []
        self._seq = 0
        #: the backend's state and its version (the rest of the backend:
        #: :class:`.sim_backend.Backend`)
        self.version = 0
        self.state = RendezvousState()
        self.report = SimReport(config, stats=[NodeStats() for _ in range(config.nodes)])
        self._trace: deque[tuple[float, int, str]] = deque(maxlen=config.trace_length)
        self._on_violation = on_violation
        self._on_instruction = on_instruction
        self._setup()

    def _setup(self) -> None:
        """Set up the state of each part, base first (each part's ``_setup`` calls
        its base's, then sets up its own)."""

    # -- event plumbing ----------------------------------------------------------

    def _at(self, t: float, kind: str, slot: int, token: int = -1, data: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, slot, token, data))

    def _delay(self) -> float:
        c = self.config
        return c.latency + self.rng.uniform(-c.jitter, c.jitter) if c.latency else 0.0

    def _log(self, node: SimNode | None, text: str) -> None:
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
