"""Run a node under asyncio: :class:`AsyncRendezvous`, beside the threaded
:class:`~rallypoint.adapters.sync.StateSync`.

An embedder's whole loop::

    rendezvous = AsyncRendezvous(backend, RendezvousNode(desc, settings))
    rendezvous.join()
    async for event in rendezvous.events():
        match event:
            case Joined(membership): start the workers
            case Regroup():          stop them (the node is joining the next round)
            case Done():             break  # left, closed, or an ERROR_* action

:meth:`AsyncRendezvous.events` carries out every other instruction the node asks
for (reads, compare-and-sets, beats, announcements, waits: keep-alive and
watching the round included) against an :class:`AsyncBackend`:
:class:`AsyncMemoryBackend` (one event loop, tests and simulations), or any
blocking :class:`~rallypoint.adapters.backend.RendezvousBackend` (c10d, etcd)
wrapped in :class:`ThreadedBackend`, whose calls run in worker threads
(:func:`asyncio.to_thread`). Cancelling the task that iterates the events stops
the node at once, as a crash would: its peers regroup when its heartbeat stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Protocol, runtime_checkable

from ..core import (
    Done,
    Joined,
    NodeInstruction,
    Outage,
    Regroup,
    RendezvousNode,
    Result,
    Unreachable,
    Verdict,
    WriteResult,
)
from ..core.dispatch import Retry, WaitForPhase, carry_out, wait_timeout
from ..core.errors import RendezvousConnectionError
from .backend import BackendStats, RendezvousBackend, Token, check_intent_entry
from .sync import Codec, call

__all__ = [
    "AsyncBackend",
    "AsyncMemoryBackend",
    "AsyncRendezvous",
    "Event",
    "ThreadedBackend",
]

log = logging.getLogger(__name__)

#: What :meth:`AsyncRendezvous.events` hands the embedder.
Event = Joined | Regroup | Done | Verdict


@runtime_checkable
class AsyncBackend(Protocol):
    """:class:`~rallypoint.adapters.backend.RendezvousBackend`'s contract, awaited
    (see that module for what each call must do)."""

    @property
    def name(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    async def get_state(self) -> tuple[bytes, Token] | None: ...

    async def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None: ...

    async def wait_for_phase(self, phase: int, timeout: float) -> bool: ...

    async def announce(self, round: int, entry: bytes) -> None: ...

    async def intents(self, round: int) -> list[bytes]: ...

    async def beat(self, node: str) -> int: ...

    async def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]: ...

    async def close(self) -> None: ...


class ThreadedBackend:
    """A blocking backend (c10d, etcd, memory) under asyncio: each call runs in a
    worker thread. A cancelled wait leaves its thread to end at its timeout (at
    most the executor's poll interval)."""

    def __init__(self, backend: RendezvousBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.endpoint = backend.endpoint

    @property
    def stats(self) -> BackendStats:
        return self.backend.stats

    @property
    def outages(self) -> object:
        """The wrapped backend's outage count (None: it does not count them)."""
        return getattr(self.backend, "outages", None)

    def key(self, suffix: str) -> str:
        name = getattr(self.backend, "key", None)
        return str(name(suffix)) if callable(name) else suffix

    @property
    def state_size_limit(self) -> object:
        return getattr(self.backend, "state_size_limit", None)

    async def get_state(self) -> tuple[bytes, Token] | None:
        return await asyncio.to_thread(self.backend.get_state)

    async def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        return await asyncio.to_thread(self.backend.set_state, state, token, phase)

    async def wait_for_phase(self, phase: int, timeout: float) -> bool:
        return await asyncio.to_thread(self.backend.wait_for_phase, phase, timeout)

    async def announce(self, round: int, entry: bytes) -> None:
        await asyncio.to_thread(self.backend.announce, round, entry)

    async def intents(self, round: int) -> list[bytes]:
        return await asyncio.to_thread(self.backend.intents, round)

    async def beat(self, node: str) -> int:
        return await asyncio.to_thread(self.backend.beat, node)

    async def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        return await asyncio.to_thread(self.backend.get_heartbeats, list(nodes))

    async def close(self) -> None:
        await asyncio.to_thread(self.backend.close)


class AsyncMemoryBackend:
    """The in-memory backend for one event loop (the reference store: a blob under
    a version token, a side counter per node, the phase, the intent logs).

    Share one instance between the nodes of a test or simulation. Calls do not
    block, except :meth:`wait_for_phase`, which waits for the next publication on
    an :class:`asyncio.Event`. It holds no lock: an embedder cancels nodes' tasks
    at any moment (that is how a node crashes), and a cancelled
    :meth:`asyncio.Condition.wait` has to take its lock back before it can end,
    which under load raised "Lock is not acquired" or never ended.
    """

    def __init__(self, name: str = "memory", endpoint: str = "memory") -> None:
        self.name = name
        self.endpoint = endpoint
        self._blob: bytes | None = None
        self._version = 0
        self._phase = -1  # the highest published phase; -1: none yet
        self._heartbeats: dict[str, int] = {}
        self._intents: dict[int, list[bytes]] = {}
        # Set, then replaced, on each publication (and on close): a waiter that took
        # this one wakes; a later waiter takes the fresh one.
        self._published = asyncio.Event()
        self._closed = False

    async def get_state(self) -> tuple[bytes, Token] | None:
        return None if self._blob is None else (self._blob, self._version)

    async def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if phase is not None and phase < 0:
            raise ValueError(f"phase must be a non-negative integer, got {phase}")
        # Only a version this backend handed out matches (0 stands for "nothing").
        expected = 0 if token is None else token
        if type(expected) is not int or expected != self._version:
            return None if self._blob is None else (self._blob, self._version, False)
        self._blob = bytes(state)
        self._version += 1
        if phase is not None and phase > self._phase:
            self._phase = phase
            self._publish()
        return self._blob, self._version, True

    def _publish(self) -> None:
        published, self._published = self._published, asyncio.Event()
        published.set()

    async def wait_for_phase(self, phase: int, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while not (self._phase > phase or self._closed):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), remaining)
        return self._phase > phase

    async def announce(self, round: int, entry: bytes) -> None:
        self._intents.setdefault(round, []).append(check_intent_entry(entry))

    async def intents(self, round: int) -> list[bytes]:
        return list(self._intents.get(round, ()))

    async def beat(self, node: str) -> int:
        value = self._heartbeats.get(node, 0) + 1
        self._heartbeats[node] = value
        return value

    async def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        return {node: self._heartbeats.get(node, 0) for node in nodes}

    async def close(self) -> None:
        self._closed = True
        self._publish()


class AsyncRendezvous:
    """The asyncio executor of one :class:`~rallypoint.core.RendezvousNode`.

    Args:
        backend: where the state lives (an :class:`AsyncBackend`).
        node: the node to drive.
        clock: the node's monotonic clock (its only kind of time).
        rng: randomness for the backoff after a lost compare-and-set.
        poll_interval: the longest a wait lasts without a phase notification.
        retry_pause: the pause before retrying an unreachable backend; the node
            gives up (the connection error is raised) once its operation's
            deadline passed. A member retries until its lease runs out (it
            regroups, fenced) and its rejoin times out.
    """

    def __init__(
        self,
        backend: AsyncBackend,
        node: RendezvousNode,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        poll_interval: float = 1.0,
        retry_pause: float = 0.1,
    ) -> None:
        self.backend = backend
        self.node = node
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._poll_interval = poll_interval
        self._retry = Retry(pause=retry_pause)
        self._codec = Codec(backend, node.settings)
        self._outages_seen = getattr(backend, "outages", None)
        self._wake = asyncio.Event()

    # -- what the embedder asks for ---------------------------------------------------

    def join(self) -> None:
        """Join the next round (leaving the current one); :meth:`events` yields
        :class:`Joined` when it completes."""
        self._start(self.node.join)

    def leave(self) -> None:
        """Leave the rendezvous for good; :meth:`events` ends with :class:`Done`."""
        self._start(self.node.leave)

    def close(self) -> None:
        """Close the rendezvous for every node; :meth:`events` ends with :class:`Done`."""
        self._start(self.node.close)

    def _start(self, begin: Callable[[float], None]) -> None:
        begin(self._clock())
        self._wake.set()  # a wait in progress ends now

    async def events(self) -> AsyncIterator[Event]:
        """Carry out the node's instructions and yield what the embedder acts on:
        :class:`Joined` (start the workers), :class:`Regroup` (stop them),
        :class:`Done` (the operation is over; the iteration ends unless another
        was started meanwhile), :class:`Verdict` (after ``node.watch``).

        Raises:
            RendezvousConnectionError: the backend stayed unreachable past the
                operation's deadline.
            RendezvousStateError: the backend holds something rallypoint did not write.
        """
        node = self.node
        result: Result | None = None
        losses = 0
        while node.busy:
            self._wake.clear()
            instruction = node.step(result, self._clock())
            if isinstance(instruction, (Joined, Regroup, Done, Verdict)):
                result = None
                yield instruction
                continue
            try:
                result = await self._carry_out(instruction)
            except RendezvousConnectionError as exc:
                if self._retry.gives_up(self._clock(), node.deadline):
                    raise
                log.warning("%s: backend unreachable, retrying: %s", node.desc, exc)
                result = Unreachable()
                await asyncio.sleep(self._retry.unreachable_pause(self._rng))
                continue
            if type(result) is WriteResult and not result.won:
                losses += 1
                await asyncio.sleep(self._retry.backoff(losses, self._rng))
            elif type(result) is WriteResult:
                losses = 0

    # -- carrying out instructions ----------------------------------------------------

    async def _carry_out(self, instruction: NodeInstruction) -> Result:
        """Carry ``instruction`` out (:func:`rallypoint.core.dispatch.carry_out`,
        each operation awaited); the result to step the node with."""
        outages = getattr(self.backend, "outages", None)
        if outages != self._outages_seen:
            # The store rode out an outage: time the peers afresh first.
            self._outages_seen = outages
            return Outage()
        node = self.node
        steps = carry_out(
            instruction, self._codec, node=node.desc, state=node.state, token=node.token
        )
        answer = None
        while True:
            try:
                op = steps.send(answer)
            except StopIteration as end:
                result: Result = end.value
                return result
            if type(op) is WaitForPhase:
                answer = await self._wait(op)
            else:
                answer = await call(self.backend, op)

    async def _wait(self, op: WaitForPhase) -> bool:
        """wait_for_phase, ended early by :meth:`_start` (a new operation)."""
        timeout = wait_timeout(op.until, self._clock(), self._poll_interval)
        waiting = asyncio.ensure_future(self.backend.wait_for_phase(op.phase, timeout))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({waiting, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not waiting.done():
                waiting.cancel()
        return waiting.done() and not waiting.cancelled() and waiting.result()
