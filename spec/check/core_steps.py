"""The node's part of a checker step: decide on a fresh view, carry it out atomically.

:meth:`CoreSteps.step` builds the node's view from the shared state and the
timers the step chose, steps a :class:`~rallypoint.core.RendezvousNode` on it (the
entry point every executor uses; it asks :func:`rallypoint.core.driver.decide`,
looked up at call time, so that a test can plant a bug in it or in the core it
calls), carries the instruction out, and checks the step's safety properties
(:mod:`rallypoint.spec.model.invariants`). It is a pure function of its arguments, so
it is memoized: most states share their shared state and timers with others.
"""

from __future__ import annotations

from typing import NamedTuple

from immutables import Map

from ...core import (
    Announce,
    Beat,
    Decision,
    Done,
    HeartbeatSighting,
    Instruction,
    Joined,
    JoinOp,
    LastCallSighting,
    NodeDesc,
    NodeInstruction,
    NodeView,
    Operator,
    Read,
    ReadResult,
    Regroup,
    RendezvousNode,
    RendezvousState,
    Settings,
    Wait,
    Write,
    heartbeat_of,
)
from ...core.actions import Action
from ...core.errors import InvalidTransitionError
from ..model.invariants import (
    check_admissions,
    check_removal_published,
    check_return,
    check_state,
    check_transition,
)
from ..model.machine import Guards, View, built
from .memo import Memo
from .state import Age, Deadline, Found, Global, Timers
from .symmetry import Instances

__all__ = ["CoreStep", "CoreSteps"]


#: A decision that would read what the search forgets of a closed rendezvous
#: (Symmetry._normal_intents).
_LOG_ON_CLOSED = (
    "{node} joins through the intent log of closed round {round} (it reads the log "
    "or announces itself in it): nothing is admitted to a closed rendezvous"
)


class CoreStep(NamedTuple):
    """What the driver decided in one step, and what carrying it out did (see
    :meth:`CoreSteps.step`)."""

    decision: Decision
    #: the action the node carried out: the Write's (None for a Write that only
    #: publishes removals), Beat's KEEP_ALIVE, Wait's SYNC, Done's
    performed: Action | None
    #: the shared state after the step (the Write's state; else the state before)
    written: RendezvousState
    #: the model's guards on the stepping node's view before its action
    guards: Guards
    #: the current round's intent log past the cursor after the step
    intents: frozenset[NodeDesc]
    #: whether the node read the intent log within the step (a Read(intents=True))
    read_log: bool


class _Effect(NamedTuple):
    """What carrying out an instruction did to what is shared."""

    written: RendezvousState
    performed: Action | None
    intents: frozenset[NodeDesc]
    problems: list[str]


class CoreSteps:
    """The memoized driver steps of one search (and the views they decide on)."""

    def __init__(self, settings: Settings, instances: Instances | None = None) -> None:
        self.settings = settings
        #: the one instance of each state the steps make (see step)
        self.instances = Instances() if instances is None else instances
        window = settings.liveness_window
        #: the age of the node's own sighting for each of its values
        self._own_ages = {
            Age.FRESH: 0.0,
            Age.DUE: -settings.keep_alive_interval,
            Age.EXPIRED: -(window + 1.0),
        }
        #: the age of an expired peer's sighting, and of an armed last call that is over
        self._expired = self._own_ages[Age.EXPIRED]
        self._call_over = -(settings.last_call_timeout + 1.0)
        #: each deadline's time relative to now
        self.times = {d: d.relative(settings) for d in Deadline}
        # The memos below are keyed on the ids of the (one instances of) states,
        # and each entry holds the states its key names: an id is not reused while
        # its object lives, so a hit is the state of the key. A state's hash is a
        # Python-level call; the ids hash in C (these memos are looked up millions
        # of times in a 3-node search).
        #: (id of the state, node, operator type, timers, deadline, intent log) ->
        #: (the state, the step) (see step)
        self._steps: Memo[tuple[object, ...], tuple[RendezvousState, CoreStep]] = Memo()
        #: (id of a state, node, timers, deadline) -> (the state, a join's
        #: decision) (see decide)
        self._decisions: Memo[tuple[object, ...], tuple[RendezvousState, Decision]] = Memo()
        #: what a step's safety checks read, states by id -> (those states, their
        #: problems) (see _step_problems)
        self._problems: Memo[tuple[object, ...], tuple[object, list[str]]] = Memo()
        #: (id of a state, node, timers but the deadline, announced) -> (the state,
        #: the node's view at a step) (see view)
        self._views: Memo[tuple[object, ...], tuple[RendezvousState, NodeView]] = Memo()
        #: how a step made a state from another (the other by id) -> (the other,
        #: the one instance of the state it made) (see _one_made)
        self._made: Memo[tuple[object, ...], tuple[RendezvousState, RendezvousState]] = Memo()

    def limit(self, deadline: Deadline | None) -> float:
        """The deadline the driver is given (relative to now = 0)."""
        return self.times[deadline] if deadline is not None else float("inf")

    # -- views ------------------------------------------------------------------

    def view(
        self,
        state: RendezvousState,
        node: NodeDesc,
        timers: Timers,
        pending: frozenset[NodeDesc] = frozenset(),
    ) -> NodeView:
        """The node's view at this step: ``state`` and every member's side counter
        read at this instant (so never too old to judge liveness on), with its
        sightings aged as ``timers`` says; ``contended`` as the timers choose, and
        ``announced`` when the node is in the round's intent log past the cursor.

        The side counters are all 0: only whether a sighting equals the counter
        matters, and every step chooses the sightings' ages afresh. A sighting
        watches the pair (state counter, side counter), so each equals what a read
        at this instant shows, and a re-read within the step keeps its age.

        Every step that makes the same view shares it (memoized): deciding only
        records in it what was decided, and a step that reads within it (the
        intent log) reads into a copy.
        """
        expired, mine, lc, contended = (
            timers.expired,
            timers.own,
            timers.last_call_over,
            timers.contended,
        )
        announced = state.round if node in pending else -1
        key = (id(state), node, expired, mine, lc, contended, announced)
        hit = self._views.get(key)
        if hit is not None:
            return hit[1]
        counter = state.heartbeats.get(node)
        own = None
        if counter is not None:
            own = HeartbeatSighting(heartbeat_of(counter, 0), self._own_ages[mine])
        peers = Map(
            {
                n: HeartbeatSighting(heartbeat_of(c, 0), self._expired if n in expired else 0.0)
                for n, c in state.heartbeats.items()
                if n != node
            }
        )
        call = None
        if state.last_call is not None:
            since = self._call_over if lc else 0.0
            call = LastCallSighting(state.round, state.last_call, since)
        view = NodeView(
            state, _counters(state), 0.0, 0.0, own, call, peers, False, None, -1,
            contended, announced,
        )  # fmt: skip
        self._views.put(key, (state, view))
        return view

    # -- decisions --------------------------------------------------------------

    def decide(
        self, state: RendezvousState, node: NodeDesc, timers: Timers, deadline: Deadline | None
    ) -> Decision:
        """The decision of a join of ``node`` on ``state`` (not carried out;
        memoized: the waiters of every write from one state decide on it)."""
        key = (id(state), node, timers, deadline)
        hit = self._decisions.get(key)
        if hit is not None:
            return hit[1]
        view = self.view(state, node, timers)
        try:
            stepped = RendezvousNode(node, self.settings, view=view)
            stepped.start(JoinOp(), 0.0, self.limit(deadline), fresh=True)
            known = Decision.of(_of_operation(stepped.next(0.0)), view)
        except InvalidTransitionError as exc:
            raise Found([f"the core chose an action it then rejected: {exc}"]) from None
        self._decisions.put(key, (state, known))
        return known

    def contention_matters(self, g: Global, node: NodeDesc, timers: Timers) -> bool:
        """Whether a lost compare-and-set changes the join step of ``node`` with
        ``timers``: the uncontended step writes an action of its own (a node only
        loses a compare-and-set on its way to one), and the contended decision
        differs from it."""
        state, intents, deadline = g.shared, g.intents, timers.deadline
        try:
            step = self.step(state, node, JoinOp(), timers, deadline, intents)
        except Found:
            return False  # the step itself is a violation; it is reported as it is
        instruction = step.decision.instruction
        if not isinstance(instruction, Write) or instruction.action is None:
            return False
        contended = built(Timers, (*timers[:4], True))  # (contended is the last field)
        try:
            other = self.step(state, node, JoinOp(), contended, deadline, intents)
        except Found:
            return True  # the contended step is a violation: explore it to report it
        return other.decision.instruction != instruction or other.intents != step.intents

    # -- steps ------------------------------------------------------------------

    def step(
        self,
        state: RendezvousState,
        node: NodeDesc,
        op: Operator,
        timers: Timers,
        deadline: Deadline | None,
        pending: frozenset[NodeDesc] = frozenset(),
    ) -> CoreStep:
        """The driver's part of a step, carried out atomically (memoized).

        ``pending`` is the current round's intent log past the cursor. The driver
        sees it as the whole log, in node order, with the cursor at 0 (the state
        is normalized so): only the entries past the cursor matter to a decision.

        Raises:
            Found: the step breaks a safety property, the driver asked for
                something an atomic step cannot carry out, or it joins a closed
                rendezvous through the intent log (which the search forgets once
                closed: see :meth:`Symmetry._normal_intents`).
        """
        key = (id(state), node, type(op), timers, deadline, pending)
        hit = self._steps.get(key)
        if hit is not None:
            return hit[1]
        log = tuple(sorted(pending))
        view = self.view(state, node, timers, pending)
        view, decision, read_log = self._decide(view, node, op, self.limit(deadline), log)
        if state.closed and (read_log or isinstance(decision.instruction, Announce)):
            found = Found([_LOG_ON_CLOSED.format(node=node, round=state.round)], decision)
            found.read_log = read_log
            raise found
        effect = _carry_out(state, node, decision, pending, log, read_log)
        decision, written = self._one_instances(state, node, decision, effect.written, log)
        checked = self._step_problems(state, node, timers, decision, written, log)
        problems = effect.problems + checked
        if problems:
            found = Found(problems, decision)
            found.read_log = read_log
            raise found
        # The stepping node's own action is judged on its view before the action.
        limit = None if deadline is None else self.times[deadline]
        guards = Guards.of(
            built(
                View,
                (
                    node,
                    decision.state,
                    self.settings,
                    0.0,
                    view.own,
                    view.last_call,
                    limit,
                    pending,
                ),
            )
        )
        if isinstance(op, JoinOp) and isinstance(decision.instruction, Wait):
            waits = needless_wait(node, decision.state, guards)
            if waits:
                found = Found(waits, decision)
                found.read_log = read_log
                raise found
        step = built(
            CoreStep, (decision, effect.performed, written, guards, effect.intents, read_log)
        )
        self._steps.put(key, (state, step))
        return step

    def _step_problems(
        self,
        state: RendezvousState,
        node: NodeDesc,
        timers: Timers,
        decision: Decision,
        written: RendezvousState,
        log: tuple[NodeDesc, ...],
    ) -> list[str]:
        """Safety: a node that finds members silent publishes their removal at once;
        the written state and both halves of the step (read -> the operator's view ->
        written; nothing is written but by a Write); batched admissions.

        A node never finds itself dead (it is alive: it beats now); its peers judge it
        by their own sightings. So only the expired peers count.

        Memoized on what it reads: most steps that miss the memo of steps differ
        from one made before only in timers that change nothing checked here (the
        3-node space: 600,620 steps, 4,308 distinct written states); the states are
        the one instances, so the key compares by identity.
        """
        instruction, sanitized = decision.instruction, decision.state
        admitted = instruction.admitted if isinstance(instruction, Write) else None
        states = (state, sanitized, written)
        key = (*map(id, states), node, timers.expired, decision.dead, admitted, log)
        hit = self._problems.get(key)
        if hit is not None:
            return hit[1]
        problems = check_removal_published(node, state, timers.expired, decision.dead, written)
        if written is not state:
            # (a state the step does not write was checked when it was written)
            problems += check_state(written, self.settings)
        if sanitized is not state:
            problems += check_transition(state, sanitized)
        if admitted is not None:  # a Write
            problems += check_transition(sanitized, written)
            problems += check_admissions(node, state, sanitized, written, admitted, log)
        self._problems.put(key, (states, problems))
        return problems

    def _one_instances(
        self,
        state: RendezvousState,
        node: NodeDesc,
        decision: Decision,
        written: RendezvousState,
        log: tuple[NodeDesc, ...],
    ) -> tuple[Decision, RendezvousState]:
        """``decision`` and ``written`` with each state the step made (the written
        one, the view with the dead removed) replaced by the one instance of it the
        steps hand out. Many steps make equal states (the same write under other
        timers); the successors and memo keys made of them then compare by identity
        instead of field by field (see :class:`Instances`)."""
        instruction = decision.instruction
        sanitized = decision.state
        if sanitized is not state:
            sanitized = self._one_made(sanitized, (id(state), decision.dead), state)
        if written is not state:
            admitted = instruction.admitted if isinstance(instruction, Write) else None
            made = (id(state), node, decision.action, decision.dead, admitted, log)
            written = self._one_made(written, made, state)
        # (one construction each: no _replace loop)
        if isinstance(instruction, Write):
            instruction = built(Write, (written, *instruction[1:]))
        elif isinstance(instruction, Done) and instruction.state is decision.state:
            # it ends on the view
            instruction = built(Done, (instruction.action, sanitized, *instruction[2:]))
        return built(Decision, (instruction, decision.action, sanitized, decision.dead)), written

    def _one_made(
        self, new: RendezvousState, made: tuple[object, ...], state: RendezvousState
    ) -> RendezvousState:
        """The one instance of ``new``, a state a step made from ``state`` the
        way ``made`` says (the ids in it are of ``state``, which the entry holds).

        The instance last made the same way is the first guess: a correct driver
        makes the same state under every timer choice that leads to the same
        action, dead nodes and admissions, and a guess confirmed field by field
        saves hashing ``new`` (a new object, whose hash is computed afresh). A
        wrong guess (a driver whose writes depend on more) falls back to the
        table of instances."""
        guess = self._made.get(made)
        if guess is not None and guess[0] is state and guess[1] == new:
            return guess[1]
        one = self.instances.one(new)
        self._made.put(made, (state, one))
        return one

    def _decide(
        self, view: NodeView, node: NodeDesc, op: Operator, limit: float, log: tuple[NodeDesc, ...]
    ) -> tuple[NodeView, Decision, bool]:
        """The driver's decision on the node's ``view`` of this instant (the view
        it decided on, the decision, and whether the node read the intent log,
        ``log``, to make it)."""
        state = view.state
        try:
            stepped = RendezvousNode(node, self.settings, view=view)
            stepped.start(op, 0.0, limit, fresh=True)
            instruction = _of_operation(stepped.next(0.0))
            decision = Decision.of(instruction, view)
            if (
                isinstance(instruction, Read)
                and getattr(instruction, "intents", False)
                and view.intents_round != state.round
            ):
                # The intent log, read at this same instant with the state it
                # belongs to: the node then decides again within the step, on a
                # copy of the view (the memoized one is shared by other steps).
                counters = _counters(state) if instruction.counters else None
                stepped.view = view = view.copy()
                read = ReadResult(state, None, counters, log)
                instruction = _of_operation(stepped.step(read, 0.0))
                return view, Decision.of(instruction, view), True
        except InvalidTransitionError as exc:
            raise Found([f"the core chose an action it then rejected: {exc}"]) from None
        return view, decision, False


def _of_operation(instruction: NodeInstruction) -> Instruction:
    """A node's instruction for an operation started with ``start`` (its end is a
    Done: never the lifecycle's Joined or Regroup)."""
    assert not isinstance(instruction, (Joined, Regroup)), instruction
    return instruction


def _counters(state: RendezvousState) -> Map[NodeDesc, int]:
    return Map({n: 0 for n in state.heartbeats})


def _carry_out(
    state: RendezvousState,
    node: NodeDesc,
    decision: Decision,
    pending: frozenset[NodeDesc],
    log: tuple[NodeDesc, ...],
    read_log: bool,
) -> _Effect:
    """Carry the instruction out. The view is as fresh as a view can be."""
    instruction = decision.instruction
    if isinstance(instruction, Write):
        # A winning compare-and-set (a lost one changes nothing shared, and the
        # node decides again on what beat it: another step of the search).
        written = instruction.state
        if written.round == state.round:
            intents = frozenset(log[max(0, written.intent_cursor) :])
        else:
            intents = frozenset()  # a new round's log: nobody announced in it yet
        return _Effect(written, instruction.action, intents, [])
    if isinstance(instruction, Announce):
        # The node appends itself to the intent log; nothing else is shared.
        problems = []
        if instruction.round != state.round:
            problems.append(
                f"{node} announced itself in the intent log of round {instruction.round} "
                f"while the state is in round {state.round}: it reads round "
                f"{state.round}'s log back, and its entry waits in a round not started"
            )
        return _Effect(state, None, pending | {node}, problems)
    if isinstance(instruction, Beat):
        # A beat moves only the node's side counter, which no step reads (each
        # chooses its sightings afresh). It is a keep-alive, whatever the
        # operator would have done next (a member beats first when it is due).
        return _Effect(state, Action.KEEP_ALIVE, pending, [])
    if isinstance(instruction, Wait):
        return _Effect(state, decision.action, pending, [])  # a wait changes nothing
    if isinstance(instruction, Done):
        joined = instruction.joined
        problems = []
        if joined is not None:
            # agreement, through the state the join returns on (check_return)
            problems = check_return(
                node, state, joined.round, joined.rank, joined.world_size, joined.members
            )
        return _Effect(state, instruction.action, pending, problems)
    if isinstance(instruction, Read):
        raise _endless_read(instruction, decision, read_log)
    raise Found([f"the driver answered {instruction!r} to an operation"], decision)


def _endless_read(instruction: Read, decision: Decision, read_log: bool) -> Found:
    what = (
        f"Read(counters={instruction.counters}, intents={getattr(instruction, 'intents', False)})"
    )
    found = Found(
        [
            f"the driver re-read a fresh view ({what} on a state, counters"
            + (" and intent log" if read_log else "")
            + " read at this instant): an executor would read and ask again forever"
        ],
        decision,
    )
    found.read_log = read_log
    return found


def needless_wait(node: NodeDesc, state: RendezvousState, guards: Guards) -> list[str]:
    """No wait for what is known gone: a participant of a regroup that expects
    nobody else (the model's ``all_back``: every participant of the last round
    that is not known gone is back, nobody else joined, waits or may join as a
    spare) with a quorum does not wait, for the last call or anything else: it
    completes the round. ``guards`` are the model's, on ``state``, the view the
    node's join decided to wait on."""
    if not (guards.all_back and guards.quorum) or guards.closed or guards.timed_out:
        return []
    if node not in state.participants:
        return []
    return [
        f"needless wait: {node} waits in round {state.round}, a regroup with every "
        "participant of the last round that is not known gone back and a quorum: "
        "nobody else is expected, so the round must complete without a last call"
    ]
