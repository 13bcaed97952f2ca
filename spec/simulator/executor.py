"""The executor of one simulated node's instructions (:class:`SimExecutor`): it
carries each out through the core's dispatch (:func:`rallypoint.core.dispatch.carry_out`,
as StateSync and AsyncRendezvous do) against the simulated backend, with the IO
turned into events, and feeds the result back to the node.

A request is one event to the backend, which serves all of the instruction's
operations at that instant (a Read's state, counters and intent log in one round
trip) and answers with the result (a ``response`` event). A ``WaitForPhase`` is
a phase watch and a wake timer, whichever ends first. The agent
(:class:`rallypoint.spec.simulator.agent.SimAgent`) decides what to carry out
and when; the executor tells it, through ``resume``, when to decide again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ...core import NodeDesc, NodeInstruction, RendezvousState, Result, Unreachable, WriteResult
from ...core.dispatch import (
    Operation,
    Retry,
    Steps,
    WaitForPhase,
    carry_out,
    run_steps,
    wait_timeout,
)
from .backend import Backend
from .events import EventLoop
from .node import SimNode

__all__ = ["EXECUTOR_EVENTS", "IN_MEMORY", "InMemoryCodec", "SimExecutor"]

#: The events a node's executor handles (each by its method ``on_<kind>``).
EXECUTOR_EVENTS = ("response", "retry", "wake")


class InMemoryCodec:
    """The simulated store holds the objects themselves: states, node descs as
    heartbeat keys and intent entries (no bytes, so that a read of a 10,000-node
    state costs no decoding). The counters a read answers are every node's (an
    immutable snapshot, not copied); the driver looks up the members'."""

    def decode(self, stored: RendezvousState) -> RendezvousState:
        return stored

    def encode(self, state: RendezvousState) -> RendezvousState:
        return state

    def counter_keys(self, nodes: Collection[NodeDesc]) -> Collection[NodeDesc]:
        return nodes

    def counters(
        self, nodes: Collection[NodeDesc], raw: Mapping[NodeDesc, int]
    ) -> Mapping[NodeDesc, int]:
        return raw

    def heartbeat_key(self, node: NodeDesc) -> NodeDesc:
        return node

    def intent_entry(self, node: NodeDesc) -> NodeDesc:
        return node

    def intents(self, round_: int, raw: Sequence[NodeDesc]) -> Sequence[NodeDesc]:
        return raw


#: The codec of every simulated node (it holds nothing).
IN_MEMORY = InMemoryCodec()


def _no_more(op: Operation) -> Any:
    raise AssertionError(f"a wait's steps asked for more: {op!r}")


class SimExecutor:
    """Carries one node slot's instructions out against the simulated backend.

    Args:
        node: the slot (its clock, its core, its request token).
        loop: the run's event loop.
        backend: the simulated backend.
        resume: called when the node must decide again (a result was fed).
    """

    def __init__(
        self, node: SimNode, loop: EventLoop, backend: Backend, resume: Callable[[], None]
    ) -> None:
        self.node = node
        self.loop = loop
        self.backend = backend
        self.config = loop.config
        self.stats = loop.report.stats[node.slot]
        self._resume = resume
        #: StateSync's backoff after lost compare-and-sets, capped at max_backoff
        self._backoff = Retry(max_backoff=self.config.max_backoff).backoff
        #: the steps of the Wait in progress (None: none)
        self._waiting: Steps | None = None

    def carry_out(self, instruction: NodeInstruction) -> bool:
        """Start carrying ``instruction`` out. True: it is done already (its
        result fed: decide again); False: it is in flight (``resume`` follows)."""
        node = self.node
        core = node.core
        steps = carry_out(
            instruction, IN_MEMORY, node=node.desc, state=core.state, token=core.token
        )
        try:
            op = next(steps)
        except StopIteration as end:
            self._feed(end.value)
            return True
        if type(op) is WaitForPhase:
            self._wait(steps, op)
        else:
            self._request(steps, op, instruction)
        return False

    def cancel(self) -> None:
        """Forget the request, wait or backoff in flight (its events are dropped)."""
        node = self.node
        node.req += 1
        node.waiting = False
        self._waiting = None

    def _feed(self, result: Result) -> None:
        self.node.core.feed(result, self.node.local(self.loop.now))

    # -- requests ---------------------------------------------------------------------

    def _request(self, steps: Steps, op: Operation, instruction: NodeInstruction) -> None:
        """Send the request of ``steps`` (``op``: its first operation): lost while
        the node is partitioned (``request_timeout``), else served after the
        latency."""
        node = self.node
        loop = self.loop
        node.req += 1
        if node.partitioned:
            loop.at(loop.now + self.config.request_timeout, "request_timeout", node.slot, node.req)
            return
        loop.at(
            loop.now + loop.delay(),
            "backend_request",
            node.slot,
            node.req,
            (steps, op, instruction),
        )

    def on_response(self, result: Result) -> None:
        """The backend answered the request in flight: feed the result to the
        core (a lost compare-and-set backs off first) and decide again."""
        node = self.node
        self._feed(result)
        if type(result) is WriteResult:
            if not result.won:
                node.losses += 1
                delay = self._backoff(node.losses, self.loop.rng)
                self.loop.at(self.loop.now + delay, "retry", node.slot, node.req)
                return
            node.losses = 0
        self._resume()

    def on_retry(self, data: Any) -> None:
        """The backoff after a lost compare-and-set is over: decide again."""
        self._resume()

    def unreachable(self) -> None:
        """The request in flight was lost: the node reads again when it decides."""
        self._feed(Unreachable())

    # -- waits ----------------------------------------------------------------------------

    def _wait(self, steps: Steps, op: WaitForPhase) -> None:
        """StateSync's wait_for_phase: a phase watch, and a wake just past
        ``until`` or after poll_interval, whichever comes first."""
        node = self.node
        now = node.local(self.loop.now)
        timeout = wait_timeout(op.until, now, self.config.poll_interval, self.config.wake_epsilon)
        node.req += 1
        node.waiting = True
        self._waiting = steps
        self.loop.at(node.global_time(now + timeout), "wake", node.slot, node.req)
        self.backend.watch(node, op.phase)

    def end_wait(self, changed: bool) -> None:
        """The Wait in progress ended (``changed``: by a notification, else by its
        timer): feed its result; the caller decides again."""
        node = self.node
        node.waiting = False
        node.req += 1  # drop the other of notification and wake
        self.backend.unwatch(node)
        self.stats.wakeups += 1
        steps, self._waiting = self._waiting, None
        assert steps is not None
        self._feed(run_steps(steps, _no_more, changed))

    def on_wake(self, data: Any) -> None:
        """A Wait's timer ran out before any notification."""
        if not self.node.waiting:
            return
        self.end_wait(False)
        self._resume()
