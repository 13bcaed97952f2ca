"""The simulator's event machinery: one heap of events ordered by simulated time
and a sequence number, the random numbers, the trace of the last events, and the
loop that hands each event to its handler (:class:`EventLoop`, one of the parts
:class:`rallypoint.spec.simulator.Simulator` wires together)."""

from __future__ import annotations

import gc
import heapq
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from .config import SimConfig
from .node import SimNode
from .report import SimReport, SimViolation

__all__ = ["EventLoop"]


#: Events that belong to one request, wait or backoff of a node (checked against
#: node.req); the phase watch's events are checked against node.wtok, "tick"
#: against node.ticks; every other event is not tied to a token.
_REQUEST_EVENTS = frozenset(
    {
        "backend_request",
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
    """The clock, the event heap, the random numbers and the trace of one run.

    Every other part of the simulator schedules its events here (:meth:`at`) and
    registers the handler of each kind of event it owns (:meth:`on`); the loop
    hands each event to its handler with the node slot it concerns, and drops the
    events of a request, wait, watch or training session the node has moved past.
    Violations found by any part go to the run's report (:meth:`violate`).

    Args:
        config: the run's options (its seed seeds :attr:`rng`).
        report: the report of the run, which the loop fills in as it goes.
        on_violation: called with every violation as it is found.
    """

    def __init__(
        self,
        config: SimConfig,
        report: SimReport,
        on_violation: Callable[[SimViolation], None] | None = None,
    ) -> None:
        self.config = config
        self.report = report
        #: every random choice of the run, in the order the parts make them
        self.rng = random.Random(config.seed)
        self.now = 0.0
        #: the node slots (set once they are made, before the run starts)
        self.nodes: list[SimNode] = []
        self._heap: list[tuple[float, int, str, int, int, Any]] = []
        self._seq = 0
        self._handlers: dict[str, Callable[[SimNode, Any], None]] = {}
        self._trace: deque[tuple[float, int, str]] = deque(maxlen=config.trace_length)
        self._on_violation = on_violation

    def on(self, kind: str, handler: Callable[[SimNode, Any], None]) -> None:
        """Hand every event of ``kind`` to ``handler(node, data)``."""
        if kind in self._handlers:
            raise ValueError(f"two handlers for the simulator's event {kind!r}")
        self._handlers[kind] = handler

    # -- event plumbing ----------------------------------------------------------

    def at(self, t: float, kind: str, slot: int, token: int = -1, data: Any = None) -> None:
        """Schedule an event of ``kind`` for node ``slot`` at simulated time ``t``
        (``token``: the node's request, watch or tick token it belongs to; -1: none)."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, slot, token, data))

    def delay(self) -> float:
        """One way through the network: ``latency`` +- ``jitter``."""
        c = self.config
        return c.latency + self.rng.uniform(-c.jitter, c.jitter) if c.latency else 0.0

    def log(self, node: SimNode | None, text: str) -> None:
        """Add ``text`` to the trace of the last events (None: no node's)."""
        self._trace.append((self.now, -1 if node is None else node.slot, text))

    def finding(self, problems: list[str]) -> SimViolation:
        """``problems`` found now, with the last events as their trace."""
        trace = tuple(f"t={t:.6f} node {slot}: {text}" for t, slot, text in self._trace)
        return SimViolation(self.now, tuple(problems), trace)

    def violate(self, problems: list[str]) -> None:
        """Report ``problems`` found now as a violation."""
        violation = self.finding(problems)
        self.report.violations.append(violation)
        if self._on_violation is not None:
            self._on_violation(violation)

    # -- running ---------------------------------------------------------------

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
                self.violate([f"more than {limit} node-steps: livelock?"])
                heap.clear()
                break
        self.now = max(self.now, t)
        report.simulated = self.now
