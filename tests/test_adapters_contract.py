"""The backend contract, one suite for every implementation.

memory, c10d over a TCPStore, c10d over a FileStore, and etcd v3 on a real etcd
server (started by the ``etcd_server`` fixture). Each ``make()`` call returns a new
client of the same storage and run id, as a second node would hold;
``make(suffix)`` a client of another run id on the same storage.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import pytest
from torch.distributed import FileStore, TCPStore

from rallypoint.adapters import MemoryBackend, RendezvousBackend
from rallypoint.adapters.c10d import C10dBackend
from rallypoint.adapters.etcd import EtcdBackend, EtcdServer

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

_run_ids = itertools.count()


class Make(Protocol):
    def __call__(self, suffix: str = "") -> RendezvousBackend:
        """A new client of run ``<the test's run id><suffix>``."""
        ...


def _memory(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    backends: dict[str, MemoryBackend] = {}

    def make(suffix: str = "") -> RendezvousBackend:
        # One MemoryBackend is one run's storage: clients of a run share it.
        return backends.setdefault(suffix, MemoryBackend("contract" + suffix))

    return make


def _tcp(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    timeout = timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timeout)
    run_id = f"contract-{next(_run_ids)}"

    def make(suffix: str = "") -> RendezvousBackend:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        waiter = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        endpoint = f"127.0.0.1:{server.port}"
        return C10dBackend(client, run_id + suffix, endpoint=endpoint, wait_store=waiter)

    # The server lives as long as the clients' factory (the test).
    make.server = server  # type: ignore[attr-defined]
    return make


def _file(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    path = str(tmp_path / "store")

    def make(suffix: str = "") -> RendezvousBackend:
        return C10dBackend(
            FileStore(path, -1), "contract" + suffix, endpoint=path, wait_store=FileStore(path, -1)
        )

    return make


def _etcd(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    import pyetcd

    server: EtcdServer = request.getfixturevalue("etcd_server")
    run_id = f"contract-{next(_run_ids)}"
    clients: list[object] = []

    def make(suffix: str = "") -> RendezvousBackend:
        client = pyetcd.client("127.0.0.1", server.client_port, timeout=10)
        clients.append(client)
        return EtcdBackend(client, run_id + suffix, endpoint=server.endpoint)

    request.addfinalizer(lambda: [c.close() for c in clients])  # type: ignore[attr-defined]
    return make


@pytest.fixture(params=[_memory, _tcp, _file, _etcd], ids=["memory", "tcp", "file", "etcd"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    yield request.param(tmp_path, request)


def test_empty_backend_has_no_state(make: Make) -> None:
    assert make().get_state() is None


def test_first_write_creates_the_state(make: Make) -> None:
    a, b = make(), make()
    blob, token, won = a.set_state(b"one", None)  # type: ignore[misc]
    assert (blob, won) == (b"one", True)
    assert b.get_state() == (b"one", token)


def test_create_loses_when_state_exists(make: Make) -> None:
    a, b = make(), make()
    _, token, _ = a.set_state(b"one", None)  # type: ignore[misc]
    assert b.set_state(b"two", None) == (b"one", token, False)
    assert a.get_state() == (b"one", token)


def test_stale_token_loses_and_returns_the_current_state(make: Make) -> None:
    a, b = make(), make()
    _, t1, _ = a.set_state(b"one", None)  # type: ignore[misc]
    _, t2, won = b.set_state(b"two", t1)  # type: ignore[misc]
    assert won and t2 != t1
    assert a.set_state(b"three", t1) == (b"two", t2, False)
    assert a.get_state() == (b"two", t2)


def test_every_write_gets_a_new_token(make: Make) -> None:
    a = make()
    token = None
    seen = set()
    for _ in range(5):
        _, token, won = a.set_state(b"same", token)  # type: ignore[misc]
        assert won
        seen.add(token)
    assert len(seen) == 5


def test_concurrent_increments_lose_no_update(make: Make) -> None:
    make().set_state(b"0", None)
    wins_each = 5

    def worker(backend: RendezvousBackend) -> None:
        wins = 0
        current = backend.get_state()
        while wins < wins_each:
            assert current is not None
            blob, token = current
            result = backend.set_state(str(int(blob) + 1).encode(), token)
            assert result is not None
            blob, token, won = result
            wins += won
            current = (blob, token)

    threads = [threading.Thread(target=worker, args=(make(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    state = make().get_state()
    assert state is not None and int(state[0]) == 4 * wins_each


def test_wait_times_out_without_a_change(make: Make) -> None:
    a = make()
    _, token, _ = a.set_state(b"one", None)  # type: ignore[misc]
    assert a.wait_for_change(token, 0.05) is False


def test_wait_returns_at_once_for_a_stale_token(make: Make) -> None:
    a = make()
    _, t1, _ = a.set_state(b"one", None)  # type: ignore[misc]
    a.set_state(b"two", t1)
    assert a.wait_for_change(t1, 30.0) is True


@pytest.mark.parametrize("created", [False, True])
def test_wait_wakes_on_another_clients_write(make: Make, created: bool) -> None:
    a, b = make(), make()
    token = a.set_state(b"one", None)[1] if created else None  # type: ignore[index]
    started = threading.Event()

    def write() -> None:
        started.wait(10)
        b.set_state(b"two", token)

    writer = threading.Thread(target=write)
    writer.start()
    started.set()
    try:
        # Generous timeout: the call returns as soon as the write lands; a False
        # here means the notification never came.
        assert a.wait_for_change(token, 30.0) is True
    finally:
        writer.join(timeout=30)
    assert a.get_state()[0] == b"two"  # type: ignore[index]


def test_heartbeats_count_per_node(make: Make) -> None:
    a, b = make(), make()
    assert a.get_heartbeats(["x", "y"]) == {"x": 0, "y": 0}
    assert a.beat("x") == 1
    assert b.beat("x") == 2
    assert b.beat("y") == 1
    assert a.get_heartbeats(["x", "y", "z"]) == {"x": 2, "y": 1, "z": 0}


def test_a_heartbeat_does_not_rewrite_the_state(make: Make) -> None:
    a = make()
    _, token, _ = a.set_state(b"x" * 10_000, None)  # type: ignore[misc]
    before = a.stats.heartbeat_bytes_written
    a.beat("node-1")
    per_beat = a.stats.heartbeat_bytes_written - before
    assert 0 < per_beat < 100
    # The state's token is untouched: a beat is not a state write.
    assert a.get_state() == (b"x" * 10_000, token)


# -- phases: waiters wake on a phase change, not on every write -------------------------

#: Bound on a wait that should time out. FileStore's ``wait`` rounds its timeout up
#: to whole seconds (a 0.05 s wait returns after ~1 s), hence the slack.
_TIMEOUT_SLACK = 3.0


def _wait_in_thread(backend: RendezvousBackend, phase: int) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(backend.wait_for_phase(phase, 30.0)))
    thread.start()
    return thread, result


def _phase_wait_during_a_write(
    waiting: RendezvousBackend, writing: RendezvousBackend, token: object, phase: int
) -> list[bool]:
    """What ``waiting.wait_for_phase(0)`` returns while ``writing`` wins a write of
    ``phase`` over ``token`` ([]: the wait was still blocked 30 s later)."""
    waiter, result = _wait_in_thread(waiting, 0)
    try:
        _, _, won = writing.set_state(b"two", token, phase=phase)  # type: ignore[misc]
        assert won
    finally:
        # Generous bound: the wait returns as soon as the write lands; a waiter
        # still blocked here means the phase was never published.
        waiter.join(timeout=30)
    return result


@pytest.mark.parametrize("created", [False, True])
def test_a_won_write_with_a_phase_wakes_a_phase_waiter(make: Make, created: bool) -> None:
    a, b = make(), make()
    token = a.set_state(b"one", None, phase=0)[1] if created else None  # type: ignore[index]
    assert _phase_wait_during_a_write(b, a, token, phase=1) == [True]


def test_a_write_that_keeps_the_phase_wakes_no_phase_waiter(make: Make) -> None:
    a, b = make(), make()
    _, token, _ = a.set_state(b"one", None, phase=3)  # type: ignore[misc]
    done = threading.Event()

    def write() -> None:
        nonlocal token
        _, token, _ = a.set_state(b"two", token)  # type: ignore[misc]
        _, token, _ = a.set_state(b"three", token, phase=3)  # type: ignore[misc]
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert b.wait_for_phase(3, 0.3) is False
    finally:
        writer.join(timeout=30)
    assert done.is_set()
    assert b.get_state() == (b"three", token)
    assert b.wait_for_phase(2, 30.0) is True


def test_a_lost_write_publishes_no_phase(make: Make) -> None:
    a, b = make(), make()
    _, t1, _ = a.set_state(b"one", None, phase=0)  # type: ignore[misc]
    _, t2, won = b.set_state(b"two", t1)  # type: ignore[misc]
    assert won
    assert a.set_state(b"three", t1, phase=1) == (b"two", t2, False)
    assert a.set_state(b"four", None, phase=1) == (b"two", t2, False)
    started = time.monotonic()
    assert b.wait_for_phase(0, 0.05) is False
    assert time.monotonic() - started < 0.05 + _TIMEOUT_SLACK


def test_a_lost_first_write_publishes_no_phase(make: Make) -> None:
    written = make().set_state(b"x", None)
    assert written is not None
    fresh = make("-fresh")
    # A token of another run: nothing is stored here, so the write loses (None).
    assert fresh.set_state(b"one", written[1], phase=1) is None
    assert fresh.wait_for_phase(0, 0.05) is False


def test_wait_for_phase_returns_at_once_for_a_passed_phase(make: Make) -> None:
    a, b = make(), make()
    token = None
    for phase in range(3):
        _, token, _ = a.set_state(b"s%d" % phase, token, phase=phase)  # type: ignore[misc]
    started = time.monotonic()
    assert b.wait_for_phase(0, 30.0) is True
    assert b.wait_for_phase(1, 30.0) is True
    assert time.monotonic() - started < 10.0


def test_wait_for_phase_times_out(make: Make) -> None:
    a = make()
    started = time.monotonic()
    assert a.wait_for_phase(0, 0.0) is False  # nothing ever written
    assert time.monotonic() - started < _TIMEOUT_SLACK
    a.set_state(b"one", None, phase=2)
    started = time.monotonic()
    assert a.wait_for_phase(2, 0.05) is False
    assert time.monotonic() - started < 0.05 + _TIMEOUT_SLACK


# -- intents: one append per joiner, the log read in one operation ---------------------


def test_intents_keep_append_order_and_duplicates_per_round(make: Make) -> None:
    a, b = make(), make()
    a.announce(1, b"node-a")
    b.announce(1, b"node-b")
    a.announce(10, b"node-c")
    a.announce(1, b"node-a")
    b.announce(2, b"")
    assert a.intents(1) == [b"node-a", b"node-b", b"node-a"]
    assert b.intents(1) == [b"node-a", b"node-b", b"node-a"]
    assert b.intents(10) == [b"node-c"]
    assert a.intents(2) == [b""]


def test_an_entry_equal_to_the_whole_log_is_still_appended(make: Make) -> None:
    # torch's fallback Store.append (FileStore) drops exactly this append.
    a, b = make(), make()
    a.announce(4, b"same")
    b.announce(4, b"same")
    a.announce(4, b"same")
    assert a.intents(4) == [b"same", b"same", b"same"]


def test_an_announced_entry_is_visible_to_every_client_at_once(make: Make) -> None:
    # TCPStore's append returns before the server applied it; announce must not.
    a, b = make(), make()
    for round in range(100):
        a.announce(round, b"a%d" % round)
        assert b.intents(round) == [b"a%d" % round]


def test_intents_of_a_round_nobody_announced_in_are_empty(make: Make) -> None:
    a = make()
    assert a.intents(7) == []
    assert a.intents(7) == []  # the read created nothing
    a.announce(7, b"x")
    assert a.intents(7) == [b"x"]
    assert a.intents(0) == []


def test_intents_are_isolated_between_run_ids(make: Make) -> None:
    a, other = make(), make("-other")
    a.announce(1, b"mine")
    other.announce(1, b"theirs")
    assert a.intents(1) == [b"mine"]
    assert other.intents(1) == [b"theirs"]
    assert make().intents(1) == [b"mine"]


def test_an_intent_with_a_newline_is_rejected(make: Make) -> None:
    a = make()
    with pytest.raises(ValueError, match="newline"):
        a.announce(1, b"half\nhalf")
    with pytest.raises(ValueError, match="newline"):
        a.announce(1, b"\n")
    assert a.intents(1) == []


def test_concurrent_announces_lose_no_entry(make: Make) -> None:
    per_client = 10

    def worker(backend: RendezvousBackend, name: str) -> None:
        for i in range(per_client):
            backend.announce(3, b"%s-%d" % (name.encode(), i))

    names = ["a", "b", "c", "d"]
    threads = [threading.Thread(target=worker, args=(make(), n)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    log = make().intents(3)
    assert sorted(log) == sorted(b"%s-%d" % (n.encode(), i) for n in names for i in range(10))
    for n in names:  # each client's entries in its own order
        mine = [e for e in log if e.startswith(n.encode() + b"-")]
        assert mine == [b"%s-%d" % (n.encode(), i) for i in range(per_client)]


def test_new_operations_are_counted(make: Make) -> None:
    a = make()
    entry = b"e" * 30
    a.announce(1, b"f" * 1000)
    ops, written = a.stats.ops, a.stats.bytes_written
    a.announce(1, entry)
    # At most two operations (TCPStore: the append and a check that it landed;
    # FileStore, without native append: a read and a compare-and-set).
    assert ops < a.stats.ops <= ops + 2
    if not (isinstance(a, C10dBackend) and isinstance(a.store, FileStore)):
        # O(len(entry)): the entry and a key, never the state or the log.
        assert len(entry) <= a.stats.bytes_written - written < len(entry) + 200
    a.announce(1, entry)
    ops, read = a.stats.ops, a.stats.bytes_read
    assert a.intents(1) == [b"f" * 1000, entry, entry]
    assert a.stats.ops == ops + 1
    assert a.stats.bytes_read - read >= 1000 + 2 * len(entry)
    ops = a.stats.ops
    a.wait_for_phase(0, 0.0)
    assert a.stats.ops > ops


# -- backend-specific ---------------------------------------------------------------


def test_etcd_writes_the_phase_in_the_state_txn(etcd_server: EtcdServer) -> None:
    import pyetcd

    client = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=10)
    try:
        backend = EtcdBackend(client, f"contract-{next(_run_ids)}", endpoint=etcd_server.endpoint)
        key = backend.key("phase")

        def stored() -> tuple[bytes | None, int | None]:
            value, meta = client.get(key)
            return value, None if meta is None else int(meta.mod_revision)

        assert stored() == (None, None)
        _, t1, _ = backend.set_state(b"one", None, phase=5)  # type: ignore[misc]
        # Same revision as the state: one txn.
        assert stored() == (b"5", t1)
        _, t2, won = backend.set_state(b"two", t1)  # type: ignore[misc]
        assert won and stored() == (b"5", t1)  # no phase: key untouched
        assert backend.set_state(b"three", t1, phase=6) == (b"two", t2, False)
        assert stored() == (b"5", t1)  # a lost write: key untouched
        _, t3, won = backend.set_state(b"four", t2, phase=6)  # type: ignore[misc]
        assert won and stored() == (b"6", t3)
    finally:
        client.close()


def test_c10d_next_phase_wakes_waiters_a_dead_writer_stranded() -> None:
    timeout = timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timeout)

    def make() -> C10dBackend:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        waiter = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        return C10dBackend(client, "stranded", endpoint="", wait_store=waiter)

    a, b = make(), make()
    _, t0, _ = a.set_state(b"zero", None, phase=0)  # type: ignore[misc]
    # A writer moves the state to phase 1, then dies before setting p/1.
    dead = b"2:dead:one"
    assert a.store.compare_set("rallypoint/stranded/state", t0, dead) == dead  # type: ignore[arg-type]
    assert b.wait_for_phase(0, 0.05) is False
    assert _phase_wait_during_a_write(b, a, dead, phase=2) == [True]
