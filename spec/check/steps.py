"""The checker's step rules: which events a state enables, and what each one does.

A node's events (:meth:`Steps.events`) are its crash, the start of an operation
(join, exit, close, taken together with the operation's first step), a step of
its running operation, and a trained node's heartbeat; when the config asks for
them, a trained node's workers failing (it starts charging the restart budget)
and a node excluding itself (a failed health check). A step is one iteration of
the driving loop, for every way the node's timers may have run
(:meth:`Steps.expand`): the driver's part is :class:`CoreSteps`'s; this module
applies it to the node's local state (:meth:`Steps.successor`) and checks the
step's properties and conformance.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from operator import itemgetter
from typing import NamedTuple

from ...core import (
    Beat,
    ChargeRestartOp,
    CloseOp,
    Done,
    ExcludeOp,
    ExitOp,
    Instruction,
    JoinOp,
    KeepAliveOp,
    LeaveOp,
    NodeDesc,
    Operator,
    RendezvousState,
    Wait,
    Write,
)
from ...core.actions import Action
from ..model.lifecycle import TERMINAL_PHASES, Lifecycle, Phase
from ..model.machine import built
from .conformance import Conformance
from .core_steps import CoreStep, CoreSteps
from .memo import Memo
from .properties import StepProperties
from .state import (
    STARTS,
    STEPPING_EVENTS,
    Age,
    CheckConfig,
    Deadline,
    Event,
    EventKind,
    Found,
    Global,
    Local,
    Op,
    Timers,
    node_of,
    with_local,
)
from .symmetry import Instances
from .trace import narrate

__all__ = ["Plan", "Steps", "Template"]


class Template(NamedTuple):
    """A stored event's step, as far as it reads no other node's local state
    (see :meth:`Steps.plan`)."""

    event: Event
    #: the operator the step runs (None for a crash)
    op: Operator | None
    #: the node's local state in which the step runs (a start's, for a start)
    started: Local
    #: the driver's part (None for a crash)
    core_step: CoreStep | None
    #: the node's local state after the step
    after: Local
    #: the shared state and intent log after the step
    written: RendezvousState
    intents: frozenset[NodeDesc]
    #: crashes, failures and exclusions the step adds
    counts: tuple[int, int, int]
    #: the number of what the step's conformance reads besides the other nodes'
    #: phases and pids
    conform: int
    #: every node's (phase, incarnation) -> those the step's conformance reads
    #: (None: it reads no other node's; see Steps._conformance)
    peers_read: Callable[[tuple[object, ...]], object] | None = None


class Plan(NamedTuple):
    """What the search does with one event of a state (see :meth:`Steps.plan`)."""

    #: the stored successors' templates
    stored: list[Template]
    #: the events to check and not store (empty once checked)
    checked: list[Event]
    #: how many events it checks (by the first state's checks, once checked)
    checks: int


class _ChargeNow(ChargeRestartOp):
    """:class:`ChargeRestartOp` of the current round (``Op.CHARGE``)."""

    trace_name = "ChargeRestartOp(this round)"


class _ChargeLate(ChargeRestartOp):
    """:class:`ChargeRestartOp` of a round that has ended (``Op.CHARGE_LATE``).

    The two are told apart by type, which the memo of core steps keys on: with the
    state (its round) in the key too, the type fixes the operator's round.
    """

    trace_name = "ChargeRestartOp(an ended round)"


#: The operators behind the operations a node starts (the charges take a round:
#: see _operator).
_OPERATORS: dict[Op, Callable[[], Operator]] = {
    Op.JOIN: JoinOp,
    Op.EXIT: ExitOp,
    Op.LEAVE: LeaveOp,
    Op.CLOSE: CloseOp,
    Op.EXCLUDE: ExcludeOp,
}
#: The phases in which a node runs no operation and may exclude itself.
_EXCLUDING_PHASES = frozenset({Phase.IDLE, Phase.EXITED, Phase.TRAINING})
#: The values of a node's own sighting, when it is a member and when it is not.
_MEMBER_AGES = (Age.FRESH, Age.DUE, Age.EXPIRED)
_OTHER_AGES = (Age.FRESH,)


@functools.cache
def _phases_at(slots: tuple[int, ...]) -> Callable[[tuple[object, ...]], object]:
    """Every node's (phase, incarnation) -> those of ``slots`` (in C; one
    function per set of slots)."""
    return itemgetter(*slots)


@functools.cache
def _event(kind: EventKind, slot: int) -> Event:
    """The event ``kind`` of ``slot``, without timers: one instance of each (the
    search asks every state for its events)."""
    return Event(kind, slot)


@functools.cache
def _timed_event(
    kind: EventKind,
    slot: int,
    expired: tuple[NodeDesc, ...],
    own: Age,
    last_call_over: bool,
    deadline: Deadline | None,
    contended: bool,
) -> Event:
    """A step event of ``slot`` with its timers (see :meth:`Steps.expand`): one
    instance of each. The splits make the same few again and again, and the memo
    tables keep what they made: a 4-node search held 785,302 timers, 114 MB, at
    25,000 states before; the 3-node default's largest process went from 2.2 to
    1.9 GB, its counts the same."""
    return Event(
        kind, slot, built(Timers, (frozenset(expired), own, last_call_over, deadline, contended))
    )


class Steps:
    """The events of one search and their successors (memoized where a pure
    function of fewer things than the whole state)."""

    def __init__(self, config: CheckConfig, instances: Instances | None = None) -> None:
        self.config = config
        self.settings = config.settings()
        self.core = CoreSteps(self.settings, instances)
        self.conformance = Conformance(self.settings)
        #: the deadline's values in the order time moves them
        self.deadlines = Deadline.in_time_order(self.settings)
        self.properties = StepProperties(self.core, self.deadlines)
        #: whether a node's workers may fail (a charge may then run when a write
        #: advances the round: see _step)
        self._charging = config.max_failures > 0
        #: (shared state, intent log, event kind, slot, local) -> events (see choices)
        self._choices: Memo[tuple[object, ...], tuple[list[Event], list[Event]]] = Memo()
        #: (id of the shared state, intent log, event kind, slot, local) -> (the
        #: shared state, the event's plan) (see plan; an entry holds the state its
        #: key names by id, so the id is not reused while the entry is there)
        self._plans: Memo[tuple[object, ...], tuple[RendezvousState, Plan]] = Memo()
        #: what a step's conformance reads, beyond the other nodes' phases -> (a
        #: number, what it reads of those) (see _conformance); numbers are never
        #: reused, so that a number conformed before the table was dropped still
        #: means what it meant
        self._conform_ids: Memo[
            tuple[object, ...], tuple[int, Callable[[tuple[object, ...]], object] | None]
        ] = Memo()
        self._next_conform_number = 0
        #: steps conformed already: (conformance number, the phases and
        #: incarnations of the other nodes it reads), or the number alone when
        #: the conformance reads no other node (see _conformance)
        self._conformed: Memo[object, None] = Memo()
        #: whether steps describe themselves (only a trace needs it)
        self.narrate = False

    # -- events ------------------------------------------------------------------

    def events(self, g: Global) -> Iterator[Event]:
        """Every event enabled in ``g`` (without the timers of its steps)."""
        cfg = self.config
        for i, loc in enumerate(g.locals):
            if loc.phase in TERMINAL_PHASES:
                continue
            if g.crashes < cfg.max_crashes:
                yield _event(EventKind.CRASH, i)
            if loc.op is not None:
                yield _event(EventKind.STEP, i)
                continue
            training = loc.phase is Phase.TRAINING
            if loc.phase in (Phase.IDLE, Phase.EXITED) or (training and not _member(g, i)):
                yield _event(EventKind.JOIN, i)
            if training:
                yield _event(EventKind.HEARTBEAT, i)
                yield _event(EventKind.EXIT, i)
                if cfg.leaves:
                    yield _event(EventKind.LEAVE, i)
            if cfg.allow_close and not g.shared.closed:
                yield _event(EventKind.CLOSE, i)
            if g.shared.closed:
                continue  # a charge or an exclusion of a closed rendezvous is done at once
            if training and g.failures < cfg.max_failures and not loc.round_ended:
                # A failure of an ended round is free (ChargeRestartOp finishes at
                # once): nothing shared changes, and its exit and join are the
                # node's events anyway.
                yield _event(EventKind.FAIL, i)
            if (
                g.exclusions < cfg.max_exclusions
                and loc.phase in _EXCLUDING_PHASES
                and g.shared.excluded.get(node_of(i, loc.incarnation), 0) <= g.shared.round
            ):
                yield _event(EventKind.EXCLUDE, i)

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
        kind, slot = event.kind, event.slot
        if kind not in STEPPING_EVENTS:
            yield event
            return
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        state = g.shared
        peers = sorted(n for n in state.heartbeats if n != node)
        own = _MEMBER_AGES if node in state.heartbeats else _OTHER_AGES
        over = (False, True) if state.last_call is not None else (False,)
        subsets = itertools.chain.from_iterable(
            itertools.combinations(peers, k) for k in range(len(peers) + 1)
        )
        # A deadline only moves on, and only its own node reads it; so it is chosen
        # when that node steps, not interleaved as events of its own.
        deadlines: tuple[Deadline | None, ...] = self.deadlines
        if kind is EventKind.HEARTBEAT:
            deadlines = (None,)
        elif kind is EventKind.STEP:
            assert loc.deadline is not None  # a running operation has one
            deadlines = self.deadlines[self.deadlines.index(loc.deadline) :]
        joins = kind is EventKind.JOIN or (kind is EventKind.STEP and loc.op is Op.JOIN)
        for expired, mine, lc, dl in itertools.product(list(subsets), own, over, deadlines):
            concrete = _timed_event(kind, slot, expired, mine, lc, dl, False)
            yield concrete
            assert concrete.timers is not None
            if joins and self.core.contention_matters(g, node, concrete.timers):
                yield _timed_event(kind, slot, expired, mine, lc, dl, True)

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
        if event.kind not in STEPPING_EVENTS:
            return [event], []
        loc = g.locals[event.slot]
        key = (g.shared, g.intents, event.kind, event.slot, loc.incarnation, loc.op, loc.deadline)
        known = self._choices.get(key)
        if known is None:
            known = self._choices.put(key, self._split(g, event))
        return known

    def _split(self, g: Global, event: Event) -> tuple[list[Event], list[Event]]:
        loc = g.locals[event.slot]
        node = node_of(event.slot, loc.incarnation)
        heartbeat = event.kind is EventKind.HEARTBEAT
        op = _operator(event, loc, g)
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
            deadline = Deadline.BEFORE if heartbeat else timers.deadline
            try:
                step = self.core.step(g.shared, node, op, timers, deadline, g.intents)
            except Found:
                violations.append(concrete)
                continue
            instruction = step.decision.instruction
            check = (step.decision, step.performed, step.guards, step.intents)
            # (a tuple's hash is not kept: a new check is told by the set's size,
            # hashing it once)
            known_checks = len(checks)
            if isinstance(instruction, (Wait, Beat)):
                checks.add(check)
                if len(checks) != known_checks:
                    checked.append(concrete)
                continue
            # (a Write's state is the written one: one instance of it, see CoreSteps)
            written = instruction[1:] if isinstance(instruction, Write) else instruction
            outcome = (written, step.performed, step.written, step.intents)
            first = stored.setdefault(outcome, concrete) is concrete
            checks.add(check)
            if not first and len(checks) != known_checks:
                checked.append(concrete)
        return [*violations, *stored.values()], checked

    # -- plans: the search's successors -----------------------------------------

    def plan(self, g: Global, event: Event) -> Plan:
        """What the search does with ``event`` (an event of :meth:`events`) in
        ``g``: the successors it stores, made from templates that hold all they
        share with every state of the same shared state, intent log and local
        state of the node (see :meth:`follow`), and the events it only checks
        (see :meth:`choices`).

        The checked events are handed out with the first state of that shared
        state, intent log and local state only (``Plan.checked`` is empty after
        it): a checked Wait, Beat, Announce or Done writes nothing, so its checks
        read only the core step and the node's own lifecycle change, which are
        the same in every such state; a checked Write has the outcome of a stored
        one (the same written state, dead nodes and admitted nodes), so what its
        checks read of the other nodes (their lifecycle changes, the leases of
        the nodes declared dead, the waiters the write could leave asleep) is
        what the stored event's checks read, in every state (docs/spec.md,
        "Checked once").

        Raises:
            Found: a stored event's core step breaks a property (its event set).
        """
        loc = g.locals[event.slot]
        key = (id(g.shared), g.intents, event.kind, event.slot, loc)
        hit = self._plans.get(key)
        if hit is not None:
            return hit[1]
        stored, checked = self.choices(g, event)
        templates = []
        for concrete in stored:
            try:
                templates.append(self._template(g, concrete))
            except Found as found:
                found.event = concrete
                raise
        self._plans.put(key, (g.shared, Plan(templates, [], len(checked))))
        return Plan(templates, checked, len(checked))

    def _template(self, g: Global, event: Event) -> Template:
        """``event``'s step in ``g``, as far as it reads no other node's local
        state (the checks of the node's own local event are made here)."""
        slot, kind = event.slot, event.kind
        loc = g.locals[slot]
        if kind is EventKind.CRASH:
            self.conformance.local_event(g, slot, "crash", Lifecycle.CRASHED)
            crashed = Local(loc.incarnation + 1, Phase.IDLE, None, None)
            return Template(event, None, loc, None, crashed, g.shared, g.intents, (1, 0, 0), -1)
        timers = event.timers
        assert timers is not None  # events of stepping kinds come from expand
        started, counts = (loc, (0, 0, 0)) if kind not in STARTS else self._started(g, event)
        op = _operator(event, loc, g)
        deadline = Deadline.BEFORE if started.op is None else timers.deadline
        node = node_of(slot, loc.incarnation)
        step = self.core.step(g.shared, node, op, timers, deadline, g.intents)
        after = _next_local(started, step.decision.instruction, deadline)
        number, peers_read = self._conformance(g.shared, step, slot, started)
        written, intents = step.written, step.intents
        return Template(
            event, op, started, step, after, written, intents, counts, number, peers_read
        )

    def _conformance(
        self, shared: RendezvousState, step: CoreStep, slot: int, started: Local
    ) -> tuple[int, Callable[[tuple[object, ...]], object] | None]:
        """The number of what the conformance of ``slot``'s ``step`` (run from its
        local state ``started``) reads besides the other nodes' phases and pids,
        and what it reads of those: a function of every node's (phase,
        incarnation) (None: nothing).

        A step is conformed once per number and what it reads of the others
        (docs/spec.md, "Conformed once per what conformance reads"). Most steps
        that read other nodes declare peers dead, and their conformance reads
        only the dead nodes' phases and pids: keying them on every node's would
        conform them again for every phase the bystanders are in."""
        # Of the node's own local state, conformance reads the pid, the phase and
        # the operation (its operator's trigger; the phase after the step follows
        # from them and the instruction). The deadline it ran with is in the
        # guards; the one it had before, and whether its round ended, are not
        # read: steps that differ only there are conformed once.
        what = (
            shared,
            step.decision,
            step.performed,
            step.guards,
            slot,
            started.incarnation,
            started.phase,
            started.op,
        )
        known = self._conform_ids.get(what)
        if known is not None:
            return known
        # (what it reads of the others is a function of ``what``: the written
        # state is the decision's or ``shared``)
        decision = step.decision
        instruction = decision.instruction
        admitted = instruction.admitted if isinstance(instruction, Write) else ()
        slots = self.conformance.slots_read(
            shared, decision.state, decision.dead, step.written, admitted, self.config.nodes
        )
        # (numbers are never reused, the table forgotten or not: see __init__)
        known = (self._next_conform_number, _phases_at(slots) if slots else None)
        self._next_conform_number += 1
        return self._conform_ids.put(what, known)

    def follow(self, g: Global, template: Template, phases: tuple[object, ...]) -> Global:
        """The successor of ``g`` that ``template`` (of :meth:`plan`) makes, after
        the checks that read the other nodes' local states. ``phases``: every
        node's ``(phase, incarnation)`` in ``g``.

        Raises:
            Found: the step breaks a property (the caller names the event).
        """
        slot = template.event.slot
        crashes, failures, exclusions = template.counts
        locals_ = list(g.locals)
        locals_[slot] = template.after
        after = built(
            Global,
            (
                template.written,
                tuple(locals_),
                g.crashes + crashes,
                template.intents,
                g.failures + failures,
                g.exclusions + exclusions,
            ),
        )
        step = template.core_step
        if step is None:
            return after  # a crash: its checks read only the node's own state
        problems = self.properties.peer_problems(g, slot, step)
        if problems:
            raise Found(problems, step.decision)
        if self._charging and template.written.round != g.shared.round:
            after = _round_advanced(after)
        read = template.peers_read
        conformed = template.conform if read is None else (template.conform, read(phases))
        if conformed not in self._conformed:
            assert template.op is not None  # a stepping event's template has its operator
            started = with_local(g, slot, template.started)._replace(
                failures=g.failures + failures, exclusions=g.exclusions + exclusions
            )
            self._conform(started, slot, step, after, template.op, [], conformed)
        return after

    # -- successors --------------------------------------------------------------

    def successor(
        self, g: Global, event: Event, check_only: bool = False
    ) -> tuple[Global, list[str]]:
        """The state after ``event``, and lines describing it (when narrating).
        With ``check_only``, only check the step: what it returns is then undefined.

        Raises:
            Found: a property or the model's conformance is violated by this step.
            ValueError: ``event`` is not one the search makes.
        """
        slot, kind = event.slot, event.kind
        loc = g.locals[slot]
        if kind is EventKind.CRASH:
            # The restart is taken at once: it changes only the slot's local state,
            # which no other event reads, and a restarted node that stays idle acts
            # as one that never came back.
            self.conformance.local_event(g, slot, "crash", Lifecycle.CRASHED)
            new = Local(loc.incarnation + 1, Phase.IDLE, None, None)
            restarted = node_of(slot, loc.incarnation + 1)
            return with_local(g, slot, new, crashes=g.crashes + 1), [
                f"crashed, restarts as {restarted}"
            ]
        if kind not in STEPPING_EVENTS:
            raise ValueError(f"unknown event {kind!r}")
        if event.timers is None:
            raise ValueError(f"a {kind} event needs its timers (see expand)")
        if kind is EventKind.HEARTBEAT or kind is EventKind.STEP:
            return self._step(g, slot, _operator(event, loc, g), event.timers, check_only)
        return self._start(g, event, event.timers, check_only)

    def _started(self, g: Global, event: Event) -> tuple[Local, tuple[int, int, int]]:
        """The local state in which the node of ``event`` (one that starts an
        operation) takes the operation's first step, and the crashes, failures
        and exclusions the start adds. A join start's lifecycle event is
        checked here.

        Raises:
            Found: the model has no such lifecycle event.
        """
        slot, op = event.slot, STARTS[event.kind]
        loc = g.locals[slot]
        if op is Op.JOIN:
            new = Local(loc.incarnation, Phase.JOINING, op, Deadline.BEFORE)
            dest = self.conformance.model_state(with_local(g, slot, new), slot)
            self.conformance.local_event(g, slot, "join", dest)
            return new, (0, 0, 0)
        started = loc._replace(op=op, deadline=Deadline.BEFORE)
        return started, (0, int(op is Op.CHARGE), int(op is Op.EXCLUDE))

    def _start(
        self, g: Global, event: Event, timers: Timers, check_only: bool
    ) -> tuple[Global, list[str]]:
        """Start an operation and take its first step.

        Starting an operation changes only the node's own local state, which no
        other event reads, so it is taken together with the operation's first step
        (the start commutes with every event between the two).
        """
        slot, op = event.slot, STARTS[event.kind]
        loc = g.locals[slot]
        new, (_, failures, exclusions) = self._started(g, event)
        started = with_local(g, slot, new)._replace(
            failures=g.failures + failures, exclusions=g.exclusions + exclusions
        )
        try:
            operator = _operator(event, loc, g)
            after, lines = self._step(started, slot, operator, timers, check_only)
        except Found as found:
            if self.narrate:
                found.lines = [f"starts {op}", *found.lines]
            raise
        return after, [f"starts {op}", *lines] if self.narrate else lines

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
        # A keep-alive has no deadline of its own; it never times out.
        deadline = Deadline.BEFORE if loc.op is None else timers.deadline
        core_step, lines = self._core_step(g, slot, op, timers, deadline)
        decision = core_step.decision
        # Conformance depends on the shared state, what the step decided and did,
        # its guards, the node's pid, phase and operation and (when it reads
        # them) some other nodes' phases and pids; many steps share all of them
        # (timer choices that differ in nothing the check reads), so each
        # combination is checked once.
        number, read = self._conformance(g.shared, core_step, slot, loc)
        if read is None:
            conformed: object = number
        else:
            conformed = (number, read(tuple((o.phase, o.incarnation) for o in g.locals)))
        if check_only and conformed in self._conformed:
            return g, lines
        new_loc = _next_local(loc, decision.instruction, deadline)
        after = with_local(g, slot, new_loc, shared=core_step.written, intents=core_step.intents)
        if self._charging and core_step.written.round != g.shared.round:
            after = _round_advanced(after)
        if conformed not in self._conformed:
            self._conform(g, slot, core_step, after, op, lines, conformed)
        return after, lines

    def _core_step(
        self, g: Global, slot: int, op: Operator, timers: Timers, deadline: Deadline | None
    ) -> tuple[CoreStep, list[str]]:
        """The driver's part of the step and its narration, after the checks of the
        step that read more than the shared state: broken leases and missed
        wake-ups (see :class:`StepProperties`).

        Raises:
            Found: with the narration of the violating step.
        """
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        lines: list[str] = []
        try:
            core_step = self.core.step(g.shared, node, op, timers, deadline, g.intents)
            decision = core_step.decision
            if self.narrate:
                lines = narrate(loc, timers, deadline, op, decision, g, core_step.read_log)
            problems = self.properties.peer_problems(g, slot, core_step)
        except Found as found:
            if self.narrate and found.decision is not None:
                found.lines = narrate(loc, timers, deadline, op, found.decision, g, found.read_log)
            raise
        if problems:
            broken = Found(problems, decision)
            broken.lines = lines
            raise broken
        return core_step, lines

    def _conform(
        self,
        g: Global,
        slot: int,
        core_step: CoreStep,
        after: Global,
        op: Operator,
        lines: list[str],
        conformed: object,
    ) -> None:
        """Check the step's conformance, and remember it as ``conformed`` (its key:
        see :meth:`_conformance`)."""
        decision = core_step.decision
        instruction = decision.instruction
        admitted = instruction.admitted if isinstance(instruction, Write) else ()
        try:
            self.conformance.conform(
                g,
                slot,
                decision.state,
                decision.dead,
                after,
                core_step.performed,
                op,
                core_step.guards,
                admitted,
            )
        except Found as found:
            found.decision = decision
            found.lines = lines
            raise
        self._conformed.put(conformed, None)


def _member(g: Global, slot: int) -> bool:
    return node_of(slot, g.locals[slot].incarnation) in g.shared.members()


def _operator(event: Event, loc: Local, g: Global) -> Operator:
    """The operator a stepping event runs: a keep-alive, the running operation's,
    or the one it starts (a charge, of the round of ``g`` or of the one before)."""
    if event.kind is EventKind.HEARTBEAT:
        return KeepAliveOp()
    op = loc.op if event.kind is EventKind.STEP else STARTS[event.kind]
    assert op is not None  # "step" events are made only while loc.op is set
    if op is Op.CHARGE:
        return _ChargeNow(g.shared.round)
    if op is Op.CHARGE_LATE:
        # Any ended round: the operator compares its round with the state's for
        # equality before anything else.
        return _ChargeLate(g.shared.round - 1)
    return _OPERATORS[op]()


def _round_advanced(g: Global) -> Global:
    """``g``, whose round a write just advanced, with every training node's round
    marked ended, and every running charge with it (it is late: free).

    A node's failure is counted for the round it trained in, which the operator
    holds; the search keeps no round numbers in local states (the round
    abstraction renumbers the state's), only whether that round is still the
    current one: a training node's round is the round its join returned in, the
    current one then, until a write advances it.
    """
    training = Phase.TRAINING
    if not any(loc.phase is training and not loc.round_ended for loc in g.locals):
        return g
    locals_ = tuple(
        loc._replace(round_ended=True, op=Op.CHARGE_LATE if loc.op is Op.CHARGE else loc.op)
        if loc.phase is training
        else loc
        for loc in g.locals
    )
    return g._replace(locals=locals_)


#: Operations after which the node goes on in its phase.
_ON_THEIR_OWN = frozenset({Op.CHARGE, Op.CHARGE_LATE, Op.EXCLUDE})


def _ended_in(loc: Local, done: Done) -> Phase | None:
    """The phase the node's operation ended in with ``done`` (None: it goes on)."""
    action = done.action
    if action is Action.FINISH:
        if loc.op is Op.JOIN and done.joined is not None:
            # Done.rejoin (the round lost its rank 0) finishes here too: the handler
            # then exits the round and joins the next one, which a trained node's
            # exit and join events explore.
            return Phase.TRAINING
        if loc.op is Op.EXIT or loc.op is Op.LEAVE:
            return Phase.EXITED
        if loc.op is Op.CLOSE:
            return Phase.CLOSED
        if loc.op in _ON_THEIR_OWN:
            # a charge leaves the node training (its exit and join events follow);
            # an exclusion leaves it where its write put it (see _next_local)
            return loc.phase
        return None
    if action in (Action.ERROR_CLOSED, Action.ERROR_GRACEFUL_EXIT):
        return Phase.CLOSED
    if action is Action.ERROR_TIMEOUT:
        return Phase.FAILED
    return None


def _next_local(loc: Local, instruction: Instruction, deadline: Deadline | None) -> Local:
    """The node's local state after a step that carried out ``instruction`` with
    its deadline at ``deadline``. Observations are not kept: every step chooses
    its sightings afresh."""
    if isinstance(instruction, Done):
        ended = _ended_in(loc, instruction)
        if ended is not None:
            if loc.op in _ON_THEIR_OWN and ended is loc.phase:
                # the node goes on as it was (a training node in the same round)
                return loc._replace(op=None, deadline=None)
            return built(Local, (loc.incarnation, ended, None, None, False))
    # The time that passed stays passed: the chosen deadline value is kept.
    new_deadline = loc.deadline if loc.op is None else deadline
    phase = loc.phase
    if isinstance(instruction, Write):
        action = instruction.action
        if (action is Action.REMOVE_FROM_PARTICIPANTS and loc.op is Op.EXIT) or (
            action is Action.LEAVE and loc.op is Op.LEAVE
        ):
            phase = Phase.EXITED
        elif instruction.action is Action.EXCLUDE and phase is Phase.TRAINING:
            # it left its round: its workers stop, as after an exit
            phase = Phase.EXITED
        if instruction.deadline is not None:
            # a fresh deadline, as far from now as the one an operation starts with
            new_deadline = Deadline.BEFORE
    round_ended = loc.round_ended and phase is Phase.TRAINING
    return built(Local, (loc.incarnation, phase, loc.op, new_deadline, round_ended))
