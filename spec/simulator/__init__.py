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
  ``driver.decide`` (or ``driver.watch``) for the next instruction, carries it
  out against the simulated backend through the production executors' dispatch
  (:mod:`rallypoint.core.dispatch`), and feeds the result back with the
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
  ``keep_alive_period`` (a quarter keep-alive interval) of its own clock it runs
  the keep-alive operator on its current view without re-reading (usually Done
  or a Beat at once); and the agent's monitor loop waits for a phase above its view's (the handler's
  ``wait_for_change``) or ``monitor_interval``, whichever comes first, then reads
  the state with the counters and runs ``driver.watch`` until a Verdict, and
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
* **Live regroup's newcomers** (``newcomer_startup``): a node's new workers (a
  failure's replacements, a starting process's) are ready that long after they
  start; the node asks the core's admission rule (``core.newcomers.admission``,
  looked up at call time) and is out of the rendezvous meanwhile (a leave that
  keeps its process, or not yet in) or in it, and joins once they are ready. The
  checks: no round completes waiting for a start-up the others could have trained
  through, and a node out with ready newcomers joins.

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

This module puts the simulator together. :class:`Simulator` is composed of
collaborating parts, each a module of its own, not a chain of classes:

* :class:`.events.EventLoop` -- the clock, the event heap, the random numbers
  and the trace; every other part schedules its events there and registers the
  handlers of the events it owns;
* :class:`.checks.Checks` -- invariants of each committed write, agreement of
  returned joins, false and unfenced deaths, the rounds' timings;
* :class:`.backend.Backend` -- the stored state, the side counters, the
  intent logs, the phase watches, the requests it serves, and the injection;
* :class:`.agent.SimAgent` -- one per node slot (:class:`.node.SimNode`):
  what the handler and the agent do, and the loop that steps the node's core;
* :class:`.executor.SimExecutor` -- one per agent: carries the node's
  instructions out through :mod:`rallypoint.core.dispatch`, as StateSync does,
  each request an event the backend serves;
* :class:`.faults.FaultInjector` -- the faults, at their rates or on call.

:mod:`.config` holds the options and :mod:`.report` the report. Their
public names are imported from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...core import NodeDesc, NodeInstruction, RendezvousState
from ...core.codec import EncodedSize
from .agent import AGENT_EVENTS, SimAgent
from .backend import Backend, StateChange
from .checks import Checks
from .config import SimConfig, SimConfigError
from .events import EventLoop
from .executor import EXECUTOR_EVENTS
from .faults import FaultInjector
from .node import SimNode, Task
from .report import JoinReturn, NodeStats, RoundStat, SimReport, SimViolation

__all__ = [
    "JoinReturn",
    "NodeStats",
    "RoundStat",
    "SimConfig",
    "SimConfigError",
    "SimReport",
    "SimViolation",
    "Simulator",
    "Task",
    "simulate",
]


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
        on_instruction: Callable[[int, NodeInstruction], None] | None = None,
    ) -> None:
        self.config = config
        self.settings = config.settings()
        #: the run's report, filled in as it runs
        self.report = SimReport(config, stats=[NodeStats() for _ in range(config.nodes)])
        self.loop = EventLoop(config, self.report, on_violation)
        initial = RendezvousState()
        #: the node of each current process (the agents enter restarted ones)
        by_desc: dict[NodeDesc, SimNode] = {}
        self.checks = Checks(self.loop, self.settings, initial, by_desc)
        self.backend = Backend(self.loop, self.checks, initial)
        #: the node slots, and the agent of each
        self.nodes = self._slots()
        self.loop.nodes = self.nodes
        by_desc.update((node.desc, node) for node in self.nodes)
        self.agents = [
            SimAgent(
                node, self.loop, self.backend, self.checks, self.settings, by_desc, on_instruction
            )
            for node in self.nodes
        ]
        for kind in AGENT_EVENTS:
            self.loop.on(kind, self._to_slot(kind, self.agents))
        executors = [agent.executor for agent in self.agents]
        for kind in EXECUTOR_EVENTS:
            self.loop.on(kind, self._to_slot(kind, executors))
        self.faults = FaultInjector(self.loop, self.agents, self.settings)
        # The random numbers are drawn in one order (every slot's clock, then each
        # slot's arrival and first faults), so that a seed replays a run exactly.
        for node in self.nodes:
            self.loop.at(self.loop.rng.uniform(0.0, config.arrival_spread), "arrive", node.slot)
            self.faults.schedule_faults(node)

    def _slots(self) -> list[SimNode]:
        """The node slots, each with its clock."""
        c, rng = self.config, self.loop.rng
        return [
            SimNode(
                i,
                rng.uniform(-c.clock_offset, c.clock_offset),
                rng.uniform(-c.drift, c.drift),
                self.settings,
            )
            for i in range(c.nodes)
        ]

    @staticmethod
    def _to_slot(kind: str, parts: list[Any]) -> Callable[[SimNode, Any], None]:
        """The handler of an event of ``kind``: the method ``on_<kind>`` of the
        part (agent or executor) of the event's node slot."""
        handlers = [getattr(part, f"on_{kind}") for part in parts]

        def handle(node: SimNode, data: Any) -> None:
            handlers[node.slot](data)

        return handle

    # -- running -----------------------------------------------------------------

    @property
    def now(self) -> float:
        """The simulated time (seconds since the run started)."""
        return self.loop.now

    @property
    def state(self) -> RendezvousState:
        """The state stored on the simulated backend."""
        return self.backend.state

    @property
    def size(self) -> EncodedSize:
        """The stored state's encoded size, kept incrementally."""
        return self.backend.size

    def run(self) -> SimReport:
        """Run until ``duration`` (simulated seconds) and return the report."""
        start = time.perf_counter()
        self.run_until(self.config.duration)
        self.report.wall_seconds = time.perf_counter() - start
        return self.report

    def run_until(self, t: float) -> None:
        """Process every event up to simulated time ``t``."""
        self.loop.run_until(t)
        self.report.restarts = self.backend.state.restarts
        self.report.closed = self.backend.state.closed

    # -- faults (the hypothesis machines call them) --------------------------------

    def crash(self, slot: int) -> None:
        """Kill node ``slot``'s process now; it restarts after ``restart_delay``."""
        self.faults.crash(slot)

    def partition(self, slot: int, duration: float | None = None) -> None:
        """Cut node ``slot`` off the backend (for ``duration``, or until healed)."""
        self.faults.partition(slot, duration)

    def heal(self, slot: int) -> None:
        """Reconnect node ``slot`` to the backend."""
        self.faults.heal(slot)

    def leave(self, slot: int) -> None:
        """Node ``slot`` leaves gracefully (see :meth:`.FaultInjector.leave`)."""
        self.faults.leave(slot)

    def fail_workers(self, slot: int) -> None:
        """The workers of node ``slot`` fail while it trains (see
        :meth:`.FaultInjector.fail_workers`)."""
        self.faults.fail_workers(slot)

    def fail_health_check(self, slot: int) -> None:
        """Node ``slot`` fails its health check (see
        :meth:`.FaultInjector.fail_health_check`)."""
        self.faults.fail_health_check(slot)

    def arrive(self, slot: int) -> None:
        """Start node ``slot`` now if it is down (a new process joins)."""
        self.faults.arrive(slot)

    def close(self, slot: int) -> None:
        """Node ``slot`` closes the rendezvous (the handler's ``shutdown()``)."""
        self.faults.close(slot)

    # -- injection (the conformance tests) ---------------------------------------

    def inject_write(self, at: float, change: StateChange, *, race: bool = False) -> None:
        """See :meth:`.Backend.inject_write`."""
        self.backend.inject_write(at, change, race=race)

    def inject_beat(self, at: float, node: NodeDesc) -> None:
        """See :meth:`.Backend.inject_beat`."""
        self.backend.inject_beat(at, node)

    def inject_announce(self, at: float, node: NodeDesc, round_: int) -> None:
        """See :meth:`.Backend.inject_announce`."""
        self.backend.inject_announce(at, node, round_)


def simulate(config: SimConfig) -> SimReport:
    """Run one simulation and return its report."""
    return Simulator(config).run()
