"""Bad shared state met through a backend or the sync engine (``StateSync``): every
mistake a typed error that names what it read.

* CAS losses back off with a bounded delay, and a c10d state value that is not a
  state is a state error at once (not a spin until the join timeout); so is a
  state with a participant but no heartbeat entry;
* nodes started with different node counts on one run id are told so, by name;
* garbage under a heartbeat, bootstrap, intent, phase or state key is a
  ``RendezvousStateError`` naming the key;
* a state too large for the backend is refused, naming the backend's limit, before
  the write fails.

What ``decode_state`` itself accepts and refuses is in ``tests/core/test_codec.py``;
the settings comparison alone in ``tests/core/test_settings.py``.

Tests marked ``integration`` start real servers (TCPStore / etcd on free 127.0.0.1
ports, or the bootstrap store each handler hosts), stopped in finalizers; the others
run the sync engine on the memory backend. Every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from helpers.core_scenarios import joined, node, settings
from torch.distributed import FileStore, HashStore, TCPStore

from rallypoint.adapters import MemoryBackend, RallypointHandler, RendezvousStateError
from rallypoint.adapters import sync as sync_module
from rallypoint.adapters.c10d import C10dBackend
from rallypoint.adapters.etcd import EtcdBackend, EtcdServer
from rallypoint.adapters.sync import StateSync
from rallypoint.core import (
    MAX_STATE_BYTES,
    JoinOp,
    NodeDesc,
    RendezvousState,
    Settings,
    decode_state,
    dispatch,
    encode_state,
)
from rallypoint.core import errors as core_errors

# --- helpers --------------------------------------------------------------------------


@pytest.fixture
def tcp_server() -> Iterator[TCPStore]:
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10)
    )
    yield server
    del server


def _tcp_client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def _c10d(server: TCPStore, run_id: str) -> C10dBackend:
    return C10dBackend(
        _tcp_client(server),
        run_id,
        endpoint=f"127.0.0.1:{server.port}",
        wait_store=_tcp_client(server),
    )


@pytest.fixture
def etcd_backend(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> Callable[[str], EtcdBackend]:
    import pyetcd

    clients: list[object] = []

    def make(run_id: str) -> EtcdBackend:
        client = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=10)
        clients.append(client)
        return EtcdBackend(client, run_id, endpoint=etcd_server.endpoint)

    request.addfinalizer(lambda: [c.close() for c in clients])  # type: ignore[attr-defined]
    return make


def _quick_settings(run_id: str, min_nodes: int = 1, max_nodes: int = 1, **kw: object) -> Settings:
    options: dict[str, object] = {
        "keep_alive_interval": 0.1,
        "keep_alive_max_attempt": 2,
        "last_call_timeout": 0.2,
        "join_timeout": 5.0,
    }
    options.update(kw)
    return Settings(run_id, min_nodes, max_nodes, **options)  # type: ignore[arg-type]


# --- 1. CAS losses: bounded backoff; a value that is not a state fails at once --------


class _LosingBackend(MemoryBackend):
    """Loses the first ``losses`` compare-and-sets as if another node always won."""

    def __init__(self, losses: int) -> None:
        super().__init__("losing")
        self.losses_left = losses

    def set_state(self, state, token, phase=None):  # type: ignore[no-untyped-def]
        if self.losses_left > 0:
            self.losses_left -= 1
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        return super().set_state(state, token, phase)


def test_a_long_run_of_cas_losses_backs_off_with_a_bounded_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1,100 losses in a row (``0.001 * 2**losses`` would overflow a float): every
    backoff stays within the cap, and the join completes once a write wins."""
    delays: list[float] = []
    fake_time = types.SimpleNamespace(sleep=delays.append, monotonic=time.monotonic)
    monkeypatch.setattr(sync_module, "time", fake_time)
    backend = _LosingBackend(losses=1_100)
    sync = StateSync(backend, node(0), settings(1, 1))
    done = sync.run(JoinOp(), time.monotonic() + 60)
    assert done.state.complete and node(0) in done.state.participants
    assert len(delays) >= 1_100
    assert max(delays) <= dispatch.MAX_BACKOFF


@pytest.mark.integration
def test_c10d_state_value_that_is_not_a_state_fails_at_once(tcp_server: TCPStore) -> None:
    """``0:zz:junk`` (version 0, but not the empty marker) used to read as "no state"
    while every create lost against it: a spin until the join timeout."""
    backend = _c10d(tcp_server, "junk")
    backend.store.set("rallypoint/junk/state", b"0:zz:junk")
    sync = StateSync(backend, node(0), settings(1, 1))
    started = time.monotonic()
    with pytest.raises(RendezvousStateError) as caught:
        sync.run(JoinOp(), time.monotonic() + 60)
    assert time.monotonic() - started < 20  # at once, not at the deadline
    assert "rallypoint/junk/state" in str(caught.value)
    assert isinstance(caught.value, core_errors.RendezvousStateError)


# --- 2. a state nobody can make progress from fails a join at once --------------------


def _doc(state: RendezvousState) -> dict:  # type: ignore[type-arg]
    return json.loads(encode_state(state))


def _bytes(doc: dict) -> bytes:  # type: ignore[type-arg]
    return json.dumps(doc).encode()


def test_a_state_with_a_participant_but_no_heartbeat_fails_the_join_at_once() -> None:
    """Such a state used to be accepted; agents waited out the join timeout."""
    s = _quick_settings("stall", 2, 2, join_timeout=60.0)
    state = joined([node(1)], s)
    backend = MemoryBackend("stall")
    doc = _doc(state)
    doc["hb"] = []
    backend.set_state(_bytes(doc), None)
    sync = StateSync(backend, node(0), s)
    started = time.monotonic()
    with pytest.raises(RendezvousStateError, match="has no heartbeat entry"):
        sync.run(JoinOp(), time.monotonic() + 60)
    assert time.monotonic() - started < 20  # at once, not at the join timeout


# --- 3. nodes that disagree on their settings -----------------------------------------


@pytest.fixture
def handlers() -> Iterator[Callable[..., RallypointHandler]]:
    backend = MemoryBackend("mixed")
    store = HashStore()
    made: list[RallypointHandler] = []

    def make(min_nodes: int, max_nodes: int, **kw: object) -> RallypointHandler:
        handler = RallypointHandler(
            backend,
            _quick_settings("mixed", min_nodes, max_nodes, **kw),
            local_addr="127.0.0.1",
            store=store,
        )
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler._stop_heartbeats()


@pytest.mark.integration
def test_nodes_started_with_different_node_counts_are_told_which_setting_differs(
    handlers: Callable[..., RallypointHandler],
) -> None:
    """A node started with another max_nodes is refused with a settings error naming
    the difference, not an ``InvalidTransitionError: ... round is full`` later."""
    first = handlers(1, 3, last_call_timeout=1.0)
    joiner = threading.Thread(target=first.next_rendezvous, daemon=True)
    joiner.start()
    try:
        deadline = time.monotonic() + 5
        while first.sync.state.participants == {} and time.monotonic() < deadline:
            time.sleep(0.01)
        second = handlers(1, 1)
        with pytest.raises(core_errors.RendezvousError, match="disagree") as caught:
            second.next_rendezvous()
    finally:
        joiner.join(timeout=10)
    message = str(caught.value)
    assert "max_nodes" in message and "3" in message and "1" in message
    assert "min_nodes" not in message  # only what differs
    assert type(caught.value).__name__ == "RendezvousSettingsError"


@pytest.mark.integration
def test_settings_published_under_their_key_must_be_rallypoint_settings(
    handlers: Callable[..., RallypointHandler],
) -> None:
    handler = handlers(1, 1)
    handler._store.set("rallypoint/mixed/settings", b"nonsense")
    with pytest.raises(RendezvousStateError, match="rallypoint/mixed/settings"):
        handler.next_rendezvous()


@pytest.mark.integration
def test_nodes_with_the_same_settings_pass_the_check(
    handlers: Callable[..., RallypointHandler],
) -> None:
    a, b = handlers(2, 2), handlers(2, 2)
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert {a.round, b.round} == {0}


# --- 4. garbage under a key: a typed error naming the key -----------------------------


@pytest.mark.integration
def test_c10d_heartbeat_key_with_garbage_names_the_key(tcp_server: TCPStore) -> None:
    backend = _c10d(tcp_server, "hbjunk")
    backend.store.set("rallypoint/hbjunk/hb/host1_101_0", b"abc")
    with pytest.raises(RendezvousStateError, match="rallypoint/hbjunk/hb/host1_101_0"):
        backend.get_heartbeats(["host1_101_0"])


@pytest.mark.integration
def test_etcd_heartbeat_key_with_garbage_names_the_key(
    etcd_backend: Callable[[str], EtcdBackend],
) -> None:
    backend = etcd_backend("hbjunk-etcd")
    key = backend.key("hb/host1_101_0")
    backend.client.put(key, b"abc")
    with pytest.raises(RendezvousStateError, match=key):
        backend.get_heartbeats(["host1_101_0"])
    with pytest.raises(RendezvousStateError, match=key):
        backend.beat("host1_101_0")


@pytest.mark.integration
def test_etcd_phase_key_with_garbage_names_the_key(
    etcd_backend: Callable[[str], EtcdBackend],
) -> None:
    backend = etcd_backend("phasejunk-etcd")
    backend.client.put(backend.key("phase"), b"abc")
    with pytest.raises(RendezvousStateError, match=backend.key("phase")):
        backend.wait_for_phase(0, 0.1)


@pytest.mark.integration
def test_c10d_bootstrap_key_with_garbage_names_the_key(tcp_server: TCPStore) -> None:
    made = []
    for _ in range(2):
        backend = _c10d(tcp_server, "bootjunk")
        made.append(
            RallypointHandler(backend, _quick_settings("bootjunk", 2, 2), local_addr="127.0.0.1")
        )
    try:
        for handler in made:
            made[0]._store.set(f"rallypoint/bootjunk/boot/{handler.node}", b"garbage")
        errors: list[BaseException] = []

        def join(handler: RallypointHandler) -> None:
            try:
                handler.next_rendezvous()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in made]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        # rank 0 uses its own address; the other node reads rank 0's key
        assert len(errors) == 1, errors
        assert isinstance(errors[0], RendezvousStateError), errors[0]
        rank0 = min(h.node for h in made)
        assert f"rallypoint/bootjunk/boot/{rank0}" in str(errors[0])
    finally:
        for handler in made:
            handler._stop_heartbeats()


@pytest.mark.integration
def test_a_corrupt_state_error_names_the_state_key(tcp_server: TCPStore) -> None:
    backend = _c10d(tcp_server, "statejunk")
    backend.set_state(b'{"v": 2}', None)
    sync = StateSync(backend, node(0), settings(1, 1))
    with pytest.raises(RendezvousStateError, match="rallypoint/statejunk/state"):
        sync.run(JoinOp(), time.monotonic() + 5)


class _LoseFirstWrite:
    """A backend whose first compare-and-set loses, as under contention: the loser
    then joins through the intent log (and reads it)."""

    def __init__(self, backend: C10dBackend) -> None:
        self._backend = backend
        self._lost = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)

    def set_state(self, state, token, phase=None):  # type: ignore[no-untyped-def]
        if not self._lost:
            self._lost = True
            current = self._backend.get_state()
            return None if current is None else (current[0], current[1], False)
        return self._backend.set_state(state, token, phase)


@pytest.mark.integration
def test_an_intent_entry_that_is_not_a_node_names_the_intent_key(tcp_server: TCPStore) -> None:
    backend = _c10d(tcp_server, "intentjunk")
    backend.announce(0, b"not a node")
    sync = StateSync(_LoseFirstWrite(backend), node(0), settings(2, 2))  # type: ignore[arg-type]
    with pytest.raises(RendezvousStateError, match="rallypoint/intentjunk/intents/0"):
        sync.run(JoinOp(), time.monotonic() + 5)


# --- 5. the backend's own size limit, said before the write fails ---------------------


def _state_of_size(target: int, s: Settings) -> RendezvousState:
    """An incomplete round whose encoded size is exactly ``target`` bytes (long
    addresses, so that few nodes fill it)."""

    def build(count: int, last: int) -> RendezvousState:
        nodes = [NodeDesc(f"{i:08d}".ljust(1000, "a"), 1, 0) for i in range(count - 1)]
        nodes.append(NodeDesc("z" * last, 1, 0))
        return RendezvousState(
            participants={n: 0 for n in nodes},
            heartbeats={n: 1 for n in nodes},
            heartbeat_seq=1,
        )

    base = len(encode_state(build(1, 1)))
    per_node = len(encode_state(build(2, 1))) - base
    count = 1 + (target - base) // per_node
    last = 1 + (target - len(encode_state(build(count, 1)))) // 2
    state = build(count, last)
    if len(encode_state(state)) < target:  # an odd remainder: one more digit
        state = state.evolve(heartbeat_seq=19)
    assert len(encode_state(state)) == target, len(encode_state(state))
    assert decode_state(encode_state(state), s) == state
    return state


@pytest.mark.integration
def test_c10d_and_etcd_report_their_own_state_size_limit(
    tcp_server: TCPStore, tmp_path: Path, etcd_backend: Callable[[str], EtcdBackend]
) -> None:
    tcp = _c10d(tcp_server, "limits").state_size_limit
    assert tcp is not None and tcp.max_bytes <= 8 * 1024 * 1024 and "TCPStore" in tcp.reason
    path = str(tmp_path / "store")
    file = C10dBackend(FileStore(path, -1), "limits", endpoint=path).state_size_limit
    assert file is None or file.max_bytes == MAX_STATE_BYTES
    etcd = etcd_backend("limits").state_size_limit
    assert etcd is not None and etcd.max_bytes < 1536 * 1024 and "max-request-bytes" in etcd.reason


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_a_state_at_the_reported_limit_is_stored(
    kind: str, tcp_server: TCPStore, request: pytest.FixtureRequest
) -> None:
    backend = (
        _c10d(tcp_server, "at-limit")
        if kind == "tcp"
        else request.getfixturevalue("etcd_backend")("at-limit")
    )
    limit = backend.state_size_limit.max_bytes
    result = backend.set_state(b"x" * limit, None, phase=1_000_000)
    assert result is not None and result[2]
    assert backend.get_state()[0] == b"x" * limit  # type: ignore[index]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_a_state_over_the_backend_limit_is_refused_before_the_write(
    kind: str, tcp_server: TCPStore, request: pytest.FixtureRequest
) -> None:
    run_id = f"too-big-{kind}"
    backend = (
        _c10d(tcp_server, run_id)
        if kind == "tcp"
        else request.getfixturevalue("etcd_backend")(run_id)
    )
    s = _quick_settings(run_id, 100_000, 100_000)
    full = _state_of_size(backend.state_size_limit.max_bytes, s)
    stored = backend.set_state(encode_state(full), None)
    assert stored is not None and stored[2]
    # A joiner with a long address: its write is ~2 KiB larger, past the backend's
    # own limit too (before the check, the write itself failed).
    sync = StateSync(backend, NodeDesc("y" * 1000, 1, 0), s)
    with pytest.raises(RendezvousStateError) as caught:
        # refused at the first write; the deadline bounds a join that was let in
        # (it would wait for 100,000 nodes), with room for reading and decoding the
        # MiB-sized state on a loaded host (5 s was not enough there)
        sync.run(JoinOp(), time.monotonic() + 60)
    message = str(caught.value)
    assert "limit" in message and backend.state_size_limit.reason in message
    assert backend.get_state()[0] == encode_state(full)  # type: ignore[index]
