"""The checker's own properties of a step, beyond :mod:`rallypoint.spec.model.invariants`.

* **No missed wake-up** (:meth:`StepProperties.missed_wakeups`, the reason phases
  exist): a write that publishes no new phase leaves the decision of every node
  waiting on the state as it was.
* **Self-fencing** (:meth:`StepProperties.broken_leases`, docs/design.md, decision
  7): a node declared dead whose workers run was already told to stop them.
"""

from __future__ import annotations

import itertools

from ...core import (
    Decision,
    HeartbeatSighting,
    NodeDesc,
    NodeView,
    RendezvousState,
    Wait,
    Write,
)
from ...core import driver as core_driver
from ..model.lifecycle import Phase
from .core_steps import CoreStep, CoreSteps
from .memo import Memo
from .state import Age, Deadline, Global, Local, Op, Timers, node_of

__all__ = ["StepProperties"]


class StepProperties:
    """The wake-up and lease checks of one search (memoized on the core steps)."""

    def __init__(self, core: CoreSteps, deadlines: tuple[Deadline, ...]) -> None:
        self.core = core
        self.settings = core.settings
        #: the deadline's values in the order time moves them
        self._deadlines = deadlines
        #: (ids of the states before and after a write, a waiting node, its
        #: deadline) -> (those states, the missed wake-ups) (an entry holds the
        #: states its key names by id, so the ids are not reused while it is there)
        self._wakeups: Memo[tuple[object, ...], tuple[object, list[str]]] = Memo()
        #: the nodes whose lease was judged a liveness window after its renewal,
        #: and those of them whose lease had not run out then (see _judge)
        self._judged: set[NodeDesc] = set()
        self._unfenced: set[NodeDesc] = set()

    def peer_problems(self, g: Global, slot: int, step: CoreStep) -> list[str]:
        """The checks of ``slot``'s ``step`` in ``g`` that read the other nodes'
        local states: the leases of the nodes it declared dead, and, for a write
        that publishes no phase, the waiters it leaves asleep."""
        decision = step.decision
        problems = self.broken_leases(g, decision.dead) if decision.dead else []
        instruction = decision.instruction
        if not problems and isinstance(instruction, Write) and instruction.phase is None:
            problems = self.missed_wakeups(g, slot, step)
        return problems

    def broken_leases(self, g: Global, dead: frozenset[NodeDesc]) -> list[str]:
        """Self-fencing (docs/design.md, decision 7): a node declared dead whose
        workers run must already have been told to stop them.

        A peer declares a node dead once its counter pair has not moved for over a
        liveness window on the peer's clock, counted from when the peer first saw
        it, which is no earlier than the renewal that set it was sent. So at that
        moment the node's own lease (its sighting of itself, timed from that send)
        is at least a window old, and the core's ``must_fence`` must say so."""
        if not dead <= self._judged:  # (no new set on the usual path)
            for node in dead - self._judged:
                self._judge(node)
        if self._unfenced.isdisjoint(dead):
            return []  # (every step that declares nodes dead asks: two set operations)
        window = self.settings.liveness_window
        problems = []
        training = Phase.TRAINING
        for i, loc in enumerate(g.locals):
            if loc.phase is not training:
                continue
            gone = node_of(i, loc.incarnation)
            if gone in dead and gone in self._unfenced:  # (every dead node is judged)
                problems.append(
                    f"lease: {gone} was declared dead while it trained, and its own lease "
                    f"(last renewed a liveness window of {window:g} s ago) had not run out: "
                    "must_fence said its workers could go on"
                )
        return problems

    def _judge(self, node: NodeDesc) -> None:
        """Ask the core whether it tells ``node`` to stop its workers a liveness
        window after its last renewal, and keep the answer (a function of the node
        and settings alone): ``node`` is judged, and unfenced if it is not told."""
        window = self.settings.liveness_window
        view = NodeView(own=HeartbeatSighting(0, -window))
        if not core_driver.must_fence(view, node, self.settings, 0.0):
            self._unfenced.add(node)
        self._judged.add(node)

    def missed_wakeups(self, g: Global, slot: int, core_step: CoreStep) -> list[str]:
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

        A function of the shared states before and after the step and of the
        waiter's node and deadline: memoized on those (many steps, under other
        timers or from other local states, make the same write: in the default
        3-node space 231,516 (step, waiter, deadline) are 25,561 of these).
        """
        before, after = g.shared, core_step.written
        problems: list[str] = []
        for i, other in enumerate(g.locals):
            if i == slot or other.op is not Op.JOIN:
                continue
            waiter = node_of(i, other.incarnation)
            key = (id(before), id(after), waiter, other.deadline)
            known = self._wakeups.get(key)
            if known is None:
                missed = self._missed_wakeup(before, after, waiter, other)
                known = self._wakeups.put(key, ((before, after), missed))
            problems += known[1]
        return problems

    def _missed_wakeup(
        self, before: RendezvousState, after: RendezvousState, waiter: NodeDesc, loc: Local
    ) -> list[str]:
        if waiter in before.members() and waiter not in after.members():
            return []
        own = (Age.FRESH, Age.DUE) if waiter in before.heartbeats else (Age.FRESH,)
        over = (False, True) if before.last_call is not None else (False,)
        start = self._deadlines.index(loc.deadline) if loc.deadline in self._deadlines else 0
        for mine, lc, dl in itertools.product(own, over, self._deadlines[start:]):
            timers = Timers(frozenset(), mine, lc, dl)
            asleep = self.core.decide(before, waiter, timers, dl)
            if not isinstance(asleep.instruction, Wait):
                continue
            if after.last_call != before.last_call or after.round != before.round:
                timers = timers._replace(last_call_over=False)  # a new last call, just seen
            awake = self.core.decide(after, waiter, timers, dl)
            if _outcome(awake) != _outcome(asleep):
                return [
                    f"missed wake-up: {waiter} waits ({_describe_decision(asleep)}) on the "
                    f"state before this step and would {_describe_decision(awake)} on the "
                    "state after it, but the step's write publishes no new phase"
                ]
        return []


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
