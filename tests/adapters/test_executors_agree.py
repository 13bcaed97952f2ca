"""One dispatch: the threaded executor (StateSync) and the asyncio one
(AsyncRendezvous) carry a node's instructions out through the same
``rallypoint.core.dispatch``, so the same operations on the same store make the
same backend calls, in the same order, with the same answers, and step the node
with the same results.

Each executor runs against its own copy of one scripted store (a sync facade
for StateSync, an async one for AsyncRendezvous, over the same logic), which
records every call. The clock is the store's and moves only while a node waits,
so both nodes decide at the same instants. The script: node A registers (a
beat), exits, and joins a round X1 is in, where X2's write beats A's first
compare-and-set, so A joins through the intent log (announce, a read of the
log, a write that admits X2 too) and completes the round once the last call
passes (a wait); then a keep-alive and a look at the round (the counters).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection
from typing import Any

import pytest
from helpers.core_scenarios import joined, node, settings

from rallypoint.adapters import sync as sync_module
from rallypoint.adapters.aio import AsyncBackend, AsyncRendezvous
from rallypoint.adapters.backend import BackendStats, RendezvousBackend, Token
from rallypoint.adapters.errors import RendezvousStateError
from rallypoint.adapters.sync import StateSync
from rallypoint.core import (
    Action,
    Done,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    Membership,
    Operator,
    RendezvousNode,
    RendezvousState,
    Result,
    Verdict,
    WriteResult,
    decode_state,
    encode_state,
)

SETTINGS = settings(2, 4, last_call_timeout=1.0)
A, X1, X2 = node(0), node(1), node(2)
#: every call of the backend protocol a node's instructions make
ALL_CALLS = {
    "get_state",
    "set_state",
    "get_heartbeats",
    "intents",
    "announce",
    "beat",
    "wait_for_phase",
}

Call = tuple[str, tuple[Any, ...], Any]


class ScriptedStore:
    """A RendezvousBackend: a blob under a version, side counters, the published
    phase, intent logs; a clock that moves only in waits; writes of other nodes
    that beat the next compare-and-set; and the record of every call (name,
    arguments, answer). :class:`AsyncStore` is the same store under asyncio."""

    name = "scripted"
    endpoint = "script"
    stats = BackendStats()

    def __init__(
        self, initial: RendezvousState, races: list[Callable[[RendezvousState], RendezvousState]]
    ) -> None:
        self.now = 0.0
        self.blob: bytes | None = encode_state(initial)
        self.version = 1
        self.side: dict[str, int] = {str(X1): 1}
        self.published = initial.phase
        self.logs: dict[int, list[bytes]] = {}
        self.races = list(races)
        self.calls: list[Call] = []
        self.garbage = False

    def clock(self) -> float:
        return self.now

    def record(self, name: str, args: tuple[Any, ...], answer: Any) -> Any:
        self.calls.append((name, args, answer))
        return answer

    def get_state(self) -> tuple[bytes, Token] | None:
        if self.garbage:
            return self.record("get_state", (), (b"not a state", self.version))
        answer = None if self.blob is None else (self.blob, self.version)
        return self.record("get_state", (), answer)

    def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        args = (state, token, phase)
        if self.races:  # another node's write lands first
            assert self.blob is not None
            self.blob = encode_state(self.races.pop(0)(decode_state(self.blob)))
            self.version += 1
        if token != self.version:
            answer = None if self.blob is None else (self.blob, self.version, False)
            return self.record("set_state", args, answer)
        self.blob, self.version = bytes(state), self.version + 1
        if phase is not None:
            self.published = max(self.published, phase)
        return self.record("set_state", args, (self.blob, self.version, True))

    def wait_for_phase(self, phase: int, timeout: float) -> bool:
        changed = self.published > phase
        if not changed:
            self.now += timeout
        return self.record("wait_for_phase", (phase, timeout), changed)  # type: ignore[no-any-return]

    def announce(self, round: int, entry: bytes) -> None:
        self.logs.setdefault(round, []).append(bytes(entry))
        self.record("announce", (round, entry), None)

    def intents(self, round: int) -> list[bytes]:
        return self.record("intents", (round,), list(self.logs.get(round, ())))  # type: ignore[no-any-return]

    def beat(self, node: str) -> int:
        self.side[node] = self.side.get(node, 0) + 1
        return self.record("beat", (node,), self.side[node])  # type: ignore[no-any-return]

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        answer = {n: self.side.get(n, 0) for n in nodes}
        return self.record("get_heartbeats", (list(nodes),), answer)  # type: ignore[no-any-return]

    def close(self) -> None:
        pass


class AsyncStore:
    """The scripted store as an AsyncBackend (every call answers at once)."""

    name = "scripted"
    endpoint = "script"

    def __init__(self, store: ScriptedStore) -> None:
        self.store = store

    async def get_state(self) -> tuple[bytes, Token] | None:
        return self.store.get_state()

    async def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        return self.store.set_state(state, token, phase)

    async def wait_for_phase(self, phase: int, timeout: float) -> bool:
        return self.store.wait_for_phase(phase, timeout)

    async def announce(self, round: int, entry: bytes) -> None:
        self.store.announce(round, entry)

    async def intents(self, round: int) -> list[bytes]:
        return self.store.intents(round)

    async def beat(self, node: str) -> int:
        return self.store.beat(node)

    async def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        return self.store.get_heartbeats(nodes)

    async def close(self) -> None:
        pass


class RecordingNode(RendezvousNode):
    """A RendezvousNode that keeps every result it is stepped with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fed: list[Result] = []

    def feed(self, result: Result, now: float) -> None:
        self.fed.append(result)
        super().feed(result, now)


def new_store() -> ScriptedStore:
    return ScriptedStore(
        joined([X1], SETTINGS), races=[lambda state: joined([X2], SETTINGS, state)]
    )


#: (operator, fresh) run one after the other, then a look at the round joined
OPERATIONS: list[tuple[Operator, bool]] = [(ExitOp(), False), (JoinOp(), True)]


def run_threaded(
    store: ScriptedStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], RecordingNode]:
    nodes: list[RecordingNode] = []

    def recording(*args: Any, **kwargs: Any) -> RecordingNode:
        nodes.append(RecordingNode(*args, **kwargs))
        return nodes[-1]

    monkeypatch.setattr(sync_module, "RendezvousNode", recording)
    assert isinstance(store, RendezvousBackend)
    sync = StateSync(store, A, SETTINGS, clock=store.clock, rng=random.Random(0))
    ends: list[Any] = []
    for op, fresh in OPERATIONS:
        ends.append(sync.run(op, store.now + SETTINGS.join_timeout, fresh=fresh))
    ends.append(sync.run(KeepAliveOp(), store.now + SETTINGS.heartbeat_timeout, fresh=True))
    ends.append(sync.watch(ends[1].joined))
    return ends, nodes[0]


def run_asyncio(store: ScriptedStore) -> tuple[list[Any], RecordingNode]:
    backend = AsyncStore(store)
    assert isinstance(backend, AsyncBackend)
    node = RecordingNode(A, SETTINGS)
    rendezvous = AsyncRendezvous(backend, node, clock=store.clock, rng=random.Random(0))

    async def until_end() -> Any:
        events = [event async for event in rendezvous.events()]
        assert len(events) == 1, events
        return events[0]

    async def script() -> list[Any]:
        ends = []
        for op, fresh in OPERATIONS:
            node.start(op, store.now, store.now + SETTINGS.join_timeout, fresh=fresh)
            ends.append(await until_end())
        node.start(KeepAliveOp(), store.now, store.now + SETTINGS.heartbeat_timeout, fresh=True)
        ends.append(await until_end())
        joined_round: Membership = ends[1].joined
        node.watch(joined_round)
        ends.append(await until_end())
        return ends

    return asyncio.run(script()), node


def test_both_executors_make_the_same_calls_and_feed_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threaded_store, asyncio_store = new_store(), new_store()
    threaded_ends, threaded_node = run_threaded(threaded_store, monkeypatch)
    asyncio_ends, asyncio_node = run_asyncio(asyncio_store)

    calls = threaded_store.calls
    for index, (a, b) in enumerate(zip(calls, asyncio_store.calls, strict=False)):
        assert a == b, f"call {index} differs: StateSync {a} != AsyncRendezvous {b}"
    assert len(calls) == len(asyncio_store.calls)
    assert threaded_node.fed == asyncio_node.fed
    assert threaded_ends == asyncio_ends
    assert threaded_node.view.state == asyncio_node.view.state
    assert threaded_node.token == asyncio_node.token

    # The script is worth comparing: every call, a lost and a won compare-and-set,
    # a join through the intent log, a wait that ran out, a look at the round.
    assert {name for name, _, _ in calls} == ALL_CALLS
    writes = [result for result in threaded_node.fed if type(result) is WriteResult]
    assert [w.won for w in writes][:2] == [False, True]
    assert ("announce", (0, str(A).encode("ascii")), None) in calls
    assert any(name == "wait_for_phase" and answer is False for name, _, answer in calls)
    left, join, keep_alive, verdict = threaded_ends
    assert left.action is join.action is keep_alive.action is Action.FINISH
    assert isinstance(join, Done) and join.joined is not None
    assert join.joined.members == {A, X1, X2}
    assert verdict == Verdict(0, frozenset())


def test_both_executors_fail_alike_on_a_store_that_holds_no_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stored value rallypoint did not write: the same read, the same error."""
    threaded_store, asyncio_store = new_store(), new_store()
    threaded_store.garbage = asyncio_store.garbage = True
    with pytest.raises(RendezvousStateError) as threaded:
        run_threaded(threaded_store, monkeypatch)
    with pytest.raises(RendezvousStateError) as in_asyncio:
        run_asyncio(asyncio_store)
    assert str(threaded.value) == str(in_asyncio.value)
    assert threaded_store.calls == asyncio_store.calls
    assert [name for name, _, _ in threaded_store.calls] == ["beat", "get_state"]
