"""One node, driven through one entry point: :meth:`RendezvousNode.step`.

A :class:`RendezvousNode` is everything one node knows (its view, the
compare-and-set token of the state it last read, its operation and deadline)
and every decision it makes, with no IO: it wraps the driver
(:mod:`rallypoint.core.driver`). The embedder holds one per node and runs one
loop, in the spirit of etcd-io/raft's ``RawNode.Step``/``Ready`` and dask's
``handle_stimulus``: carry out the instruction, hand its result back with the
node's own monotonic time, take the next instruction::

    node = RendezvousNode(desc, settings)
    node.join(clock())
    result = None
    while True:
        instruction = node.step(result, clock())
        result = carry_out(instruction)   # the table below

There is one kind of time: ``now``, the node's own monotonic clock in seconds,
passed to every call. Keep-alive and monitoring are instructions the node asks
for (a :class:`~rallypoint.core.driver.Beat`, a :class:`~rallypoint.core.driver.Read`,
a :class:`~rallypoint.core.driver.Wait` until the next check), so the embedder
needs to know neither their cadence nor the operators behind them.

What each instruction obliges the caller to do, in this order (the store's part of
it is :func:`rallypoint.core.dispatch.carry_out`, which an executor may drive
instead of writing it again):

``Read(counters, intents, state)``
    1. Unless ``state`` is False, read the stored state and its token (decode it
       with :func:`~rallypoint.core.decode_state`). With ``state`` False (right
       after a lost compare-and-set, which returned what is stored) read nothing
       of the state: "that state" below is the one the node holds
       (:attr:`RendezvousNode.view`), and the result's ``state`` and ``token`` are
       None; the node keeps the state and token it holds.
    2. With ``counters``, read the side heartbeat counter of every node in that
       state's ``heartbeats`` (0 for a node that never beat). A store keys the
       counters by ``str(desc)`` (a string is what a store can hold); the result
       maps each :class:`~rallypoint.core.NodeDesc` to its counter, so look each
       node up by ``str(node)``.
    3. With ``intents``, read the intent log of that state's round (0 when
       nothing is stored) and turn each entry back into a node with
       :meth:`NodeDesc.parse <rallypoint.core.NodeDesc.parse>` (an entry is the
       ``str(desc)`` that an ``Announce`` appended), in append order. An entry
       that does not parse was written by something other than a node of this
       run: report it as a :class:`~rallypoint.core.RendezvousStateError`.
    Then step with :class:`ReadResult` (``state=None`` when nothing is stored or
    ``state`` was False).
``Write(state, phase=...)``
    Compare-and-set :func:`~rallypoint.core.encode_state` of ``state`` over the
    token :attr:`RendezvousNode.token` held when ``step`` returned the write;
    after a win, publish ``phase`` if it is not None. Then step with
    :class:`WriteResult` (on a loss: what is stored now, and its token). Back off
    a little (jittered) before stepping after a loss: others are writing too
    (the bundled executors wait a uniform draw from 0 to ``min(0.05, 0.001 *
    2**losses)`` seconds, ``losses`` the losses in a row:
    :func:`rallypoint.core.dispatch.backoff_delay`; a herd of joiners spreads
    out and a lone loser retries at once). A
    won write may move the operation's deadline (``Write.deadline``: a redundant
    node that became a joiner); the node keeps it in :attr:`RendezvousNode.deadline`.
``Beat()``
    Bump this node's own side heartbeat counter; step with :class:`BeatResult`.
``Announce(round)``
    Append this node (``str(desc)``) to the intent log of ``round``; step with
    :class:`AnnounceResult`.
``Wait(until, phase)``
    Block until a phase above ``phase`` is published, or just past local time
    ``until`` (None: a phase only; cap the wait at a poll interval either way, a
    notification may be lost: the bundled executors poll every second and wake
    2 ms past ``until``); step with :class:`WaitResult`. A phase above ``phase``
    published already (before the wait began) ends the wait at once: answer
    ``WaitResult(changed=True)`` without blocking. A wait that ended early for
    no reason (a spurious wake-up, the poll cap) is ``changed=False``. A node in
    an operation reads again after any wait; a member looks at its round at once
    after ``True`` and at its next watch (at most ``watch_interval`` later) after
    ``False``. So a wrong ``True`` costs a read and a wrong ``False`` a delay,
    never a wrong decision.
``Joined(membership)``
    (after :meth:`RendezvousNode.join`) The round completed: start this node's
    workers with ``membership`` (round, rank, world size). Step with None: the
    node then keeps itself alive and watches the round.
``Regroup(round, lost, waiting, fenced)``
    Stop the workers of ``round`` now (peers were lost, nodes wait to join, or
    with ``fenced`` this node's lease ran out). Step with None: the node joins
    the next round (a :class:`Joined` follows).
``Done(action, ...)``
    The node's operation is over: :attr:`Action.FINISH` (a leave, a close, or
    an operation started with :meth:`RendezvousNode.start`) or an ERROR_* action
    (closed, timed out, graceful exit). The node is idle until the next
    operation.
``Verdict(waiting, lost)``
    (only after :meth:`RendezvousNode.watch`) What a node whose workers run
    must act on; the node is then idle.

When the store cannot be reached, step with :class:`Unreachable` (the node
reads afresh) after a pause, and give up when the operation's deadline
(:attr:`RendezvousNode.deadline`) passed. A store that rides out an outage
itself reports it with :class:`Outage` (peers are timed afresh).

While its workers run, a node stops them as soon as :meth:`RendezvousNode.must_fence`
says so (no IO); a member's steps check it too, and answer :class:`Regroup`
with ``fenced``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from . import driver
from .actions import Action
from .driver import (
    Announce,
    Beat,
    Done,
    MemberResponse,
    Membership,
    NodeView,
    Read,
    Verdict,
    Wait,
    Write,
)
from .operators import CloseOp, ExitOp, JoinOp, KeepAliveOp, LeaveOp, Operator
from .state import NodeDesc, RendezvousState, Settings

__all__ = [
    "AnnounceResult",
    "BeatResult",
    "Joined",
    "NodeInstruction",
    "Outage",
    "ReadResult",
    "Regroup",
    "RendezvousNode",
    "Result",
    "Unreachable",
    "WaitResult",
    "WriteResult",
    "keep_alive_period",
]


# -- results: what the caller hands back --------------------------------------------


class ReadResult(NamedTuple):
    """What a :class:`~rallypoint.core.driver.Read` found.

    ``state``: the stored state (None: nothing is stored, or the read did not ask
    for it); ``token``: its compare-and-set token; ``side_counters``: every
    member's side heartbeat counter, if the read asked for them; ``intents``: the
    round's intent log, if the read asked for it.
    """

    state: RendezvousState | None
    token: object = None
    side_counters: Mapping[NodeDesc, int] | None = None
    intents: Sequence[NodeDesc] | None = None


class WriteResult(NamedTuple):
    """What a compare-and-set did: ``won``, and what is stored now (the written
    state after a win; after a loss, what beat it, None if nothing) with its
    token."""

    won: bool
    stored: RendezvousState | None
    token: object = None


class BeatResult(NamedTuple):
    """The node's side heartbeat counter after a :class:`~rallypoint.core.driver.Beat`."""

    counter: int


class AnnounceResult(NamedTuple):
    """The node's entry is in the intent log it was asked to append to."""


class WaitResult(NamedTuple):
    """A :class:`~rallypoint.core.driver.Wait` ended; ``changed``: a phase above the
    one waited on was published (False: the time ran out, or it ended early)."""

    changed: bool = False


class Unreachable(NamedTuple):
    """The instruction could not be carried out: the store was unreachable."""


class Outage(NamedTuple):
    """The store reports it was unreachable for a while (it rode the outage out
    itself): nobody could beat meanwhile, so the node times its peers afresh."""


Result = ReadResult | WriteResult | BeatResult | AnnounceResult | WaitResult | Unreachable | Outage


# -- outcomes of the node's own lifecycle -------------------------------------------------


class Joined(NamedTuple):
    """The round completed: start the workers with ``membership``; step with None."""

    membership: Membership
    state: RendezvousState


class Regroup(NamedTuple):
    """Stop the workers of ``round`` now; step with None and the node joins the
    next round. ``lost``: participants gone (the node itself when its peers removed
    it); ``waiting``: nodes waiting to join; ``fenced``: this node's lease ran out
    (it could not renew its heartbeat, so its peers may regroup without it)."""

    round: int
    lost: frozenset[NodeDesc]
    waiting: int
    fenced: bool = False


NodeInstruction = Read | Write | Beat | Announce | Wait | Done | Verdict | Joined | Regroup


def keep_alive_period(settings: Settings) -> float:
    """How often a member runs :class:`~rallypoint.core.KeepAliveOp`: a quarter
    keep-alive interval. The operator decides whether a beat is due (an interval
    after the node's counter last moved); checking four times an interval sends a
    due beat at most a quarter interval late, well inside the liveness window. Every
    executor of a member (the node's own lifecycle, the torch handler's heartbeat
    thread, the simulator's agents) keeps this one cadence."""
    return settings.keep_alive_interval / 4


# What the node is driving.
_IDLE, _OPERATION, _WATCH = 0, 1, 2
# What the node's lifecycle does when its operation ends (none: hand the end back).
_NONE, _JOINING, _MEMBER = 0, 1, 2


class RendezvousNode:
    """One node: its view, its token, its operation and its lifecycle.

    Args:
        desc: this node.
        settings: the rendezvous settings (the same on every node).
        view: the view to decide on (default: a new one, nothing read). A node
            given a view counts as registered (its heartbeat key exists).
        watch_interval: the longest a member goes without looking at the group
            (default: half the keep-alive interval); it also looks whenever a
            phase is published.

    Attributes:
        view: what the node knows; it changes in place with every step.
        token: the compare-and-set token of the state in :attr:`view`.
        deadline: local time after which the current operation times out.
        membership: the round this node's workers run in (None: none).
        read_at: local time of the last read or write result (None: never).
    """

    __slots__ = (
        "_after",
        "_announcing",
        "_beat_at",
        "_beat_sent",
        "_joined",
        "_keep_state",
        "_member_op",
        "_registered",
        "_task",
        "_watch_at",
        "_watch_due",
        "_watch_interval",
        "_write_deadline",
        "_write_sent",
        "deadline",
        "desc",
        "membership",
        "op",
        "read_at",
        "settings",
        "token",
        "view",
    )

    def __init__(
        self,
        desc: NodeDesc,
        settings: Settings,
        *,
        view: NodeView | None = None,
        watch_interval: float | None = None,
    ) -> None:
        self.desc = desc
        self.settings = settings
        self.view = NodeView() if view is None else view
        self.token: object = None
        self.op: Operator | None = None
        self.deadline = math.inf
        self.membership: Membership | None = None
        self.read_at: float | None = None
        self._registered = view is not None
        self._task = _IDLE
        self._after = _NONE
        self._joined: Membership | None = None  # the round a watch judges
        self._keep_state = False
        self._announcing = -1
        self._write_deadline: float | None = None
        self._write_sent: float | None = None
        self._beat_sent: float | None = None
        self._watch_interval = (
            settings.keep_alive_interval / 2 if watch_interval is None else watch_interval
        )
        self._beat_at = math.inf
        self._watch_at = math.inf
        self._watch_due = False
        self._member_op = False  # a member's keep-alive is running

    # -- starting work ----------------------------------------------------------------

    def start(
        self, op: Operator, now: float, deadline: float | None = None, *, fresh: bool = False
    ) -> None:
        """Run ``op`` (any operator) until a :class:`Done` hands its end back.

        ``deadline``: local time after which it times out (default: ``now`` plus
        the close timeout); ``fresh``: decide on the view as it is, without
        reading first (it was just read or written, e.g. by the previous operation).
        """
        self._begin(op, now + self.settings.close_timeout if deadline is None else deadline, fresh)
        self._after = _NONE
        self.membership = None

    def watch(self, joined: Membership | None, *, fresh: bool = False) -> None:
        """Look once at the round ``joined`` (None: none joined): the steps end
        with a :class:`Verdict` (an agent that keeps alive and monitors itself;
        :meth:`join` does both for the caller)."""
        if not fresh:
            driver.after_wait(self.view)
        self._task = _WATCH
        self.op = None
        self._joined = joined
        self._after = _NONE

    def join(self, now: float) -> None:
        """Leave the current round (if any) and join the next, within the join
        timeout; the steps end with :class:`Joined`, after which the node keeps
        itself alive and watches its round (:class:`Regroup` when it must stop)."""
        self._begin(ExitOp(), now + self.settings.join_timeout, False)
        self._after = _JOINING
        self.membership = None

    def leave(self, now: float) -> None:
        """Leave the rendezvous for good (the peers regroup at once); the steps
        end with :class:`Done`."""
        self.start(LeaveOp(), now)

    def close(self, now: float) -> None:
        """Close the rendezvous for every node; the steps end with :class:`Done`."""
        self.start(CloseOp(), now)

    def _begin(self, op: Operator, deadline: float, fresh: bool) -> None:
        if not fresh:
            driver.after_wait(self.view)
        self._task = _OPERATION
        self.op = op
        self.deadline = deadline
        self._write_deadline = None  # (a write still in flight moves no new deadline)
        self._member_op = False

    # -- the entry point ---------------------------------------------------------------

    def step(self, result: Result | None, now: float) -> NodeInstruction:
        """Take ``result`` (what the last instruction did; None for the first step
        of an operation, and after :class:`Joined` or :class:`Regroup`) at local
        time ``now``, and return the next instruction (see the module docstring
        for what each obliges the caller to do)."""
        if result is not None:
            self.feed(result, now)
        return self.next(now)

    def feed(self, result: Result, now: float) -> None:
        """Take ``result`` without deciding (an executor whose threads share a
        node feeds each result under its lock, and asks :meth:`next` when it
        decides)."""
        view, desc = self.view, self.desc
        if type(result) is ReadResult:
            state, token = result.state, result.token
            if state is None and self._keep_state:
                state, token = view.state, self.token
            self._keep_state = False
            self.token = token
            self.read_at = now
            driver.after_read(view, desc, state, result.side_counters, now, result.intents)
        elif type(result) is WriteResult:
            self.token = result.token
            self.read_at = now
            driver.after_write(view, desc, result.won, result.stored, now, self._write_sent)
            if result.won and self._write_deadline is not None and self._task == _OPERATION:
                self.deadline = self._write_deadline
        elif type(result) is BeatResult:
            self._registered = True
            driver.after_beat(view, desc, result.counter, now, self._beat_sent)
        elif type(result) is AnnounceResult:
            driver.after_announce(view, self._announcing)
        elif type(result) is WaitResult:
            if self._after == _MEMBER and self._task == _IDLE:
                # A member's wait: a published phase calls for a look at the group
                # (the look reads); the keep-alive decides on the cached view.
                self._watch_due = self._watch_due or result.changed
            else:
                driver.after_wait(view)
        elif type(result) is Unreachable:
            driver.after_wait(view)
            if self._after == _MEMBER and self._task != _IDLE:
                # A member drops its keep-alive or look (the next tick tries again)
                # and waits for the store with no deadline: its lease decides.
                self._task = _IDLE
                self._member_op = False
                self.deadline = math.inf
        elif type(result) is Outage:
            driver.after_outage(view, desc)
        else:
            raise TypeError(f"not a result of a node's instruction: {result!r}")

    def next(self, now: float) -> NodeInstruction:
        """The next instruction at local time ``now`` (after :meth:`feed`)."""
        while True:
            if not self.busy:
                raise RuntimeError(
                    f"{self.desc} has nothing to do: start an operation (join, leave, close)"
                )
            if not self._registered:
                # Create this node's heartbeat key before the state can name it, so
                # that readers find every member's key in one round trip.
                return self._beat(now)
            task = self._task
            instruction: NodeInstruction
            if task == _OPERATION:
                assert self.op is not None
                instruction = driver.decide(
                    self.view, self.desc, self.settings, self.op, self.deadline, now
                )
            elif task == _WATCH:
                instruction = driver.watch(self.view, self.desc, self.settings, self._joined, now)
            else:
                instruction = self._member_next(now)
            if type(instruction) is Write:
                self._write_sent = now
                self._write_deadline = instruction.deadline
                return instruction
            if type(instruction) is Beat:
                return self._beat(now)
            if type(instruction) is Read:
                self._keep_state = not instruction.state
                return instruction
            if type(instruction) is Announce:
                self._announcing = instruction.round
                return instruction
            if type(instruction) is Done:
                self._task = _IDLE
                ended = self._ended(instruction, now)
                if ended is None:
                    continue
                return ended
            if type(instruction) is Verdict:
                self._task = _IDLE
                if self._after != _MEMBER:
                    return instruction
                judged = self._judged(instruction, now)
                if judged is None:
                    continue
                return judged
            return instruction  # Wait, Joined, Regroup

    def _beat(self, now: float) -> Beat:
        self._beat_sent = now
        return Beat()

    def _ended(self, done: Done, now: float) -> NodeInstruction | None:
        """What the lifecycle makes of an operation's end (None: drive on)."""
        after, op = self._after, self.op
        if after == _MEMBER and self._member_op:
            self._member_op = False
            self.deadline = math.inf  # a member has none; its lease decides
            return None  # a keep-alive that failed is retried at the next tick
        if after != _JOINING or done.action is not Action.FINISH:
            self._after = _NONE
            return done
        if isinstance(op, ExitOp):
            self._begin(JoinOp(), self.deadline, True)  # on the exit's view
            return None
        if done.rejoin:
            # The round lost its rank 0 before this node saw it complete: nobody
            # can host its workers' store. Leave it and join the next.
            self._begin(ExitOp(), self.deadline, False)
            return None
        assert done.joined is not None
        self.membership = self._joined = done.joined
        self._after = _MEMBER
        self.deadline = math.inf
        self._beat_at = now + keep_alive_period(self.settings)
        self._watch_at = now + self._watch_interval
        self._watch_due = False
        return Joined(done.joined, done.state)

    def _judged(self, verdict: Verdict, now: float) -> NodeInstruction | None:
        """What a member makes of a look at its group (None: drive on)."""
        response = driver.member_response(verdict, self.view.state)
        if response is MemberResponse.CLOSED:
            self._after = _NONE
            self.membership = None
            return Done(Action.ERROR_CLOSED, self.view.state)
        if response is MemberResponse.REGROUP:
            return self._regroup(verdict.lost, verdict.waiting, False, now)
        return None

    def _regroup(
        self, lost: frozenset[NodeDesc], waiting: int, fenced: bool, now: float
    ) -> Regroup:
        joined = self.membership
        assert joined is not None
        self.join(now)
        return Regroup(joined.round, lost, waiting, fenced)

    def _member_next(self, now: float) -> NodeInstruction:
        """A member's next task: stop on a lease run out, keep alive on the
        handler's cadence (every quarter keep-alive interval the keep-alive
        operator decides whether a beat is due), look at the group when a phase
        was published or the watch interval passed, else wait for either."""
        if driver.must_fence(self.view, self.desc, self.settings, now):
            return self._regroup(frozenset(), 0, True, now)
        if now >= self._beat_at:
            self._beat_at = now + keep_alive_period(self.settings)
            self._begin(KeepAliveOp(), now + self.settings.heartbeat_timeout, True)
            self._member_op = True
            return self.next(now)
        if self._watch_due or now >= self._watch_at:
            self._watch_due = False
            self._watch_at = now + self._watch_interval
            self.watch(self._joined)
            self._after = _MEMBER
            return self.next(now)
        return Wait(min(self._beat_at, self._watch_at), self.view.state.phase)

    # -- queries (no IO) ---------------------------------------------------------------

    def must_fence(self, now: float) -> bool:
        """Whether this node must stop its workers now: it has not renewed its
        lease for so long that its peers may declare it dead (reads nothing)."""
        return driver.must_fence(self.view, self.desc, self.settings, now)

    @property
    def state(self) -> RendezvousState:
        """The state as last read or written."""
        return self.view.state

    @property
    def busy(self) -> bool:
        """Whether the node is driving something (False: idle until an operation
        starts)."""
        return self._task != _IDLE or self._after == _MEMBER
