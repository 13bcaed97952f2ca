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

In every reachable state the checker verifies :mod:`rallypoint.spec.model.invariants`
(state, step, removal, admission and agreement properties), that every node's
lifecycle change is an edge of the :mod:`rallypoint.spec.model.machine` whose guards hold
(conformance), and that no write leaves a waiter asleep: a write that publishes no
new phase leaves the decision of every node waiting on the state as it was (see
:meth:`StepProperties.missed_wakeups`).

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
  :func:`rallypoint.spec.model.invariants.check_return`).
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
  had lost one since its last wait (see :meth:`Steps.expand`).
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
  restarts and stays idle acts as one that never came back. So are workers'
  failures (``max_failures``: a training node charges the restart budget for its
  round, ``ChargeRestartOp``) and self-exclusions (``max_exclusions``:
  ``ExcludeOp``); both are off by default, and the search is then the one without
  them, state for state.

* **Finished nodes and forgotten crashes.** Every terminal phase is stored as
  ``closed`` (no terminal node steps again, and every check maps it to a
  lifecycle state that never changes), and a slot whose crashed process is named
  nowhere any more is stored under its first pid (the renaming keeps every order
  the core compares).
* **Checked once.** A checked event (a ``Wait``, a ``Beat``, or a timer choice
  whose outcome a stored event has too) is checked in the first state with its
  shared state, intent log and node-local state: what its checks read beyond
  those is read alike by a stored event, which is checked in every state.

All of these are argued in docs/spec.md, and tests/spec/test_reductions.py
compares each new one with the search without it.

Visited states are kept as 64-bit fingerprints (as TLC does), with a parent pointer,
so a violation is replayed from the initial state into a readable trace.

The checker's parts, one module each:

* :mod:`~rallypoint.spec.check.state` -- the config, states, events and result;
* :mod:`~rallypoint.spec.check.steps` -- the step rules: events, timer choices,
  successors (the driver's part in :mod:`~rallypoint.spec.check.core_steps`, conformance
  in :mod:`~rallypoint.spec.check.conformance`, wake-ups and leases in
  :mod:`~rallypoint.spec.check.properties`);
* :mod:`~rallypoint.spec.check.symmetry` -- normal forms, symmetry, fingerprints;
* :mod:`~rallypoint.spec.check.search` -- the breadth-first search and its workers;
* :mod:`~rallypoint.spec.check.trace` -- states described, steps narrated, traces.

This module puts them together (:class:`Checker`, :func:`check`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ...core import RendezvousState
from ..model.lifecycle import Phase
from .search import Search
from .state import (
    Age,
    CheckConfig,
    CheckerConfigError,
    CheckerWorkerError,
    CheckResult,
    Deadline,
    Event,
    EventKind,
    Global,
    Local,
    Op,
    Timers,
    Violation,
    node_of,
)
from .steps import Steps
from .symmetry import Instances, Symmetry, relabel
from .trace import describe, replay

__all__ = [
    "Age",
    "CheckConfig",
    "CheckResult",
    "Checker",
    "CheckerConfigError",
    "CheckerWorkerError",
    "Deadline",
    "Event",
    "EventKind",
    "Global",
    "Local",
    "Op",
    "Phase",
    "Timers",
    "Violation",
    "check",
    "describe",
    "node_of",
    "relabel",
]


class Checker:
    """Breadth-first model checker over a :class:`CheckConfig`.

    The step rules (:attr:`steps`) and the reductions of states
    (:attr:`symmetry`) are kept across runs, with their memo tables.
    """

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.settings = config.settings()
        instances = Instances()  # one instance of each state, for steps and symmetry
        self.steps = Steps(config, instances)
        self.symmetry = Symmetry(config, instances)
        self.model = self.steps.conformance.model

    @property
    def edges(self) -> set[tuple[str, str, str]]:
        """The lifecycle edges (source, trigger, destination) steps exercised."""
        return self.steps.conformance.edges

    def initial(self) -> Global:
        """Every node idle, nothing shared yet (normalized)."""
        locals_ = tuple(Local(0, Phase.IDLE, None, None) for _ in range(self.config.nodes))
        return self.normalize(Global(RendezvousState(), locals_, 0))

    def normalize(self, g: Global, shift_rounds: bool = True) -> Global:
        """``g`` without what no future step can tell apart (see
        :meth:`Symmetry.normalize`)."""
        return self.symmetry.normalize(g, shift_rounds)

    def fingerprint(self, g: Global) -> tuple[tuple[int, ...], int]:
        """The relabelling to ``g``'s representative and its 64-bit fingerprint."""
        return self.symmetry.fingerprint(g)

    def stand_ins(self, g: Global) -> set[int]:
        """The fingerprints of the states that stand for ``g`` in this search:
        its representative's and, with subsumption, those of the states that
        are ``g`` with some deadlines earlier (which simulate it, see
        :meth:`Symmetry.earlier_twins`). A reachable state has one of them
        stored."""
        normal = self.normalize(g)
        return {self.fingerprint(normal)[1], *self.symmetry.earlier_twins(normal)}

    def canonical(self, g: Global) -> tuple[Global, tuple[int, ...], int]:
        """The stored representative of ``g``, the permutation used, its fingerprint."""
        return self.symmetry.canonical(g)

    def events(self, g: Global) -> Iterator[Event]:
        """Every event enabled in ``g`` (see :meth:`Steps.events`)."""
        return self.steps.events(g)

    def expand(self, g: Global, event: Event) -> Iterator[Event]:
        """The concrete events of ``event`` (see :meth:`Steps.expand`)."""
        return self.steps.expand(g, event)

    def choices(self, g: Global, event: Event) -> tuple[list[Event], list[Event]]:
        """The concrete events of ``event`` the search stores, and those it only
        checks (see :meth:`Steps.choices`)."""
        return self.steps.choices(g, event)

    def successor(
        self, g: Global, event: Event, check_only: bool = False
    ) -> tuple[Global, list[str]]:
        """The state after ``event`` (see :meth:`Steps.successor`)."""
        return self.steps.successor(g, event, check_only)

    def run(
        self,
        progress: Callable[[CheckResult], None] | None = None,
        on_state: Callable[[Global, int], None] | None = None,
        workers: int = 1,
    ) -> CheckResult:
        """Explore every reachable state (or up to ``max_states``), breadth first,
        in ``workers`` processes (see :class:`Search`); ``progress`` gets the
        running totals about twice a second, ``on_state`` every newly stored state
        and its fingerprint."""
        return Search(self.steps, self.symmetry).run(self.initial(), progress, on_state, workers)

    def replay(self, events: list[Event]) -> list[str]:
        """A readable trace of ``events`` from the initial state."""
        return replay(self.steps, self.symmetry, self.initial(), events).trace


def check(
    config: CheckConfig,
    progress: Callable[[CheckResult], None] | None = None,
    workers: int = 1,
) -> CheckResult:
    """Run the model checker on ``config`` (in ``workers`` processes)."""
    return Checker(config).run(progress, workers=workers)
