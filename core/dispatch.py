"""How a node's instructions are carried out against a store, with no IO: the one
dispatch every executor drives.

:func:`carry_out` turns one instruction of a :class:`~rallypoint.core.RendezvousNode`
(``Read``, ``Write``, ``Beat``, ``Announce``, ``Wait``) into the store operations
it takes, in order, and the result to step the node with. It is a generator: it
yields each operation, takes the operation's answer back (``send``), and returns
the result. An executor only performs operations::

    steps = carry_out(instruction, codec, node=desc, state=node.state, token=node.token)
    answer = None
    while True:
        try:
            op = steps.send(answer)
        except StopIteration as end:
            result = end.value          # step the node with it
            break
        answer = perform(op)            # a blocking call, an ``await``, or an event

The threaded executor (:class:`rallypoint.adapters.StateSync`) performs each
operation with a blocking call (:func:`run_steps`), the asyncio one
(:class:`rallypoint.adapters.aio.AsyncRendezvous`) with an ``await``, the
simulator (:mod:`rallypoint.spec.simulator`) as events against its simulated
store. What an instruction asks of the store is therefore written once, here, in
:data:`CARRY_OUT`; :mod:`rallypoint.core.node` documents the same obligations in
prose. A new instruction is a new entry there, and a new operation is one more
call for each executor to perform.

The operations and their answers (each is one call of the store protocol,
:class:`rallypoint.adapters.backend.RendezvousBackend`):

==================== ============================== ==========================================
operation            backend call                   answer
==================== ============================== ==========================================
GetState()           get_state()                    ``(stored, token)``, or None: nothing stored
SetState(s, t, p)    set_state(s, t, phase=p)       ``(stored, token, won)``, or None
GetHeartbeats(keys)  get_heartbeats(keys)           each key's side counter (raw)
GetIntents(round)    intents(round)                 the round's intent log (raw entries)
AppendIntent(r, e)   announce(r, e)                 None
BumpHeartbeat(key)   beat(key)                      the counter after the bump
WaitForPhase(p, u)   wait_for_phase(p, timeout)     True: a phase above ``p`` was published
==================== ============================== ==========================================

How values look at the store (bytes and strings for a real one, the objects
themselves for the simulator's) is a :class:`StoreCodec`'s business, passed in.

What an executor does between instructions is decided here too, with the time and
the random numbers passed in (no clock is read here): the backoff after lost
compare-and-sets and the retries of an unreachable store (:class:`Retry`), and how
long a ``Wait`` blocks (:func:`wait_timeout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from .driver import Announce, Beat, Read, Wait, Write
from .node import (
    AnnounceResult,
    BeatResult,
    ReadResult,
    Result,
    WaitResult,
    WriteResult,
)
from .state import NodeDesc, RendezvousState

__all__ = [
    "CARRY_OUT",
    "MAX_BACKOFF",
    "WAKE_EPSILON",
    "AppendIntent",
    "BumpHeartbeat",
    "GetHeartbeats",
    "GetIntents",
    "GetState",
    "Operation",
    "Retry",
    "SetState",
    "Steps",
    "StoreCodec",
    "Uniform",
    "WaitForPhase",
    "backoff_delay",
    "carry_out",
    "run_steps",
    "wait_timeout",
]


# -- the operations: what an executor performs ------------------------------------------


class GetState(NamedTuple):
    """Read the stored state and its compare-and-set token."""


class SetState(NamedTuple):
    """Compare-and-set ``state`` (encoded) over ``token``; after a win, publish
    ``phase`` if it is not None."""

    state: Any
    token: object
    phase: int | None


class GetHeartbeats(NamedTuple):
    """Read the side heartbeat counter under each of ``keys`` (0: never beat)."""

    keys: Collection[Any]


class GetIntents(NamedTuple):
    """Read the intent log of ``round``, in append order."""

    round: int


class AppendIntent(NamedTuple):
    """Append ``entry`` to the intent log of ``round``."""

    round: int
    entry: Any


class BumpHeartbeat(NamedTuple):
    """Bump the side heartbeat counter under ``key``."""

    key: Any


class WaitForPhase(NamedTuple):
    """Block until a phase above ``phase`` is published, or just past local time
    ``until`` (None: a phase only), at most a poll interval either way
    (:func:`wait_timeout`)."""

    phase: int
    until: float | None


Operation = (
    GetState | SetState | GetHeartbeats | GetIntents | AppendIntent | BumpHeartbeat | WaitForPhase
)
#: The steps of one instruction: yields operations, takes their answers, returns
#: the result to step the node with.
Steps = Generator[Operation, Any, Result]


class StoreCodec(Protocol):
    """How a store holds the node's values: the state, the heartbeat keys and the
    intent entries. A real store holds bytes and strings (the adapters' codec,
    which also names the key and the remedy in its errors); the simulator's holds
    the objects themselves."""

    def decode(self, stored: Any) -> RendezvousState:
        """The state of a stored value (raises on one rallypoint did not write)."""
        ...

    def encode(self, state: RendezvousState) -> Any:
        """The stored value of ``state`` (raises on one the store cannot hold)."""
        ...

    def counter_keys(self, nodes: Collection[NodeDesc]) -> Collection[Any]:
        """The keys of the side counters of ``nodes``."""
        ...

    def counters(self, nodes: Collection[NodeDesc], raw: Any) -> Mapping[NodeDesc, int]:
        """Each of ``nodes``' side counter (0: never beat), from what
        :class:`GetHeartbeats` answered."""
        ...

    def heartbeat_key(self, node: NodeDesc) -> Any:
        """The key of ``node``'s own side counter."""
        ...

    def intent_entry(self, node: NodeDesc) -> Any:
        """``node``'s entry in an intent log."""
        ...

    def intents(self, round_: int, raw: Any) -> Sequence[NodeDesc]:
        """The nodes of the intent log of ``round_`` (raises on an entry that is
        not a node)."""
        ...


# -- carrying out one instruction --------------------------------------------------------


def _read(
    instruction: Read,
    codec: StoreCodec,
    node: NodeDesc,
    held: RendezvousState | None,
    token: object,
) -> Steps:
    if instruction.state:
        stored = yield GetState()
        state = None if stored is None else codec.decode(stored[0])
        token = None if stored is None else stored[1]
    else:
        # The state a lost compare-and-set returned stays, with its token.
        state = held
    side: Mapping[NodeDesc, int] | None = None
    if instruction.counters:
        members = () if state is None else state.heartbeats
        side = {}
        if members:
            raw = yield GetHeartbeats(codec.counter_keys(members))
            side = codec.counters(members, raw)
    log = None
    if instruction.intents:
        round_ = 0 if state is None else state.round
        log = codec.intents(round_, (yield GetIntents(round_)))
    return ReadResult(state, token, side, log)


def _write(
    instruction: Write,
    codec: StoreCodec,
    node: NodeDesc,
    held: RendezvousState | None,
    token: object,
) -> Steps:
    answer = yield SetState(codec.encode(instruction.state), token, instruction.phase)
    if answer is None:
        return WriteResult(False, None, None)
    return WriteResult(answer[2], codec.decode(answer[0]), answer[1])


def _beat(
    instruction: Beat,
    codec: StoreCodec,
    node: NodeDesc,
    held: RendezvousState | None,
    token: object,
) -> Steps:
    return BeatResult((yield BumpHeartbeat(codec.heartbeat_key(node))))


def _announce(
    instruction: Announce,
    codec: StoreCodec,
    node: NodeDesc,
    held: RendezvousState | None,
    token: object,
) -> Steps:
    yield AppendIntent(instruction.round, codec.intent_entry(node))
    return AnnounceResult()


def _wait(
    instruction: Wait,
    codec: StoreCodec,
    node: NodeDesc,
    held: RendezvousState | None,
    token: object,
) -> Steps:
    return WaitResult(bool((yield WaitForPhase(instruction.phase, instruction.until))))


#: What each instruction asks of the store (the instructions not here -- Done,
#: Verdict, Joined, Regroup -- are the caller's to act on, not the store's).
CARRY_OUT: Mapping[type, Callable[..., Steps]] = {
    Read: _read,
    Write: _write,
    Beat: _beat,
    Announce: _announce,
    Wait: _wait,
}


def carry_out(
    instruction: object,
    codec: StoreCodec,
    *,
    node: NodeDesc,
    state: RendezvousState | None,
    token: object,
) -> Steps:
    """The steps that carry ``instruction`` out for ``node``, whose view held
    ``state`` with the compare-and-set ``token`` when it returned the instruction
    (a ``Write`` is set over that token; a ``Read`` without ``state`` keeps them).

    Raises:
        TypeError: ``instruction`` is not one the store carries out.
    """
    steps = CARRY_OUT.get(type(instruction))
    if steps is None:
        raise TypeError(f"{instruction!r} is not an instruction to carry out against the store")
    return steps(instruction, codec, node, state, token)


def run_steps(steps: Steps, perform: Callable[[Operation], Any], answer: Any = None) -> Result:
    """Drive ``steps`` to their result, performing each operation with
    ``perform`` (a blocking call). ``answer``: the answer to the operation the
    steps yielded last, when an executor performed it itself (None: they have not
    started)."""
    try:
        while True:
            answer = perform(steps.send(answer))
    except StopIteration as end:
        result: Result = end.value
        return result


# -- between instructions: waits, backoff and retries ------------------------------------

#: A decision flips strictly after Wait.until; wake just past it (timer resolution).
WAKE_EPSILON = 0.002
#: The largest backoff after lost compare-and-sets, in seconds.
MAX_BACKOFF = 0.05
#: Beyond this many losses in a row the backoff is at its cap anyway; the exponent
#: stops growing there (2.0 ** 1024 overflows a float).
_MAX_BACKOFF_EXPONENT = 16


class Uniform(Protocol):
    """Random numbers (a :class:`random.Random`): an executor passes its own, so
    that a seed replays its choices."""

    def uniform(self, a: float, b: float) -> float: ...


def backoff_delay(losses: int, rng: Uniform, cap: float | None = None) -> float:
    """Seconds to hold off after ``losses`` lost compare-and-sets in a row: spreads
    out a herd of simultaneous joiners without delaying the first retry much
    (jittered, exponential, capped at ``cap``, default :data:`MAX_BACKOFF`; the
    exponent is capped too, so it never overflows)."""
    exponent = min(losses, _MAX_BACKOFF_EXPONENT)
    limit = MAX_BACKOFF if cap is None else cap
    return rng.uniform(0, min(limit, 0.001 * 2**exponent))


def wait_timeout(
    until: float | None, now: float, poll_interval: float, epsilon: float | None = None
) -> float:
    """How long a Wait(until) blocks at ``now``: just past ``until`` (by
    ``epsilon``, default :data:`WAKE_EPSILON`), and never longer than
    ``poll_interval`` (a notification lost with a crashed writer)."""
    if until is None:
        return poll_interval
    margin = WAKE_EPSILON if epsilon is None else epsilon
    return min(poll_interval, max(0.0, until - now) + margin)


class Retry(NamedTuple):
    """How an executor goes on after a lost compare-and-set or an unreachable
    store (its numbers are the executor's options; time and random numbers are
    passed in).

    ``window``: how long (seconds from the first failure) an unreachable store is
    retried before the error is raised; ``pause``: the mean pause between those
    tries (jittered by half of it either way); ``max_backoff``: the cap of the
    backoff after lost compare-and-sets (None: :data:`MAX_BACKOFF`).
    """

    window: float = math.inf
    pause: float = 0.1
    max_backoff: float | None = None

    def backoff(self, losses: int, rng: Uniform) -> float:
        """The hold-off after ``losses`` lost compare-and-sets in a row
        (:func:`backoff_delay`)."""
        return backoff_delay(losses, rng, self.max_backoff)

    def unreachable_pause(self, rng: Uniform) -> float:
        """The pause before trying an unreachable store again."""
        return self.pause / 2 + rng.uniform(0, self.pause)

    def gives_up(self, now: float, deadline: float, down_for: float = 0.0) -> bool:
        """Whether to stop retrying an unreachable store (and raise) at ``now``:
        it has been down for the whole window, or the operation's ``deadline``
        passed (math.inf: none)."""
        return down_for >= self.window or now > deadline
